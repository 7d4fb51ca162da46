"""What every rank of `python -m sim verify` runs: the production path, forward and backward.

[`rank_main`][sim.tools.verify.rank.rank_main] is the module-level function that `sim.tools.launch`
starts on every process (or that torchrun's processes run). Per rank:

1. make the CP groups of the run once: the world, or `TorchComm.split` into the CP groups
   of each `(P, placement)` the cases use (non-consecutive ranks when strided);
2. for every case, build the CP group's global batch from the seed, take this rank's shard
   (with the batch's `cpref.Sharding`),
   move it to the rank's device (cpu for gloo, `cuda:<local rank>` for NCCL,
   `npu:<local rank>` for HCCL), run the implementation, backpropagate the upstream
   gradient, and keep `out, dq, dk, dv` on the CPU; where a rank's output cannot take that
   gradient (not its shard's shape, not a tensor, not differentiable) no rank of the group runs
   the backward (its peers would wait for it in a collective), and every rank's row says whose
   output stopped it: the table is printed all the same;
3. on CP rank 0 only, run the group's whole batch once more without CP
   ([`run_without_cp`][sim.tools.verify.rank.run_without_cp]: the row's baseline,
   [`sim.tools.verify.baselines`][sim.tools.verify.baselines], in the same dtype, on the same device,
   with the same mask and window: the implementation itself on a process group of this one rank,
   SDPA, eager attention, cpref's kernel or your local attention; where the implementation raises there,
   SDPA and eager attention both), the reference of the `vs P=1` column;
4. return both (under torchrun, gather every rank's results on rank 0, which compares).

A case that raises is not caught and skipped: a rank that raised can no longer be trusted to
meet its peers in the next collective, so the run ends there, and the exception carries the
case (`CaseFailed`) to the launcher's report.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import cpref
from cpref.comm import TorchComm
from cpref.kernels import NpuKernel, TorchKernel
from sim.tools.launch import under_torchrun
from sim.tools.verify.baselines import FALLBACK, label, resolve, run_baseline
from sim.tools.verify.cases import Case, Setup, call_variants, case_mask, cp_groups, make_batch, placement
from sim.tools.verify.impls import load_impl
from sim.tools.verify.loopback import loopback
from sim.tools.verify.meter import meter
from sim.tools.verify.wire import Tally, Wire, WorkKernel

__all__ = ["Plan", "CaseFailed", "SKIPPED", "rank_main", "run_case", "run_without_cp", "make_kernel",
           "DEVICE_TYPES"]  # fmt: skip

DEVICE_TYPES = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
Result = tuple[torch.Tensor | None, ...]  # (out, dq, dk, dv) of one rank and case, on the CPU
Baseline = tuple[tuple[Result, ...], str, str]  # the whole batch's results without CP (one per candidate), its label, a note
Traffic = tuple[Tally, Tally | None]  # what the rank moved and computed: the case's implementation, cpref beside it
Pair = tuple[Result, Baseline | None, str, Traffic | None]  # (result, the run without CP on CP rank 0 else None, note,
# traffic; None where the case was skipped)


class CaseFailed(RuntimeError):
    """A case raised on this rank; the message names the case, the original exception is chained."""


SKIPPED = "skipped"  # a rank's result of a case its implementation does not support: `((), None, "skipped (why)", None)`


@dataclass(frozen=True)
class Plan:
    """Everything the ranks need, sent to each of them once.

    Attributes:
        setup: what the cases share.
        cases: the cases, in the order every rank runs them.
        backend: the `torch.distributed` backend (`"gloo"`, `"nccl"`, `"hccl"`).
        progress: rank 0 draws a progress bar (None: if stderr is a terminal, else a line per case; `meter`).
    """

    setup: Setup
    cases: tuple[Case, ...]
    backend: str = "gloo"
    progress: bool | None = None

    @property
    def device_type(self) -> str:
        """The torch device type the backend runs on: cpu (gloo), cuda (nccl) or npu (hccl)."""
        return DEVICE_TYPES[self.backend]


def mask_call(setup: Setup, case: Case) -> dict[str, Any]:
    """`mode`, `causal`, `window` and, under `--mask`, `mask` (a `cpref.Mask`) as every call of the case takes them:
    a mask replaces causal and window, so they keep `cpref.attention`'s defaults there (`Case` holds to it)."""
    mask = case_mask(setup, case)
    return dict(mode=case.mode, causal=case.causal, window=case.window, **({} if mask is None else {"mask": mask}))


