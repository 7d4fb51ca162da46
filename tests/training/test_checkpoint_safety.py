"""Checkpoints a training tool can trust: a save never destroys what cpref did not write, an
interrupted save never loses the last complete checkpoint, periodic saves bound what a crash
loses, a resume never silently does something else, and loading runs no code (issue 18, 1-3)."""

from __future__ import annotations

import io
import json
import pickle
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import cpref
import cpref.train.checkpoint as ck
import cpref.train.checkpoint_files as cf
import cpref.train.checkpoint_meta as cm
import cpref.train.checkpoint_swap as cs
from cpref.base.errors import CPInputError
from cpref.comm.protocol import SingleRank
from cpref.models import CausalLM
from cpref.train.training import TrainConfig
from sim.tools.train import RunSpec, main, run_sim

TINY = {"llama": dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)}


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)


def spec(steps, cp=2, lr=3e-3, **kw) -> RunSpec:
    return RunSpec(model="llama", cp=cp, steps=steps, pack_tokens=kw.pop("pack_tokens", 64),
                   train=TrainConfig(mode="p2p", micro_batches=2, lr=lr), **kw)  # fmt: skip


def curve(stats):
    return [(s.step, s.loss, s.grad_norm) for s in stats]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a directory): what must stay untouched."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


class Steps:
    """An `on_step` that counts the steps trained (to show a refusal came before the first)."""

    def __init__(self, crash_after: int | None = None):
        self.seen, self.crash_after = [], crash_after

    def __call__(self, s):
        self.seen.append(s.step)
        if s.step == self.crash_after:
            raise KeyboardInterrupt(f"crash after step {s.step}")


# --- 1. a save never destroys what it did not write ---


