"""What a checkpoint records (`meta.json`), how it is verified, and whether it fits a run.

`meta.json` is plain JSON: the run's step, DP and CP sizes, mode, layout, micro-batches, the
model config, the training settings, the payload format, **the dtypes of the model's state**,
and SHA-256 sums of every payload file and of every one of these fields
([`read_meta`][cpref.train.checkpoint_meta.read_meta] names the first that differs).

**A checkpoint fits a run** ([`check_fits`][cpref.train.checkpoint_meta.check_fits]) when the model
(its config, hence every shape) and the packs per step (`dp x micro_batches`) match, every
training setting matches or is named in `override`, and the model's tensors have the dtypes
the checkpoint holds. Loading into a model of another dtype would cast every weight and every
Adam moment without a word (float32 into bfloat16 loses 16 bits of each; the run resumed is
not the run saved), so it is refused naming both dtypes, unless `override` names `"dtype"`:
then the cast is deliberate. Each tensor is compared too, when the payload is read
([`check_dtypes`][cpref.train.checkpoint_meta.check_dtypes]): a checkpoint of a model of mixed
dtypes, or one written before the dtypes were recorded (`dtype` is None there), is held to the
same rule.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Collection, Iterable

import torch

from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as files

__all__ = ["FORMAT", "CheckpointMeta", "read_meta", "check_fits", "overridden", "dtypes_of", "check_dtypes"]

FORMAT = "cpref-checkpoint/2"
OPTIONAL = ("dtype",)  # fields a checkpoint of an earlier cpref (same format) may lack


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about its run (`meta.json`).

    Attributes:
        step: steps trained; a resumed run starts at this step.
        dp, cp, mode, layout, micro_batches: how it was trained (`cp`, `mode`, `layout` may change on resume).
        model: the model config (every shape follows from it).
        settings: the training settings that change the run, e.g. `{"lr": 3e-3, "pack_tokens": 512}`.
        payload: the payload format, `"torch"` or `"dcp"`.
        dtype: the dtypes of the model's state, e.g. `"float32"` (`"bfloat16+float32"` where mixed), as
            `save_checkpoint` finds them on the model; None: not recorded (a checkpoint of an earlier cpref).
    """

    step: int
    dp: int
    cp: int
    mode: str
    layout: str
    micro_batches: int
    model: dict
    settings: dict = field(default_factory=dict)
    payload: str = "torch"
    dtype: str | None = None

    @property
    def packs_per_step(self) -> int:
        """Packs consumed per step by the whole run: the data position is `step * packs_per_step`."""
        return self.dp * self.micro_batches


def dtypes_of(model: torch.nn.Module) -> str:
    """The dtypes of `model`'s state (parameters and buffers), sorted and joined by `+`: `"float32"`."""
    return "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in model.state_dict().values()
                            if isinstance(t, torch.Tensor)}))  # fmt: skip


_CAST_FIX = ("build the model in the checkpoint's dtype to resume it exactly (cast it afterwards if that is what you "
             "mean), or cast on load deliberately: load_checkpoint(..., override=('dtype',))")  # fmt: skip


def check_dtypes(where: str, tensors: Iterable[tuple[str, torch.dtype, torch.dtype]]) -> None:
    """Refuse where a checkpoint's tensor has another dtype than the run's: `tensors` are `(name, saved, live)`.

    Raises:
        CPInputError: naming the first tensors that differ, both dtypes, and the fix.
    """
    differ = [(name, saved, live) for name, saved, live in tensors if saved != live]
    if differ:
        shown = "; ".join(f"{n} is {str(s).removeprefix('torch.')} there, {str(v).removeprefix('torch.')} here"
                          for n, s, v in differ[:3])  # fmt: skip
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise CPInputError(f"checkpoint {where}: {shown}{more}; loading would cast them silently, and the run resumed "
                           f"would not be the run saved: {_CAST_FIX}")  # fmt: skip


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sums(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): _sha(p.read_bytes()) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.relative_to(directory).as_posix() not in files.NOT_SUMMED}  # fmt: skip


def _field_sums(record: dict) -> dict[str, str]:
    return {k: _sha(json.dumps(v, sort_keys=True).encode()) for k, v in record.items()}


def meta_json(meta: CheckpointMeta, directory: Path) -> str:
    """The text of `meta.json` for `meta`, with the sums of the files now in `directory` and of every field."""
    record = {f.name: getattr(meta, f.name) for f in fields(CheckpointMeta)}
    sums = {"format": FORMAT, "sha256": _file_sums(directory), "fields_sha256": _field_sums(record)}
    return json.dumps({**record, **sums}, indent=1, sort_keys=True)