def make_kernel(name: str) -> Any:
    """`TorchKernel()` for `"torch"`, `NpuKernel()` for `"npu"` (imports torch_npu)."""
    return NpuKernel() if name == "npu" else TorchKernel()


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())  # bound by sim.tools.launch


def make_groups(plan: Plan) -> dict[Any, tuple[TorchComm, int]]:
    """`{(P, strided): (this rank's CP communicator, its DP index)}`, made in case order (the same on every rank),
    and under the key `"solo"` a group of this rank alone, where a baseline runs the implementation at CP size 1."""
    world = TorchComm()
    groups: dict[Any, tuple[TorchComm, int]] = {}
    if any(resolve(plan.setup.baseline, case.impl) == "impl" for case in plan.cases):
        groups["solo"] = (world.split([[g] for g in range(world.size)]), 0)
    for case in plan.cases:
        key = (case.cp, case.strided)
        if key in groups:
            continue
        if world.size % case.cp:
            raise ValueError(f"case {case.label}: the world of {world.size} ranks does not split into CP groups of {case.cp}")
        dp, r = placement(world.global_rank, world.size, case.cp, case.strided)
        comm = world if case.cp == world.size else world.split(cp_groups(world.size, case.cp, case.strided))
        assert comm.rank == r and comm.size == case.cp, f"{comm} is not CP rank {r} of group {dp}"
        groups[key] = (comm, dp)
    return groups


def run_case(case: Case, setup: Setup, comm: TorchComm, dp: int, device: torch.device,
             kernel: Any) -> tuple[Result, str, Traffic]:  # fmt: skip
    """One case on this rank: shard, forward, backward; `((out, dq, dk, dv) on the CPU, note, traffic)`, and with
    `--sinks` the sinks' gradient summed over the CP group (what a DP x CP step's all-reduce sums: the reduction
    contract) fifth. `kernel` is cpref's (its cases, and its mode run beside an `--impl`).

    The backward runs on every rank of the group or on none: where a rank's output cannot take the upstream gradient
    (`unusable`: not a tensor, not its shard's shape, not differentiable), its peers' backward would wait for it in a
    collective, so no rank runs it; the gradients are None and `note` says which rank's output stopped it. Under
    `--forward-only` none runs either, and the note stays empty.

    `traffic` is what the rank moved and computed (`sim.tools.verify.wire`): the implementation's, and beside an
    `--impl` cpref's own mode's on the same shard (else None)."""
    # 1) this CP group's batch, and this rank's shard of it on the rank's device
    batch = make_batch(setup, case, dp)
    sharding = batch.sharding  # over comm.size = case.cp ranks, the case's layout
    shard = lambda t: sharding.shard(t, comm.rank).to(device)  # noqa: E731
    grad = not setup.forward_only
    q, k, v = (shard(t).requires_grad_(grad) for t in (batch.q, batch.k, batch.v))  # (T / P, H, D)
    dout = shard(batch.dout)  # (T / P, Hq, D)
    variants = call_variants(case, setup.heads[0], device=device, grad=grad)  # the sinks: this rank's own leaf
    kwargs = dict(**mask_call(setup, case), **variants, **dict(case.options), **dict(case.impl_options))
    # 2) the implementation: cpref.attention over TorchComm, or --impl over the process group, counted (wire)
    unsupported, tally = "", Tally()
    with Wire(tally, attention=case.impl != "cpref"):
        if case.impl == "cpref":
            out = cpref.attention(q, k, v, sharding, comm=comm, kernel=WorkKernel(kernel, tally), **kwargs)  # (T / P, Hq, D)
        else:
            try:
                out = load_impl(case.impl)(q, k, v, sharding, process_group=comm.process_group, **kwargs)
            except NotImplementedError as exc:  # a case it does not support, said before it communicates
                out, unsupported = None, str(exc) or "not supported"
    # 3) backward with the upstream gradient, where every rank's output can take it (one tiny host exchange)
    why = UNUSABLE[-1] if unsupported else unusable(out, dout, setup.forward_only)
    codes = [code for (code,) in comm.agree([UNUSABLE.index(why)])]
    if unsupported and all(UNUSABLE[c] == UNUSABLE[-1] for c in codes):  # on every rank: the case is skipped
        raise NotImplementedError(unsupported)
    beside = None if case.impl == "cpref" else run_beside(case, setup, comm, sharding, batch, device, kernel)
    stopped = {r: UNUSABLE[code] for r, code in enumerate(codes) if code}
    got = out.detach().cpu() if isinstance(out, torch.Tensor) else None
    if stopped or not grad:
        ranks = {w: [r for r, x in stopped.items() if x == w] for w in dict.fromkeys(stopped.values())}
        note = "; ".join(f"out {w} on CP rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}" for w, rs in ranks.items())
        grads = [None] * (4 if "sinks" in variants else 3)
        return (got, *grads), note and f"no backward run: {note}", (tally, beside)
    with Wire(tally, attention=False):
        out.backward(dout)
    grads = (None if t.grad is None else t.grad.detach().cpu() for t in (q, k, v))
    sinks = variants.get("sinks")
    if sinks is None:
        return (got, *grads), "", (tally, beside)
    share = torch.zeros_like(sinks) if sinks.grad is None else sinks.grad.detach().clone()
    return (got, *grads, comm.all_reduce(share).cpu()), "", (tally, beside)


