r"""Training with context parallelism: one step over DP x CP, as library code.

A step of data-parallel x context-parallel training does what a step on one device does, on
`dp x cp` ranks that all hold a replica of the model:

1. **Data.** Every DP replica takes its own packs (`micro_batches` of them); the `cp` ranks of
   a CP group take the *same* packs and each keeps its shard of every one
   ([`get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank]: tokens, labels shifted
   inside each document, loss mask, positions restarting at every document, both boundary
   lists). Pack `n` of the stream goes to step `n // (dp * micro_batches)`, so the packs a step
   sees do not depend on `cp`.
2. **Loss.** The loss is the mean over every loss token of the step, on every rank and in every
   micro-batch: one all-reduce of the token count over the DP x CP group, then each rank's
   share with [`cp_loss`][cpref.train.data.cp_loss], back-propagated micro-batch by micro-batch
   (gradient accumulation).
3. **Gradients.** The shares add up to the loss, so the gradient of a replicated parameter is
   the **sum** of the ranks' gradients: one all-reduce (sum) over the DP x CP group, of all
   gradients flattened into one buffer.
4. **Update.** Clip by the global gradient norm (the same on every rank), and step the
   optimizer. Every replica applies the same update, so the replicas stay identical. A step
   whose loss or gradient norm is not finite (a learning rate too large, bf16 overflow, a bad
   batch) is not taken: every rank raises `NonFiniteStepError` alike (both numbers are
   all-reduced), naming the step, the two values and what to change, and the weights, the
   optimizer state and the checkpoints stay those of the last finite step.

$$ \mathcal{L} = \frac{\sum_{\text{ranks}} \sum_{\text{micro-batches}} \sum_x \mathrm{mask}_x\, \mathrm{loss}_x}
                      {\sum_{\text{ranks}} \sum_{\text{micro-batches}} \sum_x \mathrm{mask}_x} $$

Because $\mathcal{L}$ is the same function of the same packs for every `dp` and `cp`, a run
at CP = 4, or at DP 2 x CP 2, matches a run at CP = 1 that sees the same packs (with
`micro_batches` times `dp` packs per step), step for step, up to floating-point rounding: the
test suite checks the loss and gradient norm of 10 steps to 1e-5 (fp32).

The loop holds no global state: the communicators, the model and the optimizer are passed in,
so several runs can live in one process (the simulated cluster runs every rank as a thread).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from cpref.base.checks import as_bool, as_choice, as_int
from cpref.base.errors import CPInputError, NonFiniteStepError
from cpref.batch.layout import LAYOUTS
from cpref.comm.protocol import Collectives, SingleRank, check_comm
from cpref.modes.consistency import check_same
from cpref.train.checkpoint import CheckpointMeta, Payload, check_save, save_checkpoint
from cpref.train.checkpoint_lock import SaveLock, hold
from cpref.train.data import cp_loss, get_batch_on_this_cp_rank
from cpref.train.packing import Pack, labels_for, pack_documents

Forward = Callable[[torch.nn.Module, dict, Any], torch.Tensor]  # (model, batch, ctx) -> logits (T_l, V)

__all__ = ["Topology", "TrainConfig", "PackSource", "StepStats", "Checkpointing", "step_packs", "check_packs", "train_step",
           "train"]  # fmt: skip


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the DP x CP grid.

    Attributes:
        cp: the CP group: the ranks that share a batch and split its sequence.
        world: the DP x CP group: every rank holding a replica (losses and gradients).
        dp_rank: this rank's DP replica, `0 <= dp_rank < dp_size`.
        dp_size: the number of DP replicas (`world.size == dp_size * cp.size`).
    """

    cp: Collectives
    world: Collectives
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        check_comm(self.cp, fix="pass the CP group's collectives as cp")
        check_comm(self.world, fix="pass the DP x CP group's collectives as world")
        as_int("dp_size", self.dp_size, lo=1)
        if self.world.size != self.dp_size * self.cp.size:
            raise CPInputError(f"world has {self.world.size} ranks but dp_size {self.dp_size} x cp {self.cp.size} = {self.dp_size * self.cp.size}")
        as_int("dp_rank", self.dp_rank, lo=0, hi=self.dp_size)

    @classmethod
    def single(cls) -> "Topology":
        """One device: no DP, no CP, no communication."""
        comm = SingleRank()
        return cls(comm, comm)