def read_meta(directory: str | Path) -> CheckpointMeta:
    """The metadata of a checkpoint, checked for format and for the integrity of its fields and files.

    Raises:
        CPInputError: naming the field or file whose SHA-256 sum differs, a missing or unknown
            field, or another format.
    """
    directory = Path(directory)
    try:
        record = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CPInputError(f"checkpoint {directory}: no readable meta.json ({type(exc).__name__}: {exc})") from None
    fmt = record.pop("format", None) if isinstance(record, dict) else None
    if fmt != FORMAT:
        raise CPInputError(f"checkpoint {directory}: not a {FORMAT} checkpoint (its meta.json says format {fmt!r})")
    file_sums, field_sums = record.pop("sha256", None), record.pop("fields_sha256", None)
    if not isinstance(file_sums, dict) or not isinstance(field_sums, dict):
        raise CPInputError(f"checkpoint {directory}: meta.json has no SHA-256 sums (edited, or not written by cpref)")
    names = {f.name for f in fields(CheckpointMeta)}
    if not names - set(OPTIONAL) <= set(record) <= names:
        raise CPInputError(f"checkpoint {directory}: meta.json has the fields {sorted(record)}, expected {sorted(names)} "
                           "(written by another version of cpref, or edited)")  # fmt: skip
    _compare_sums(directory, "meta.json field", field_sums, _field_sums(record))
    _compare_sums(directory, "file", file_sums, _file_sums(directory))
    return CheckpointMeta(**record)


def _compare_sums(directory: Path, what: str, recorded: dict, actual: dict) -> None:
    differ = sorted(k for k in set(recorded) | set(actual) if recorded.get(k) != actual.get(k))
    if differ:
        how = {k: "missing" if k not in actual else "not in the sums" if k not in recorded else "SHA-256 differs"
               for k in differ}  # fmt: skip
        raise CPInputError(
            f"checkpoint {directory}: its {what}s do not match the SHA-256 sums in meta.json (corrupt or edited): "
            + ", ".join(f"{k} ({v})" for k, v in how.items())
        )


def check_fits(meta: CheckpointMeta, expect: CheckpointMeta, override: Collection[str] = (), where: str = "") -> None:
    """Raise a `CPInputError` unless the checkpoint `meta` fits the run `expect` (see the module docstring).

    `override` may name settings of `expect.settings`, and `"dtype"`; dtypes are compared where both record them.
    """
    # a field one side lacks is its default, None (a checkpoint written before the field existed)
    diff = {k: (meta.model.get(k), expect.model.get(k)) for k in sorted(set(meta.model) | set(expect.model))
            if meta.model.get(k) != expect.model.get(k)}  # fmt: skip
    if diff:
        raise CPInputError(f"checkpoint {where} holds another model: (checkpoint, this run) differ in {diff}")
    if meta.packs_per_step != expect.packs_per_step:
        raise CPInputError(
            f"checkpoint {where} was written with dp x micro_batches = {meta.dp} x {meta.micro_batches} packs per step, "
            f"this run takes {expect.dp} x {expect.micro_batches}: the data position would not carry over"
        )
    unknown = sorted(set(override) - set(expect.settings) - {"dtype"})
    if unknown:
        raise CPInputError(f"override names {unknown}, which are not settings; the settings are {sorted(expect.settings)}"
                           " (and 'dtype', to cast a checkpoint into a model of another dtype)")  # fmt: skip
    if None not in (meta.dtype, expect.dtype) and meta.dtype != expect.dtype and "dtype" not in override:
        raise CPInputError(f"checkpoint {where} holds {meta.dtype} tensors, this run's model {expect.dtype} ones: loading "
                           "would cast every weight and every optimizer moment silently, and the run resumed would not "
                           f"be the run saved; {_CAST_FIX}")  # fmt: skip
    differ = [k for k in sorted(set(meta.settings) | set(expect.settings))
              if meta.settings.get(k) != expect.settings.get(k) and k not in override]  # fmt: skip
    if differ:
        raise CPInputError(
            f"checkpoint {where} was trained with other settings than this run: "
            + "; ".join(f"{k} is {meta.settings.get(k)!r} there, {expect.settings.get(k)!r} here" for k in differ)
            + f". Pass the checkpoint's values, or override them deliberately ({', '.join(f'--override {k}' for k in differ)})"
        )


def overridden(meta: CheckpointMeta, expect: CheckpointMeta, override: Collection[str]) -> list[str]:
    """One line per overridden setting whose value changes: `lr: 0.003 (checkpoint) -> 0.001 (this run)`."""
    return [f"{k}: {meta.settings.get(k)!r} (checkpoint) -> {expect.settings.get(k)!r} (this run)"
            for k in sorted(override) if k in expect.settings and meta.settings.get(k) != expect.settings.get(k)]  # fmt: skip