def run_beside(case: Case, setup: Setup, comm: TorchComm, sharding: cpref.Sharding, batch: Any, device: torch.device,
               kernel: Any) -> Tally:  # fmt: skip
    """cpref's own mode (the case's) on this rank's same shard, forward and backward, counted: what an `--impl`'s
    bytes and balance are printed beside. Its numbers are not compared (cpref's own cases do that)."""
    tally, grad = Tally(), not setup.forward_only
    q, k, v = (sharding.shard(t, comm.rank).to(device).requires_grad_(grad) for t in (batch.q, batch.k, batch.v))
    variants = call_variants(case, setup.heads[0], device=device, grad=grad)
    call = dict(**mask_call(setup, case), **variants, **dict(case.options))
    with Wire(tally, attention=False):
        out = cpref.attention(q, k, v, sharding, comm=comm, kernel=WorkKernel(kernel, tally), **call)
        if grad:
            out.backward(sharding.shard(batch.dout, comm.rank).to(device))
    return tally


UNUSABLE = ("", "is not a tensor", "is not the shard's shape", "does not require grad",
            "was not given: NotImplementedError")  # `unusable`'s answers, and a rank whose implementation refused the case


def unusable(out: Any, dout: torch.Tensor, forward_only: bool = False) -> str:
    """Why `out` cannot take the upstream gradient `dout` (a phrase of `UNUSABLE`), or `""` where it can (under
    `forward_only`, where it is a tensor of `dout`'s shape)."""
    if not isinstance(out, torch.Tensor):
        return UNUSABLE[1]
    if out.shape != dout.shape:
        return UNUSABLE[2]
    return "" if out.requires_grad or forward_only else UNUSABLE[3]


def _unusable_output(out: Any, dout: torch.Tensor, forward_only: bool = False) -> str:
    """`unusable`'s answer as a phrase of its own: `an output of shape (95, 8, 32), not (96, 8, 32)`, ..."""
    why = unusable(out, dout, forward_only)
    if why == UNUSABLE[2]:
        return f"an output of shape {tuple(out.shape)}, not {tuple(dout.shape)}"
    return f"an output that {why}"