@dataclass(frozen=True)
class TrainConfig:
    """How to train.

    Attributes:
        mode: the CP mode (`cpref.MODES`).
        layout: `"zigzag"`, `"contiguous"`, `"stream"` or `"balanced"`.
        options: the mode's options, e.g. `{"a2a_size": 2}`.
        micro_batches: packs per DP replica and step (gradient accumulation).
        lr: AdamW learning rate.
        grad_clip: clip the global gradient norm to this (None: no clipping).
        bf16: run the forward under bfloat16 autocast (parameters and gradients stay float32).
    """

    mode: str = "all_gather"
    layout: str = "zigzag"
    options: dict = field(default_factory=dict)
    micro_batches: int = 1
    lr: float = 3e-3
    grad_clip: float | None = 1.0
    bf16: bool = False

    def __post_init__(self) -> None:
        from cpref.api import MODES  # the API module imports the modes; no cycle at import

        as_choice("mode", self.mode, sorted(MODES))
        as_choice("layout", self.layout, LAYOUTS)
        as_int("micro_batches", self.micro_batches, lo=1)
        as_bool("bf16", self.bf16)
        if isinstance(self.lr, bool) or not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise CPInputError(f"lr must be a finite number > 0, got {self.lr!r}")
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not (isinstance(clip, (int, float)) and math.isfinite(clip)
                                                                 and clip > 0)):  # fmt: skip
            raise CPInputError(f"grad_clip must be None or a finite number > 0, got {clip!r}")


