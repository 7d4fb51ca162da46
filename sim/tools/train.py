"""Train a model with CP: `python -m sim train`, GPT-2, LLaMA or Qwen3 style, on packed documents.

This page runs the training loop of [`cpref.train.training`](training.md) with the models of
[`cpref.models`](models.md) on real text: the source files of the Python standard library this
interpreter runs, byte-level tokens, packed into fixed-size packs with an end-of-document token
(`cpref.train.packing`). Everything is deterministic: the same command prints the same losses.

## On the simulated cluster

```bash
.venv/bin/python -m sim train --model llama --cp 4 --mode p2p --layout zigzag --steps 20
```

runs every rank as a thread of one process and prints one line per step from rank 0: the
step's loss, the global gradient norm and the tokens trained per second (what it printed, for
two steps, when this site was built, is at the end of this page).

## The run does not depend on the CP size

The loss of a step is the mean over every loss token of the step on every rank
(`cpref.train.training`), and attention is exact at any CP size, so a run at CP = 4 is the run at
CP = 1, up to rounding. Two real runs:

{{ figure figures/parity.png }}

The test suite checks the loss and gradient norm of 10 steps of every family in every mode and
layout, at CP = 2, CP = 4 and DP 2 x CP 2, against CP = 1: within 1e-5 (fp32), and 1e-2 under
bf16 autocast.

## On real processes

```bash
.venv/bin/python -m sim train --backend gloo --model qwen3 --cp 2 --dp 2 --steps 20
torchrun --nproc-per-node 4 -m sim train --backend gloo --cp 2 --dp 2   # the same, launched by torchrun
```

starts `dp x cp` gloo processes (`sim.tools.launch`; under torchrun, torchrun's), each a replica of the
model, and runs the same loop over `cpref.comm.TorchComm`. They run without torch's comparison of every
collective's shapes (`check_calls=False`): every rank runs one program, cpref compares what its calls need to
agree on itself, the exchanges are pairwise (faster on gloo), and a rank that dies fails the others' next
collective at once, where the comparison's barrier printed the misleading "Rank 1 failed to pass
monitoredBarrier in 600000 ms" first.

Both take the same options. `--model gpt2|llama|qwen3` chooses the family (small presets that
train in seconds on a CPU), `--mode` and `--layout` the CP algorithm, `--a2a-size` the
hierarchical mode's group, `--dp M` adds data parallelism (a world of `M x N` ranks; `--strided`
puts non-consecutive ranks in a CP group), `--micro-batches` accumulates gradients, `--dtype bf16`
runs the forward under bfloat16 autocast, `--pack-tokens` sets the pack size.

## Checkpoints, and resuming at another CP size

```bash
.venv/bin/python -m sim train --cp 2 --steps 10 --save ckpt --save-every 2
.venv/bin/python -m sim train --cp 4 --mode a2a --steps 20 --resume ckpt --save ckpt
```

The first run writes a checkpoint after every second step and after the last (`torch.save` on
the simulated cluster, `torch.distributed.checkpoint` with `--backend gloo`), so a crash loses
at most two steps; the second continues at step 10 on 4 ranks, in another mode, exactly as the
first run would have continued (tested step for step, and bit for bit after a `kill -9` at a
random step on gloo). CP splits the sequence, never the parameters, so a checkpoint fits any
CP size, and either backend's checkpoint resumes on the other ([Checkpoints](checkpoint.md)). Rank 0
says on stderr what it resumed from (`resumed from ckpt at step 10`) and each checkpoint it saved
(`saved step 12 to ckpt`), one line each.

Everything that could go wrong with the checkpoints is refused **before the first step**, with
the path or setting, both values and the fix:

- `--save` into a directory that is neither empty nor a cpref checkpoint, a checkpoint that holds
  files of yours or does not verify (damaged or edited: `--overwrite` replaces it), a link, next to
  a `DIR.tmp` or `DIR.old` that a save of cpref's did not leave (a copy of yours named so is kept),
  inside a checkpoint, under a file, where nothing can be written, onto a checkpoint (or a folder
  in it, or a leftover beside it) that this process may not change, being read-only or immutable,
  or onto the current directory ([where checkpoints live](checkpoint-files.md));
- `--save` into a directory another run is saving to (a requeued job whose first copy still runs):
  that run holds a lock on it, `DIR.lock`, and this one is refused naming its process; a run that
  died holds nothing ([the save lock][cpref.train.checkpoint_lock]);
- `--save` onto a checkpoint this run does not continue (it did not `--resume` from it), or at a
  later step than this run's first save (a step never moves back); `--overwrite` replaces it
  deliberately, and even then only cpref's own files go;
- a value out of range: `--lr inf`, or `1e39` (beyond what AdamW can step float32 parameters by),
  `--pack-tokens 1`, `--steps 0`, an empty `--save ''`, `--a2a-size` with a mode that has no a2a group
  (one line each, before anything runs);
- a run the data cannot fill: it takes `--steps x --dp x --micro-batches` packs of `--pack-tokens`
  tokens (the built-in data holds 522 packs of 512 tokens), and the line says how many steps, or how
  large packs, the data holds;
- `--resume` with `--steps` at or below the checkpoint's step (nothing to train);
- `--resume` of another model, other packs per step (`dp x micro_batches`), or other settings
  (`--lr`, `--pack-tokens`, clipping, `--dtype`): `--override lr` (repeatable) trains on with this
  run's value and prints what it overrode;
- a checkpoint whose files or `meta.json` fields do not match their SHA-256 sums, naming them.

After a save interrupted anywhere (between its renames, before its swap, while it deleted the
previous checkpoint), `--resume DIR` takes the newest complete checkpoint of `DIR`, `DIR.tmp` and
`DIR.old` and says which, and the next save with `--save DIR` puts it in place and clears what
the interrupted save left ([a save a crash cannot lose][cpref.train.checkpoint_swap]). A save that
fails, a full disk above all, stops the run with one line naming the cause, the path and the
bytes needed and free; its partial `DIR.tmp` is deleted, and `DIR` is as it was
([when a save fails][cpref.train.checkpoint_errors]).

A run that diverges stops at the first step whose loss or gradient norm is not finite (a
learning rate in range but too large, such as `--lr 3e37`): that step is not taken, the
checkpoints stay the last finite step's, and the command prints one line naming the step, both
values and what to change, and exits with status 1 ([training](training.md)).

## When a run stops early

However a run stops, the command prints one line on stderr, ending with the last checkpoint it can
continue from (read from the save directory, whichever process wrote it), and exits with a status of its
own: 1 diverged (above), 2 refused (a bad argument, or a `CPInputError` while it ran, such as a save
into a checkpoint another run is saving to), 3 a rank failed (killed by a signal, or raised an error of
its own, whose traceback comes first), 4 timed out, 130 interrupted (Ctrl-C); the table is in
`sim.tools.stops`, and `--help` lists them. For example, after `kill -9` of one gloo process:

```text
python -m sim train: error: rank 1 was killed by signal 9 (SIGKILL) without reporting a result; the last checkpoint is step 4 in ckpt
```

A rank that stops taking part, stopped (`kill -STOP`), asleep or looping outside any collective,
leaves the others waiting in a collective: `--timeout SECONDS` (default 600) is how long they wait,
on the simulated cluster and in every process group of a gloo run (the CP and DP groups split from
the world included), before the run stops with status 4 and names the stalled rank:

```bash
.venv/bin/python -m sim train --backend gloo --cp 2 --steps 1000 --timeout 30   # a stalled rank: named after 30 s
```
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

import cpref
from cpref.api import check_mode
from cpref.base.checks import as_int
from cpref.base.errors import CPInputError
from cpref.kernels.contract import NO_WINDOW
from cpref.models import CausalLM, ModelConfig
from cpref.train.checkpoint import CheckpointMeta, check_fits, check_save, find_checkpoint, load_checkpoint, overridden
from cpref.train.checkpoint_lock import hold, probe
from cpref.train.packing import BYTE_VOCAB, stdlib_documents
from cpref.train.training import Checkpointing, PackSource, StepStats, Topology, TrainConfig, check_packs, train
from sim.tools.cli import Parser, dtype_name, fail, positive, positive_float, seconds
from sim.tools.stops import STATUS, report

__all__ = ["RunSpec", "PRESETS", "run_rank", "run_sim", "main"]

# Small models that train in seconds on a CPU; every size divisible by the CP sizes used.
PRESETS = {
    "gpt2": dict(family="gpt2", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=8, max_positions=4096),
    "llama": dict(family="llama", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2),
    "qwen3": dict(family="qwen3", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16),
    # a LLaMA whose first layer attends in a sliding window of 64 keys and whose second is full, as Qwen3's and
    # Gemma's mixed layers do (Mistral slides in every layer)
    "sliding": dict(family="llama", hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, layer_windows=(63, None)),
}


def short_documents(limit: int = 2000, longest: int = 300) -> Iterator[torch.Tensor]:
    """Standard-library files cut to a deterministic spread of lengths, so that packs hold many documents."""
    for n, doc in enumerate(stdlib_documents(limit)):
        yield doc[: 8 + (n * 37) % longest]


@dataclass(frozen=True)
class RunSpec:
    """One training run (see `python -m sim train --help`)."""

    model: str = "llama"
    cp: int = 2
    dp: int = 1
    steps: int = 10
    pack_tokens: int = 512
    seed: int = 0
    strided: bool = False  # CP groups of non-consecutive ranks: {0, dp, 2 dp, ...}
    train: TrainConfig = field(default_factory=TrainConfig)
    save: str | None = None
    resume: str | None = None
    save_every: int | None = None  # also save after every N steps (a crash loses at most N)
    override: tuple[str, ...] = ()  # settings that may differ from the resumed checkpoint's
    overwrite: bool = False  # allow replacing a checkpoint at a later step
    documents: Callable[[], Iterator[torch.Tensor]] = short_documents

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise CPInputError(f"unknown model {self.model!r}; choose one of {sorted(PRESETS)}")
        for name, lo in (("cp", 1), ("dp", 1), ("steps", 1), ("seed", 0)):
            as_int(name, getattr(self, name), lo=lo)
        as_int("pack_tokens", self.pack_tokens, lo=2)  # a pack holds a token and its end-of-document token at least
        for name in ("save", "resume"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not path or "\0" in path):
                raise CPInputError(f"{name}={path!r} names no directory; pass a directory such as ckpt")
        check_lr(self.train.lr, torch.get_default_dtype())  # the dtype CausalLM's parameters are built in

    def model_config(self) -> ModelConfig:
        """The preset of `model`, over the byte-level vocabulary."""
        return ModelConfig(vocab_size=BYTE_VOCAB, **PRESETS[self.model])

    def settings(self) -> dict:
        """The settings that change the training run (a resumed run must match them, or override them)."""
        t = self.train
        return {"lr": t.lr, "grad_clip": t.grad_clip, "bf16": t.bf16, "pack_tokens": self.pack_tokens}

    def meta(self, step: int) -> CheckpointMeta:
        """What a checkpoint of this run at `step` records."""
        c = self.model_config()
        model = json.loads(json.dumps(c.__dict__))  # as meta.json holds it: tuples are lists there
        return CheckpointMeta(step, self.dp, self.cp, self.train.mode, self.train.layout, self.train.micro_batches,
                              model, self.settings())  # fmt: skip


BETAS = (0.9, 0.999)  # AdamW's (torch's defaults), named here because the learning rate's bound derives from them


def check_lr(lr: float, dtype: torch.dtype) -> None:
    """Refuse a learning rate AdamW cannot step parameters of `dtype` by: step `t` moves a parameter by up to
    `lr / (1 - beta1^t)` (the bias correction), from `lr / (1 - beta1)` at the first step down to `lr`, and every
    such step must be a finite, normal number of `dtype` (1e39 overflows float32, 1e-50 is 0 there)."""
    info = torch.finfo(dtype)
    lo, hi = info.tiny, info.max * (1 - BETAS[0])
    if not lo <= lr <= hi:
        raise CPInputError(f"lr={lr:g} is outside [{lo:.3g}, {hi:.3g}], the learning rates AdamW can step {dtype} "
                           f"parameters by (its first step is lr / (1 - beta1) = {1 / (1 - BETAS[0]):g} x lr, its "
                           "last about lr); pass a learning rate such as 3e-3")  # fmt: skip


def preflight(spec: RunSpec, *, probe_lock: bool = True) -> tuple[Any, list[str]]:
    """Everything about the checkpoints of a run that can be refused before it starts (pure reads,
    the same on every rank): `(checkpoint to resume from or None, lines to print)`. `probe_lock`:
    refuse a save target another run holds the lock of now (`probe`: before the ranks start, not in
    a rank, where it could meet its own rank 0's lock).

    Raises:
        CPInputError: a resume with nothing to train or that does not fit this run, or a save target
            that holds foreign files or a later checkpoint.
    """
    notes, start, found = [], 0, None
    for flag, value in (("--save-every", spec.save_every), ("--overwrite", spec.overwrite)):
        if value not in (None, False) and not spec.save:
            raise CPInputError(f"{flag} without --save: there is no checkpoint to write; add --save DIR")
    if spec.save_every is not None and (isinstance(spec.save_every, bool) or not isinstance(spec.save_every, int)
                                        or spec.save_every < 1):  # fmt: skip
        raise CPInputError(f"--save-every must be a whole number of steps >= 1, got {spec.save_every!r}")
    if spec.resume:
        path, meta, note = find_checkpoint(spec.resume)
        notes += [note] if note else []
        if spec.steps <= meta.step:
            raise CPInputError(f"checkpoint {path} is at step {meta.step} and --steps {spec.steps} is at or below it: "
                               f"nothing to train; pass --steps greater than {meta.step}")  # fmt: skip
        check_fits(meta, spec.meta(0), spec.override, str(path))
        notes += [f"overriding {line}" for line in overridden(meta, spec.meta(0), spec.override)]
        start, found = meta.step, path
    elif spec.override:
        raise CPInputError(f"--override {' '.join(spec.override)} without --resume: there is no checkpoint to differ from")
    if spec.save:
        if probe_lock:  # another run saving there now: said first, whatever else its saves changed meanwhile
            probe(spec.save)
        first = Checkpointing(spec.save, spec.meta, spec.save_every).saves(start, spec.steps)[0]
        check_save(spec.save, first, overwrite=spec.overwrite, resumed=spec.resume)
    return found, notes


def topology(world: Any, spec: RunSpec) -> Topology:
    """The CP group of this rank and its DP index: consecutive ranks, or strided ones."""
    if spec.strided:
        groups = [list(range(d, spec.dp * spec.cp, spec.dp)) for d in range(spec.dp)]
    else:
        groups = [list(range(d * spec.cp, (d + 1) * spec.cp)) for d in range(spec.dp)]
    dp_rank = next(d for d, g in enumerate(groups) if world.rank in g)
    return Topology(world.split(groups), world, dp_rank, spec.dp)


def run_rank(world: Any, spec: RunSpec, payload: Any = None, on_step: Callable[[StepStats], Any] | None = None) -> list[StepStats]:
    """Everything one rank does: topology, model, optimizer, data, (resume,) train, (save). Rank 0 says on stderr
    what it resumed from and each checkpoint it saved, one line each."""
    resume, _ = preflight(spec, probe_lock=False)  # before any communication: every rank refuses alike
    topo = topology(world, spec)
    model = CausalLM(spec.model_config(), seed=spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=BETAS)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if world.rank == 0 else (lambda line: None)
    with hold(spec.save, world) if spec.save else contextlib.nullcontext() as lock:  # a second run: refused before it resumes
        start = 0
        if resume is not None:
            start = load_checkpoint(resume, model, optimizer, expect=spec.meta(0), payload=payload, override=spec.override).step
            say(f"resumed from {resume} at step {start}")
        source = PackSource(spec.documents, spec.pack_tokens)
        plan = Checkpointing(spec.save, spec.meta, spec.save_every, payload, spec.overwrite, spec.resume, lock=lock,
                             on_save=lambda step, path: say(f"saved step {step} to {path}")) if spec.save else None  # fmt: skip
        return train(model, optimizer, source, topo, spec.train, spec.steps, start=start,
                     on_step=on_step if world.rank == 0 else None, checkpoint=plan)  # fmt: skip


def run_sim(spec: RunSpec, on_step: Callable[[StepStats], Any] | None = None, timeout: float = 600.0) -> list[StepStats]:
    """The run on the simulated cluster (one process); rank 0's stats. A rank waits `timeout` seconds in a collective."""
    from cpref.train.dcp import LocalPayload
    from sim import SimCluster

    payload = LocalPayload()  # writes state.pt once, reads a gloo run's dcp/ too
    return SimCluster(spec.dp * spec.cp, timeout=timeout).run(lambda world: run_rank(world, spec, payload, on_step))[0]


def _gloo_rank(spec: RunSpec) -> list[StepStats]:
    from cpref.comm import TorchComm
    from cpref.train.dcp import DcpPayload

    return run_rank(TorchComm(), spec, DcpPayload(), on_step=_print_step)


def _print_step(s: StepStats) -> None:
    print(f"step {s.step} loss {s.loss:.7f} grad_norm {s.grad_norm:.4f} tokens_per_s {s.tokens_per_s:.0f}", flush=True)


DATA = ("byte-level tokens of this interpreter's standard-library source files (cpref.train.packing.stdlib_documents), "
        "cut to a spread of lengths and packed end to end with an end-of-document token")


def parse(argv: Sequence[str] | None, prog: str = "python -m sim train") -> tuple[RunSpec, str, float]:
    """`(spec, backend, timeout)` from the command line; a bad argument exits with one line and status 2."""
    sizes = "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in kw.items() if k != "family") for name, kw in PRESETS.items())
    statuses = ", ".join(f"{n} {why}" for why, n in STATUS.items())
    p = Parser(prog=prog, description=__doc__.splitlines()[0], epilog=f"data: {DATA}. models: {sizes}. exit status: 0 "
               f"trained, {statuses} (one line on stderr says which rank, what, and the last checkpoint)")  # fmt: skip
    p.add_argument("--model", choices=sorted(PRESETS), default="llama", help="the model preset (sizes below)")
    p.add_argument("--cp", type=positive, default=2, help="CP size")
    p.add_argument("--dp", type=positive, default=1, help="DP size (world = dp x cp)")
    p.add_argument("--mode", choices=sorted(cpref.MODES), default="p2p", help="the CP mode")
    p.add_argument("--a2a-size", type=positive, default=None, help="a2a group size of mode a2a+p2p (default: the mode's "
                   "example for the CP size)")  # fmt: skip
    p.add_argument("--layout", choices=cpref.LAYOUTS, default="zigzag", help="how each batch is sharded")
    p.add_argument("--steps", type=positive, default=10, help="optimizer steps")
    p.add_argument("--micro-batches", type=positive, default=1, help="packs per DP replica and step")
    p.add_argument("--pack-tokens", type=positive, default=512, help="tokens per pack")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--dtype", type=dtype_name, choices=["fp32", "bf16"], default="fp32",
                   help="bf16 (or bfloat16): the forward under bfloat16 autocast")  # fmt: skip
    p.add_argument("--backend", choices=["sim", "gloo"], default="sim", help="simulated ranks or gloo processes")
    p.add_argument("--strided", action="store_true", help="CP groups of non-consecutive ranks")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--save-every", type=positive, default=None, metavar="N", help="also save after every N steps")
    p.add_argument("--resume", default=None, help="continue from this checkpoint")
    p.add_argument("--override", action="append", default=[], choices=sorted(RunSpec().settings()),
                   help="on --resume, let this setting differ from the checkpoint's (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="let --save replace a checkpoint at a later step")
    p.add_argument("--timeout", type=seconds, default=600.0, metavar="SECONDS", help="how long a rank waits in a "
                   "collective for the others (the process group's timeout); then the stalled ranks are named")  # fmt: skip
    a = p.parse_args(argv)
    options = cpref.MODES[a.mode].example_options(a.cp)  # what the mode runs with at this CP size
    takes = [m for m in sorted(cpref.MODES) if any(o.name == "a2a_size" for o in cpref.MODES[m].options)]
    if a.a2a_size is not None and a.mode not in takes:  # it would be ignored
        p.error(f"--a2a-size {a.a2a_size} is an option of mode {', '.join(takes)}, not of {a.mode}; drop it, or pass "
                f"--mode {takes[0]}")  # fmt: skip
    if a.a2a_size is not None:
        options["a2a_size"] = a.a2a_size
    try:
        config = TrainConfig(mode=a.mode, layout=a.layout, options=options, micro_batches=a.micro_batches, lr=a.lr,
                             bf16=a.dtype == "bf16")  # fmt: skip
        spec = RunSpec(a.model, a.cp, a.dp, a.steps, a.pack_tokens, strided=a.strided, train=config, save=a.save,
                       resume=a.resume, save_every=a.save_every, override=tuple(a.override), overwrite=a.overwrite)  # fmt: skip
        model = spec.model_config()
        for window in sorted(set(model.layer_windows or (None,)), key=str):  # what every attention call will be
            check_mode(a.mode, cp_size=a.cp, heads=(model.num_heads, model.num_kv_heads), layout=a.layout,
                       window=NO_WINDOW if window is None else (window, 0), **options)  # fmt: skip
    except CPInputError as exc:
        p.error(str(exc))
    return spec, a.backend, a.timeout


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim train") -> int:
    """Run the training the arguments describe; rank 0 prints one line per step. Its exit status: 0, or how the run
    stopped early (`sim.tools.stops`), with one line on stderr."""
    spec, backend, timeout = parse(argv, prog)
    try:
        check_packs(PackSource(spec.documents, spec.pack_tokens), spec.steps, spec.dp, spec.train.micro_batches)
        _, notes = preflight(spec)  # refused here, before any process starts or step trains
    except CPInputError as exc:
        return fail(prog, str(exc))
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        for line in notes:
            print(line, file=sys.stderr)
        print(f"training {spec.model} with {spec.train.mode}/{spec.train.layout} at DP {spec.dp} x CP {spec.cp} "
              f"on {backend}, {spec.pack_tokens}-token packs", file=sys.stderr)  # fmt: skip
    from sim.tools.launch import launch

    try:
        if backend == "sim":
            run_sim(spec, on_step=_print_step, timeout=timeout)
        else:
            launch(_gloo_rank, spec.dp * spec.cp, args=(spec,), timeout=timeout, check_calls=False)  # docstring
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- every way a run stops early: one line, a status
        status, lines = report(exc, timeout, (spec.save, spec.resume), prog)
        print("\n".join(lines), file=sys.stderr)
        return status
    return 0