@pytest.mark.parametrize("foreign", ["file", "folder"])
def test_a_save_into_a_directory_that_is_not_a_checkpoint_is_refused_before_training(tmp_path, foreign):
    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    (target / ("notes.txt" if foreign == "file" else "sub/data.bin")).write_text("mine")
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match=rf"cannot save a checkpoint to {target}: it is not empty and not a cpref checkpoint: it holds .*sub/"):
        run_sim(spec(3, save=str(target)), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before


@pytest.mark.parametrize("suffix", [".tmp", ".old"])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_foreign_siblings_named_like_a_saves_own_are_refused_and_kept(tmp_path, suffix, kind):
    sibling = tmp_path / f"ckpt{suffix}"
    if kind == "file":
        sibling.write_text("mine")
    else:
        sibling.mkdir()
        (sibling / "notes.txt").write_text("mine")
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match=rf"{sibling} exists and was not written by cpref"):
        run_sim(spec(2, save=str(tmp_path / "ckpt")), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before


def test_a_copy_of_a_checkpoint_named_like_a_saves_old_one_is_refused_and_kept(tmp_path):
    """On main a user's backup `ckpt.old` (a copy of the checkpoint) was deleted by the next save: the sibling rule
    took any cpref checkpoint there for a save's leftover. Only a sibling carrying a save's own mark is one."""
    import shutil

    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt.old")
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match=rf"{tmp_path / 'ckpt.old'} exists and was not written by cpref"):
        run_sim(spec(4, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt")), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before
    with pytest.raises(CPInputError, match="that is the name a save of the checkpoint .*ckpt uses beside it"):
        run_sim(spec(1, save=str(tmp_path / "ckpt.tmp")))  # nor can a save take that name


@pytest.mark.parametrize("name", [".", ".."])
def test_the_current_directory_or_its_parent_is_refused_up_front(tmp_path, monkeypatch, name):
    """Was: `ValueError: PosixPath('.') has an empty name` after training."""
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    steps = Steps()
    with pytest.raises(CPInputError, match="is the current directory or holds it"):
        run_sim(spec(2, save=name), on_step=steps)
    assert steps.seen == [] and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_filesystem_root_is_refused():
    with pytest.raises(CPInputError, match="is the filesystem root"):
        cf.check_target("/")


def test_an_empty_directory_and_a_checkpoint_are_replaceable(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cf.check_target(tmp_path / "empty") == tmp_path / "empty"
    run_sim(spec(1, save=str(tmp_path / "empty")))
    assert ck.read_meta(tmp_path / "empty").step == 1 and not (tmp_path / "empty" / cf.MARK).exists()


# --- an interrupted save: the newer complete checkpoint wins ---


def interrupt_between_renames(monkeypatch):
    """Make the next save stop after `DIR -> DIR.old`, before `DIR.tmp -> DIR` (a kill there)."""
    real = Path.rename

    def rename(self, target):
        if Path(target).name.endswith(".old"):
            real(self, target)
            raise KeyboardInterrupt("killed between the renames")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    return lambda: monkeypatch.setattr(Path, "rename", real)


def test_a_kill_between_the_renames_resumes_from_the_newer_checkpoint(tmp_path, monkeypatch, capsys):
    """Was: `DIR.old` and `DIR.tmp` left, no `DIR`, and resume said only "no readable meta.json"."""
    import shutil

    whole = curve(run_sim(spec(6)))
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    restore = interrupt_between_renames(monkeypatch)
    with pytest.raises(BaseException, match="killed between the renames"):  # rank 0's, and its peers' failure
        run_sim(spec(4, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt")))
    restore()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.old", "ckpt.tmp"]  # both complete, no ckpt
    path, meta, note = ck.find_checkpoint(tmp_path / "ckpt")
    assert (path.name, meta.step) == ("ckpt.tmp", 4)
    assert note == (f"{tmp_path / 'ckpt'} holds no complete checkpoint (a save was interrupted); resuming from "
                    f"{tmp_path / 'ckpt.tmp'}, the newest complete one (step 4)")  # fmt: skip
    copy = tmp_path / "copy"
    for p in ("ckpt.old", "ckpt.tmp"):
        shutil.copytree(tmp_path / p, copy / p)
    assert main(["--model", "llama", "--steps", "5", "--pack-tokens", "64", "--micro-batches", "2", "--mode", "p2p",
                 "--resume", str(copy / "ckpt")]) == 0  # fmt: skip
    assert note.replace(str(tmp_path), str(copy)) in capsys.readouterr().err  # the command says which it took
    rest = curve(run_sim(spec(6, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt"))))
    assert rest == whole[4:]  # the interrupted run's step 4 checkpoint, continued bit for bit
    assert ck.read_meta(tmp_path / "ckpt").step == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "copy"]  # the save finished the swap


def test_an_incomplete_tmp_beside_a_complete_old_resumes_from_the_old(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    (tmp_path / "ckpt" / cf.OLD_MARK).write_text("")  # a save marked it and moved it aside,
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / cf.MARK).write_text("")  # and was killed while writing the payload
    path, meta, note = ck.find_checkpoint(tmp_path / "ckpt")
    assert (path.name, meta.step) == ("ckpt.old", 2) and "ckpt.old, the newest complete one (step 2)" in note
    run_sim(spec(3, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt")))
    assert ck.read_meta(tmp_path / "ckpt").step == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_no_complete_checkpoint_anywhere_names_each_candidate(tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / cf.MARK).write_text("")
    with pytest.raises(CPInputError, match=r"no complete checkpoint to resume from at .*ckpt: .*ckpt.tmp: .*no readable "
                                           "meta.json") as err:  # fmt: skip
        ck.find_checkpoint(tmp_path / "ckpt")
    assert "\n" not in str(err.value)  # one line, each candidate after the other
    with pytest.raises(CPInputError, match="neither it nor a nothing.tmp or nothing.old that a save left exists"):
        ck.find_checkpoint(tmp_path / "nothing")


def test_the_command_says_on_stderr_what_it_resumed_from_and_each_save_once(tmp_path, capsys):
    """`python -m sim train` said nothing of its saves and resumes (issue 56): now one line each, from rank 0."""
    c = tmp_path / "ckpt"
    argv = ["--model", "llama", "--cp", "4", "--pack-tokens", "64", "--micro-batches", "2", "--mode", "p2p"]
    assert main([*argv, "--steps", "3", "--save", str(c), "--save-every", "2"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("saved ", "resumed "))]
    assert said == [f"saved step 2 to {c}", f"saved step 3 to {c}"]
    assert main([*argv, "--steps", "4", "--resume", str(c), "--save", str(c)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("saved ", "resumed "))]
    assert said == [f"resumed from {c} at step 3", f"saved step 4 to {c}"]


# --- periodic saves: a crash loses at most N steps, and the resumed run is the same run ---


def test_a_crash_at_a_random_step_loses_at_most_save_every_steps_and_resumes_bit_identically(tmp_path):
    steps, every = 7, 2
    crash = random.Random(18).randrange(1, steps - 1)  # after step `crash` (0-based): 1 .. 5
    whole = curve(run_sim(spec(steps)))
    target = str(tmp_path / "ckpt")
    with pytest.raises(BaseException, match=f"crash after step {crash}"):
        run_sim(spec(steps, save=target, save_every=every), on_step=Steps(crash_after=crash))
    saved = ck.read_meta(target).step
    assert saved == (crash + 1) // every * every and crash + 1 - saved < every, (crash, saved)
    rest = curve(run_sim(spec(steps, resume=target, save=target, save_every=every)))
    assert rest == whole[saved:], f"crash after step {crash}, resumed at {saved}"  # bit for bit, every step
    assert ck.read_meta(target).step == steps


def test_save_every_saves_after_every_n_steps_and_after_the_last(tmp_path, monkeypatch):
    written = []
    real = ck.save_checkpoint
    monkeypatch.setattr("cpref.train.training.save_checkpoint", lambda d, m, o, meta, *a, **k: written.append(meta.step) or real(d, m, o, meta, *a, **k))
    run_sim(spec(5, cp=1, save=str(tmp_path / "ckpt"), save_every=2))
    assert written == [2, 4, 5]
    run_sim(spec(9, cp=1, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt"), save_every=3))
    assert written == [2, 4, 5, 6, 9]  # multiples of 3 after step 5, and the last


# --- 2. a resume never silently does something else ---


def test_a_resume_at_or_below_the_checkpoints_step_is_refused_and_keeps_the_step(tmp_path):
    """Was: `--steps 2` on a step-8 checkpoint trained nothing and rewrote its step to 2."""
    run_sim(spec(4, save=str(tmp_path / "ckpt")))
    for steps in (2, 4):
        with pytest.raises(CPInputError, match=rf"is at step 4 and --steps {steps} is at or below it: nothing to train"):
            run_sim(spec(steps, resume=str(tmp_path / "ckpt"), save=str(tmp_path / "ckpt")))
    assert ck.read_meta(tmp_path / "ckpt").step == 4


def test_a_save_over_a_later_checkpoint_is_refused_unless_overwrite(tmp_path):
    run_sim(spec(4, save=str(tmp_path / "ckpt")))
    steps = Steps()
    with pytest.raises(CPInputError, match=r"holds a checkpoint at step 4; saving step 2 there would not move it forward.*--overwrite"):
        run_sim(spec(2, save=str(tmp_path / "ckpt")), on_step=steps)
    assert steps.seen == [] and ck.read_meta(tmp_path / "ckpt").step == 4
    with pytest.raises(CPInputError, match="saving step 2 there would not move it forward"):  # a periodic save would too
        run_sim(spec(8, save=str(tmp_path / "ckpt"), save_every=2))
    run_sim(spec(2, save=str(tmp_path / "ckpt"), overwrite=True))
    assert ck.read_meta(tmp_path / "ckpt").step == 2


@pytest.mark.parametrize("setting, changed", [("lr", {"lr": 1e-3}), ("pack_tokens", {"pack_tokens": 128}),
                                               ("grad_clip", "grad_clip"), ("bf16", "bf16")])  # fmt: skip
def test_a_resume_with_other_settings_is_refused_naming_both_values(tmp_path, setting, changed):
    """Was: `--lr` silently ignored on resume, `--pack-tokens 128` on a 64-token checkpoint accepted."""
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    run = spec(4, resume=str(tmp_path / "ckpt"), **(changed if isinstance(changed, dict) else {}))
    if changed == "grad_clip":
        run = replace(run, train=replace(run.train, grad_clip=None))
    if changed == "bf16":
        run = replace(run, train=replace(run.train, bf16=True))
    there, here = spec(1).settings()[setting], run.settings()[setting]
    with pytest.raises(CPInputError, match=rf"{setting} is {there!r} there, {here!r} here.*--override {setting}"):
        run_sim(run)


def test_an_override_is_applied_and_printed(tmp_path, capsys):
    run_sim(spec(2, save=str(tmp_path / "ckpt")))

    def rank_fn_lr(world):
        import sim.tools.train

        stats = sim.tools.train.run_rank(world, spec(3, lr=1e-3, resume=str(tmp_path / "ckpt"), override=("lr",),
                                                   save=str(tmp_path / "ckpt")))  # fmt: skip
        return stats

    from sim import SimCluster

    SimCluster(2).run(rank_fn_lr)
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [1e-3]  # the run's, not the checkpoint's 3e-3
    assert ck.read_meta(tmp_path / "ckpt").settings["lr"] == 1e-3
    args = ["--model", "llama", "--steps", "4", "--pack-tokens", "64", "--micro-batches", "2", "--lr", "5e-4",
            "--resume", str(tmp_path / "ckpt"), "--override", "lr"]  # fmt: skip
    assert main(args) == 0
    assert "overriding lr: 0.001 (checkpoint) -> 0.0005 (this run)" in capsys.readouterr().err


def test_an_override_without_resume_or_of_no_setting_is_refused(tmp_path):
    with pytest.raises(CPInputError, match="--override lr without --resume"):
        run_sim(spec(2, override=("lr",)))
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    with pytest.raises(CPInputError, match=r"override names \['seed'\], which are not settings"):
        run_sim(spec(3, resume=str(tmp_path / "ckpt"), override=("seed",)))


def resign(path: Path) -> None:
    """Recompute every SHA-256 sum of a checkpoint's meta.json, as anyone editing it can."""
    record = json.loads((path / "meta.json").read_text())
    fields = {k: v for k, v in record.items() if k not in ("format", "sha256", "fields_sha256")}
    record.update(sha256=cm._file_sums(path), fields_sha256=cm._field_sums(fields))
    (path / "meta.json").write_text(json.dumps(record))


@pytest.mark.parametrize("field, value", [("step", 9), ("cp", 8), ("settings", {"lr": 1.0})])
def test_an_edited_meta_json_field_is_detected_and_named(tmp_path, field, value):
    """Was: meta.json outside the sums, so an edited step or CP size was accepted."""
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    record = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps({**record, field: value}))
    with pytest.raises(CPInputError, match=rf"meta.json fields do not match the SHA-256 sums .*: {field} \(SHA-256 differs\)$"):
        ck.read_meta(tmp_path / "ckpt")


def test_a_corrupt_or_missing_or_added_file_is_named(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "ckpt")))
    path = tmp_path / "ckpt"
    data = bytearray((path / "rng.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "rng.pt").write_bytes(bytes(data))
    with pytest.raises(CPInputError, match=r"its files do not match the SHA-256 sums in meta.json .*: rng.pt \(SHA-256 differs\)$"):
        ck.read_meta(path)
    (path / "rng.pt").unlink()
    (path / "extra.pt").write_bytes(b"")
    with pytest.raises(CPInputError, match=r": extra.pt \(not in the sums\), rng.pt \(missing\)$"):
        ck.read_meta(path)


# --- 3. loading runs no code ---

_sprung: list[str] = []


class Trap:
    """Unpickling this calls a function (appends to `_sprung`): what no checkpoint load may do."""

    def __reduce__(self):
        return (_sprung.append, ("code ran",))


def trap_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"x": Trap()}, buf)
    return buf.getvalue()


def one_rank_checkpoint(path: Path, payload) -> tuple[CausalLM, torch.optim.Optimizer, dict]:
    model = CausalLM(spec(1).model_config(), seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ck.save_checkpoint(path, model, opt, spec(1).meta(1), SingleRank(), payload)
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}


def dcp_payload():
    from cpref.train.dcp import DcpPayload

    return DcpPayload(local=True)


def plant_in_distcp(path: Path) -> None:
    """Point a non-tensor item of the DCP checkpoint (the learning rate) at a trap appended to its file."""
    from cpref.train.dcp import MetadataUnpickler

    meta_file = path / "dcp" / ".metadata"
    metadata = MetadataUnpickler(io.BytesIO(meta_file.read_bytes())).load()
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[index]
    target = path / "dcp" / info.relative_path
    offset, data = target.stat().st_size, trap_bytes()
    target.write_bytes(target.read_bytes() + data)
    metadata.storage_data[index] = replace(info, offset=offset, length=len(data))
    meta_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("fmt, name", [("torch", "state.pt"), ("torch", "rng.pt"), ("torch", "meta.json"),
                                        ("dcp", "dcp/.metadata"), ("dcp", "dcp/__0_0.distcp"), ("dcp", "rng.pt")])  # fmt: skip
def test_a_trap_in_any_file_of_either_format_runs_no_code_on_resume(tmp_path, fmt, name):
    """Each file replaced by one whose unpickling would call a function, the sums recomputed: the
    load is refused with the file named, and no code ran (was: DCP's `.metadata` and non-tensor
    items went through the unrestricted unpickler)."""
    path = tmp_path / "ckpt"
    payload = dcp_payload() if fmt == "dcp" else ck.TorchPayload()
    model, opt, before = one_rank_checkpoint(path, payload)
    if name == "meta.json":
        (path / name).write_bytes(pickle.dumps(Trap()))
    elif name == "dcp/__0_0.distcp":
        plant_in_distcp(path)
    else:
        (path / name).write_bytes(trap_bytes() if name.endswith(".pt") else pickle.dumps({"x": Trap()}))
    if name != "meta.json":
        resign(path)
    fresh = CausalLM(spec(1).model_config(), seed=2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    shown = {"dcp/__0_0.distcp": "param_groups.0.lr", "dcp/.metadata": "dcp/.metadata"}.get(name, name)
    with pytest.raises(CPInputError, match=rf"({shown}.* cannot be read|no readable {shown})"):
        ck.load_checkpoint(path, fresh, fresh_opt, expect=spec(1).meta(0), payload=payload)
    assert _sprung == []


def test_the_metadata_reader_names_the_refused_class(tmp_path):
    from cpref.train.dcp import MetadataUnpickler

    with pytest.raises(pickle.UnpicklingError, match=r"builtins.getattr is not part of a checkpoint's metadata"):
        MetadataUnpickler(io.BytesIO(pickle.dumps(Trap()))).load()
    assert _sprung == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_checkpoint_loads_through_the_safe_readers(tmp_path):
    model, opt, before = one_rank_checkpoint(tmp_path / "ckpt", dcp_payload())
    fresh = CausalLM(spec(1).model_config(), seed=2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    meta = ck.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt, expect=spec(1).meta(0), payload=dcp_payload())
    assert meta.payload == "dcp" and all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert fresh_opt.param_groups[0]["lr"] == 3e-3 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_payload_that_cannot_read_the_format_is_refused_naming_both(tmp_path):
    one_rank_checkpoint(tmp_path / "ckpt", dcp_payload())
    fresh = CausalLM(spec(1).model_config(), seed=2)
    with pytest.raises(CPInputError, match=r"holds the 'dcp' format \(torch.distributed.checkpoint, .*TorchPayload reads 'torch' only"):
        ck.load_checkpoint(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters()), expect=spec(1).meta(0))


def test_the_command_refuses_before_it_starts_anything(tmp_path, capsys, monkeypatch):
    """`python -m sim train` runs the same checks before any rank starts: exit 2, one message."""
    import sim.tools.train

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    started = []
    monkeypatch.setattr(sim.tools.train, "run_sim", lambda *a, **k: started.append(a))
    assert main(["--steps", "2", "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m sim train: error: cannot save a checkpoint to {tmp_path / 'out'}: it is not empty")
    assert started == [] and (tmp_path / "out" / "notes.txt").read_text() == "mine"


# --- the directory protocol's own steps (a mutation run over cpref.train.checkpoint_files) ---


def test_a_sibling_with_another_programs_meta_json_is_not_taken_for_cpref_s(tmp_path):
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "meta.json").write_text(json.dumps({"format": "someone-else/3"}))
    with pytest.raises(CPInputError, match="ckpt.old exists and was not written by cpref"):
        cf.check_target(tmp_path / "ckpt")


def test_recovery_puts_the_newer_complete_sibling_in_place(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "a")))
    run_sim(spec(4, save=str(tmp_path / "b")))
    (tmp_path / "a" / cf.OLD_MARK).write_text("")  # what a save killed between its renames leaves
    (tmp_path / "b" / cf.MARK).write_text("")
    (tmp_path / "a").rename(tmp_path / "ckpt.old")
    (tmp_path / "b").rename(tmp_path / "ckpt.tmp")
    cs.recover(tmp_path / "ckpt", lambda p: ck.read_meta(p).step)
    assert not (tmp_path / "ckpt" / cf.MARK).exists()
    assert ck.read_meta(tmp_path / "ckpt").step == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_recovery_deletes_no_foreign_sibling_even_if_it_appeared_after_the_check(tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "notes.txt").write_text("mine")  # appeared between check_target and the save
    with pytest.raises(CPInputError, match="ckpt.tmp exists and was not written by cpref; it is left as it is"):
        cs.recover(tmp_path / "ckpt", lambda p: ck.read_meta(p).step)
    assert (tmp_path / "ckpt.tmp" / "notes.txt").read_text() == "mine"


def test_a_save_claims_its_tmp_exclusively(tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()  # another save got there first
    with pytest.raises(CPInputError, match="appeared while this save was starting"):
        cs.claim(tmp_path / "ckpt")


def test_a_save_at_the_same_step_as_the_checkpoint_there_is_refused_too(tmp_path):
    run_sim(spec(4, save=str(tmp_path / "ckpt")))
    with pytest.raises(CPInputError, match="holds a checkpoint at step 4; saving step 4 there would not move it forward"):
        run_sim(spec(4, save=str(tmp_path / "ckpt")))


@pytest.mark.parametrize("argv, message", [
    (["--save-every", "0", "--save", "x"], "argument --save-every: expected a whole number >= 1, got 0"),
    (["--save-every", "2"], "--save-every without --save: there is no checkpoint to write; add --save DIR"),
    (["--overwrite"], "--overwrite without --save: there is no checkpoint to write; add --save DIR"),
])  # fmt: skip
def test_checkpoint_flags_that_cannot_act_are_refused_by_name(tmp_path, monkeypatch, capsys, argv, message):
    """Was: --save-every and --overwrite without --save silently did nothing, and --save-every 0
    said only "every=0 is outside [1, inf)"."""
    monkeypatch.chdir(tmp_path)
    try:
        status = main(["--steps", "2", *argv])
    except SystemExit as exit:  # refused by the parser itself
        status = exit.code
    assert status == 2
    assert capsys.readouterr().err == f"python -m sim train: error: {message}\n"


def test_a_model_field_added_later_and_a_windowed_config_still_fit():
    """A checkpoint written before `layer_windows` existed lacks the key (its default, None), and a windowed
    model's tuple comes back from meta.json as a list: both fit the run they belong to, and another window
    does not."""
    from sim.tools.train import RunSpec

    spec = RunSpec()
    expect = spec.meta(3)
    old = replace(expect, model={k: v for k, v in expect.model.items() if k != "layer_windows"})
    ck.check_fits(old, expect)
    windowed = replace(expect, model={**expect.model, "layer_windows": (None, 3)})
    stored = replace(expect, model=json.loads(json.dumps(windowed.model)))
    ck.check_fits(stored, replace(windowed, model=json.loads(json.dumps(windowed.model))))
    with pytest.raises(cpref.CPInputError, match=r"holds another model.*layer_windows"):
        ck.check_fits(stored, replace(expect, model={**expect.model, "layer_windows": [None, 4]}))