class PackSource:
    """Packs of a document stream by index, made on demand and kept (pack `n` is always the same).

    Args:
        documents: a function returning a fresh iterator of documents (called once).
        pack_tokens: tokens per pack.

    Attributes:
        tokens: the tokens of the documents read so far, end-of-document tokens included (all of
            them once `available` has counted fewer packs than it was asked for).
    """

    def __init__(self, documents: Callable[[], Iterator[torch.Tensor]], pack_tokens: int) -> None:
        if not callable(documents):
            raise CPInputError(f"documents must be a function returning an iterator of documents, got {type(documents).__name__}")
        self.pack_tokens = as_int("pack_tokens", pack_tokens, lo=2)  # a token and its end-of-document token
        self.tokens = 0  # tokens of the documents read so far, end-of-document tokens included
        self._packs = pack_documents(self._counted(documents()), pack_tokens)
        self._made: list[Pack] = []

    def _counted(self, documents: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        for doc in documents:
            self.tokens += len(doc) + 1  # pack_documents appends one end-of-document token
            yield doc

    def available(self, most: int) -> int:
        """How many packs the documents fill, counting no further than `most` (the packs are made, and kept)."""
        while len(self._made) < most:
            try:
                self._made.append(next(self._packs))
            except StopIteration:
                break
        return min(len(self._made), most)

    def __getitem__(self, n: int) -> Pack:
        if self.available(n + 1) <= n:
            raise CPInputError(f"the documents fill only {len(self._made)} packs; pack {n} was asked for")
        return self._made[n]


def check_packs(source: PackSource, steps: int, dp_size: int, micro_batches: int) -> None:
    """Refuse a run of `steps` steps that the documents cannot fill, before its first step (the packs are made).

    A step takes `dp_size x micro_batches` packs ([`step_packs`][cpref.train.training.step_packs]).

    Raises:
        CPInputError: naming the packs the run takes, those the documents fill, and the fix.
    """
    per_step = dp_size * micro_batches
    need = steps * per_step
    have = source.available(need)
    if have < need:
        fixes = [f"train at most {have // per_step} steps"] if have >= per_step else []
        if source.tokens // need >= 2:
            fixes.append(f"make packs of at most {source.tokens // need} tokens")
        raise CPInputError(f"{steps} step{'s' * (steps != 1)} of {dp_size} x {micro_batches} packs (dp_size x "
                           f"micro_batches) take {need} packs of {source.pack_tokens} tokens, but the documents "
                           f"({source.tokens} tokens) fill only {have}: " + ", or ".join([*fixes, "give more documents"]))  # fmt: skip


def step_packs(source: PackSource, step: int, topo: Topology, micro_batches: int) -> list[Pack]:
    """The packs of DP replica `topo.dp_rank` at `step`: `micro_batches` of them, disjoint across replicas."""
    first = step * topo.dp_size * micro_batches
    return [source[first + m * topo.dp_size + topo.dp_rank] for m in range(micro_batches)]


@dataclass(frozen=True)
class StepStats:
    """What a step reports (the same on every rank)."""

    step: int
    loss: float
    grad_norm: float
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Tokens of every replica's packs trained on per second of this step."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def _cpref_model_forward(model: torch.nn.Module, batch: dict, ctx: Any) -> torch.Tensor:
    """`cpref.models`' call: `model(tokens, position_ids, ctx)`, logits `(T_l, V)`."""
    return model(batch["tokens"], batch["position_ids"], ctx)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, packs: list[Pack], topo: Topology,
               config: TrainConfig, step: int = 0, forward: Forward | None = None) -> StepStats:  # fmt: skip
    """One optimizer step on this rank's packs (see the module docstring for the four parts).

    `forward(model, batch, ctx)` gives the logits `(T_l, V)` of one micro-batch (`batch` from
    `get_batch_on_this_cp_rank`, `ctx` a `cpref.models.CPContext`); default: `cpref.models`' call,
    `model(tokens, position_ids, ctx)`; [`cpref.hf.forward`][cpref.hf.forward] for Hugging Face models."""
    forward = _cpref_model_forward if forward is None else forward
    from cpref.models import CPContext

    start = time.perf_counter()
    # 1) this rank's shard of every micro-batch
    batches = []
    for pack in packs:
        labels, mask = labels_for(pack)
        batches.append(get_batch_on_this_cp_rank({"tokens": pack.tokens, "labels": labels, "loss_mask": mask},
                                                 pack.cu_seqlens, cp_size=topo.cp.size, rank=topo.cp.rank,
                                                 layout=config.layout, mask=pack.mask))  # fmt: skip
    # --8<-- [start:dp_cp_reduction]
    # 2) the loss tokens of the whole step, then each micro-batch's share,
    #    back-propagated
    local = torch.stack([b["loss_mask"].double().sum() for b in batches])
    count = topo.world.all_reduce(local.sum().reshape(1))  # (1,) all loss tokens
    optimizer.zero_grad(set_to_none=False)
    total = torch.zeros((), dtype=torch.float64)
    for pack, b in zip(packs, batches):
        ctx = CPContext(comm=topo.cp, sharding=b["sharding"], mode=config.mode,
                        options=dict(config.options), mask=pack.mask)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if config.bf16
                    else contextlib.nullcontext())
        with autocast:
            logits = forward(model, b, ctx)  # (T_l, vocab)
        token_loss = F.cross_entropy(logits.float(), b["labels"],
                                     reduction="none")  # (T_l,)
        share = cp_loss(token_loss, b["loss_mask"], topo.world, count=count)
        share.backward()
        total += share.detach().double()
    # 3) gradients of replicated parameters: sum over every replica, one buffer
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # a parameter this rank's packs did not reach still
            p.grad = torch.zeros_like(p)  # takes part in the sum
    grads = torch.cat([p.grad.flatten() for p in params])  # (n_params,)
    flat = topo.world.all_reduce(grads)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    # --8<-- [end:dp_cp_reduction]
    # 4) the step's loss; a loss or norm that is not finite stops the run before the update (every rank alike: both
    #    are all-reduced); else clip by the global norm, update
    loss = topo.world.all_reduce(total.reshape(1))  # (1,) the step's mean loss
    norm = flat.double().norm()
    if not (math.isfinite(float(loss)) and math.isfinite(float(norm))):
        fixes = [f"lower the learning rate (lr={config.lr:g})",
                 *(["clip the gradients (grad_clip=None)"] if config.grad_clip is None else []),
                 *(["train in float32 (bf16=True)"] if config.bf16 else []), "check the batch"]  # fmt: skip
        raise NonFiniteStepError(f"step {step}: the loss is {float(loss):g} and the gradients' norm {float(norm):g}, not "
                                 "finite; the step is not taken (the weights are the last finite step's, no checkpoint "
                                 f"of it is written): {', '.join(fixes[:-1])} or {fixes[-1]}")  # fmt: skip
    if config.grad_clip is not None and norm > config.grad_clip:
        for p in params:
            p.grad.mul_(config.grad_clip / float(norm))
    optimizer.step()
    tokens = topo.dp_size * sum(len(p.tokens) for p in packs)
    return StepStats(step, float(loss), float(norm), tokens, time.perf_counter() - start)