def run_without_cp(case: Case, setup: Setup, dp: int, device: torch.device, kernel: Any, solo: Any = None) -> Baseline:
    """CP group `dp`'s whole batch on this one device at P = 1 through the case's baseline, in its dtype:
    `((out, dq, dk, dv) over the whole stream on the CPU, one per candidate; the baseline's label; a note)`.

    `solo` is a process group of this rank alone (for the implementation itself). Where the implementation
    raises at CP size 1, the baseline is the fallback (`baselines.FALLBACK`): SDPA and eager attention both,
    each tensor of a row held to the one farther from the truth; the note says why. Where it runs but gives
    no usable result (an output that is not the batch's shape or not differentiable, or an input without a
    gradient: a detached `q`), there is no baseline: the results are `()` and the note says what was missing."""
    batch = make_batch(setup, case, dp)
    whole = cpref.Sharding(batch.cu, cp_size=1, layout=case.layout, cu_seqlens_padded=batch.cu_padded)  # one rank
    name = resolve(setup.baseline, case.impl)
    sized = cpref.MODES[case.mode].example_options(1)  # the options chosen by the CP size take their values at P = 1
    options = {key: sized.get(key, value) if key in cpref.MODES[case.mode].example_options(case.cp) else value
               for key, value in case.options}  # fmt: skip
    call = dict(**mask_call(setup, case), **options)
    impl = None if case.impl == "cpref" else load_impl(case.impl)
    if name == "impl":
        call.update(case.impl_options)  # the implementation's own settings, at CP size 1 too

    def once(attempt: str) -> tuple[Result, str]:
        """The baseline `attempt`'s results, and what it failed to give (`""`: nothing)."""
        grad = not setup.forward_only
        q, k, v = (t.to(device, copy=True).requires_grad_(grad) for t in (batch.q, batch.k, batch.v))  # (T, H, D)
        variants = call_variants(case, setup.heads[0], device=device, grad=grad)
        out = run_baseline(attempt, q, k, v, whole, impl=impl, solo=solo, kernel=kernel, **call, **variants)
        dout = batch.dout.to(device)  # (T, Hq, Dv)
        if unusable(out, dout, setup.forward_only):
            return (), _unusable_output(out, dout, setup.forward_only)
        if not grad:  # --forward-only: the output alone
            return (out.detach().cpu(),), ""
        out.backward(dout)
        missing = [n for n, t in zip(("dq", "dk", "dv"), (q, k, v)) if t.grad is None]
        if missing:
            return (), ", ".join(f"{n}: no gradient" for n in missing)
        result = (out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu())
        sinks = variants.get("sinks")
        if sinks is None:
            return result, ""
        return (*result, (torch.zeros_like(sinks) if sinks.grad is None else sinks.grad.detach()).cpu()), ""  # none: 0

    try:
        with loopback() if name == "impl" else contextlib.nullcontext():  # a ring's sends to itself: local copies
            result, missing = once(name)
    except Exception as exc:
        if name != "impl" or case.variants:  # the fallback attends without the variants: no baseline for them
            raise
        note = (f"the implementation raised at CP size 1 ({type(exc).__name__}: {exc}); baseline {label(FALLBACK)}: "
                "each tensor held to the looser of sdpa and eager")  # fmt: skip
        return tuple(once(n)[0] for n in FALLBACK), label(FALLBACK), note
    if missing:
        return (), label(name), f"vs P=1 not computed: the baseline ({label(name)}, at CP size 1) gave {missing}"
    return (result,), label(name), ""


def rank_main(plan: Plan) -> list[Pair] | list[list[Pair]] | None:
    """Run every case of `plan` on this rank (see the module docstring).

    Returns:
        This rank's `(result, without CP, note)` per case (the second None but on CP rank 0; the note says why no
        backward ran, `run_case`); under
        torchrun, every rank's list on rank 0 (indexed by world rank) and None on the other ranks.

    Raises:
        CaseFailed: if a case raised on this rank.
    """
    groups, device = make_groups(plan), _device(plan.device_type)
    kernel = make_kernel(plan.setup.kernel)  # cpref's cases and every case's run without CP
    first = dist.get_rank() == 0
    bar = meter(len(plan.cases), "ranks run the cases", plan.progress if first else False)
    results: list[Pair] = []
    for case in plan.cases:
        comm, dp = groups[(case.cp, case.strided)]
        try:
            try:
                got, note, traffic = run_case(case, plan.setup, comm, dp, device, kernel)
            except NotImplementedError as why:  # the implementation refused the case on every rank (run_case agreed)
                results.append(((), None, f"{SKIPPED} ({why or 'not supported'})", None))
                bar.step(case.label)
                continue
            solo = groups["solo"][0].process_group if "solo" in groups else None
            plain = run_without_cp(case, plan.setup, dp, device, kernel, solo) if comm.rank == 0 else None
            results.append((got, plain, note, traffic))
        except Exception as exc:
            where = f"CP group {dp}, CP rank {comm.rank}, world rank {comm.global_rank}"
            raise CaseFailed(f"case {case.label} ({where}): {type(exc).__name__}: {exc}") from exc
        bar.step(case.label)
    bar.close()
    if not under_torchrun():
        return results
    gathered = [None] * dist.get_world_size() if first else None
    dist.gather_object(results, gathered, dst=0)  # no parent process: rank 0 compares
    return gathered