@dataclass(frozen=True)
class Checkpointing:
    """When and where `train` saves checkpoints ([`cpref.train.checkpoint`][cpref.train.checkpoint]).

    Attributes:
        directory: the checkpoint directory (replaced by each save).
        meta: `meta(step)`, what the checkpoint after `step` steps records.
        every: also save after every `every` steps, so that a crash loses at most `every` steps
            (None: only after the last step).
        payload: how the state is written (default `TorchPayload`; `DcpPayload` on process groups).
        overwrite: allow replacing a checkpoint this run does not continue, or one at the first save's step
            or later (only cpref's own files ever go).
        resumed: the checkpoint this run resumed from: a save may replace it with a later step.
        lock: the lock on `directory` the caller holds for the whole run
            ([`hold`][cpref.train.checkpoint_lock.hold], e.g. taken before resuming); None: `train` takes it
            before the first step and lets go at the end.
        on_save: `on_save(step, path)` after each save, on every rank (e.g. to say so).
    """

    directory: Any
    meta: Callable[[int], CheckpointMeta]
    every: int | None = None
    payload: Payload | None = None
    overwrite: bool = False
    resumed: Any = None
    lock: SaveLock | None = None
    on_save: Callable[[int, Path], Any] | None = None

    def __post_init__(self) -> None:
        if self.every is not None:
            as_int("every", self.every, lo=1)

    def due(self, done: int, steps: int) -> bool:
        """Whether to save once `done` steps (of `steps`) are trained."""
        return done == steps or (self.every is not None and done % self.every == 0)

    def saves(self, start: int, steps: int) -> list[int]:
        """Every `done` in `start + 1 .. steps` that is `due`, in order (without walking every step)."""
        every = () if self.every is None else range((start // self.every + 1) * self.every, steps, self.every)
        return [*every, steps] if steps > start else []


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: PackSource, topo: Topology,
          config: TrainConfig, steps: int, *, start: int = 0, on_step: Callable[[StepStats], Any] | None = None,
          checkpoint: Checkpointing | None = None, forward: Forward | None = None) -> list[StepStats]:  # fmt: skip
    """Steps `start .. steps - 1`; `on_step` sees every step's stats (e.g. to print); `forward` as in `train_step`.

    With `checkpoint`, the save target is checked before the first step (on every rank alike:
    see [`check_save`][cpref.train.checkpoint.check_save]), the run holds its lock from then to its
    end (unless `checkpoint.lock` is held already: a second run saving there is refused, see
    [`checkpoint_lock`][cpref.train.checkpoint_lock]), and a checkpoint is written whenever
    `checkpoint.due(done, steps)`.
    """
    steps, start = as_int("steps", steps, lo=0), as_int("start", start, lo=0)
    saves = [] if checkpoint is None else checkpoint.saves(start, steps)
    run = {"config": config, "steps": steps, "start": start, "saves": saves, "dp_size": topo.dp_size}
    check_same(topo.world, "cpref.train.training.train", run)  # before any step: a rank alone with other settings is named
    check_packs(source, steps, topo.dp_size, config.micro_batches)  # not cut short at the last pack the data fills
    held = contextlib.nullcontext(None if checkpoint is None else checkpoint.lock)
    if saves:
        path = check_save(checkpoint.directory, saves[0], overwrite=checkpoint.overwrite, resumed=checkpoint.resumed)
        held = held if checkpoint.lock is not None else hold(path, topo.world)
    # what a save may replace: the checkpoint resumed from, then the run's own last save (overwrite: the first only)
    continues, first = (None if checkpoint is None else checkpoint.resumed), True
    stats = []
    with held as lock:
        for step in range(start, steps):
            s = train_step(model, optimizer, step_packs(source, step, topo, config.micro_batches), topo, config, step, forward)
            stats.append(s)
            if on_step is not None:
                on_step(s)
            if step + 1 in saves:
                saved = save_checkpoint(checkpoint.directory, model, optimizer, checkpoint.meta(step + 1), topo.world,
                                        checkpoint.payload, overwrite=checkpoint.overwrite and first, resumed=continues,
                                        lock=lock)  # fmt: skip
                continues, first = checkpoint.directory, False
                if checkpoint.on_save is not None:
                    checkpoint.on_save(step + 1, saved)
    return stats
