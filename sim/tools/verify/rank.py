"""What every rank of `python -m sim verify` runs: the production path, forward and backward.

[`rank_main`][sim.tools.verify.rank.rank_main] is the module-level function that `sim.tools.launch`
starts on every process (or that torchrun's processes run). Per rank:

1. make the CP groups of the run once: the world, or `TorchComm.split` into the CP groups
   of each `(P, placement)` the cases use (non-consecutive ranks when strided);
2. for every case, build the CP group's global batch from the seed, take this rank's shard
   (with the batch's `cpref.Sharding`),
   move it to the rank's device (cpu for gloo, `cuda:<local rank>` for NCCL,
   `npu:<local rank>` for HCCL), run the implementation, backpropagate the upstream
   gradient, and keep `out, dq, dk, dv` on the CPU;
3. on CP rank 0 only, run the group's whole batch once more without CP
   ([`run_without_cp`][sim.tools.verify.rank.run_without_cp]: `cpref.attention` on a `SingleRank`,
   the same kernel, dtype, device, mask and window), the reference of the `vs P=1` column;
4. return both (under torchrun, gather every rank's results on rank 0, which compares).

A case that raises is not caught and skipped: a rank that raised can no longer be trusted to
meet its peers in the next collective, so the run ends there, and the exception carries the
case (`CaseFailed`) to the launcher's report.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import cpref
from cpref.backends import TorchComm
from cpref.kernels import NpuKernel, TorchKernel
from sim.tools.launch import under_torchrun
from sim.tools.progress import Progress
from sim.tools.verify.cases import Case, Setup, cp_groups, make_batch, placement

__all__ = ["Plan", "CaseFailed", "rank_main", "run_case", "run_without_cp", "load_impl", "make_kernel", "DEVICE_TYPES"]

DEVICE_TYPES = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
Result = tuple[torch.Tensor | None, ...]  # (out, dq, dk, dv) of one rank and case, on the CPU
Pair = tuple[Result, Result | None]  # (the rank's result, the whole batch's without CP on CP rank 0, else None)


class CaseFailed(RuntimeError):
    """A case raised on this rank; the message names the case, the original exception is chained."""


@dataclass(frozen=True)
class Plan:
    """Everything the ranks need, sent to each of them once.

    Attributes:
        setup: what the cases share.
        cases: the cases, in the order every rank runs them.
        backend: the `torch.distributed` backend (`"gloo"`, `"nccl"`, `"hccl"`).
        progress: draw a progress bar on rank 0 (None: if stderr is a terminal).
    """

    setup: Setup
    cases: tuple[Case, ...]
    backend: str = "gloo"
    progress: bool | None = None

    @property
    def device_type(self) -> str:
        """The torch device type the backend runs on: cpu (gloo), cuda (nccl) or npu (hccl)."""
        return DEVICE_TYPES[self.backend]


def load_impl(spec: str) -> Callable[..., torch.Tensor]:
    """Import `"package.module:function"`.

    Raises:
        ValueError: if `spec` is not of that form, does not import, or is not callable.
    """
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--impl {spec!r}: expected package.module:function, e.g. tests.backends.verify_impls:cpref_over_group")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--impl {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"--impl {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def make_kernel(name: str) -> Any:
    """`TorchKernel()` for `"torch"`, `NpuKernel()` for `"npu"` (imports torch_npu)."""
    return NpuKernel() if name == "npu" else TorchKernel()


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())  # bound by sim.tools.launch


def make_groups(plan: Plan) -> dict[tuple[int, bool], tuple[TorchComm, int]]:
    """`{(P, strided): (this rank's CP communicator, its DP index)}`, made in case order (the same on every rank)."""
    world = TorchComm()
    groups: dict[tuple[int, bool], tuple[TorchComm, int]] = {}
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


def run_case(case: Case, setup: Setup, comm: TorchComm, dp: int, device: torch.device, kernel: Any) -> Result:
    """One case on this rank: shard, forward, backward; `(out, dq, dk, dv)` on the CPU."""
    # 1) this CP group's batch, and this rank's shard of it on the rank's device
    batch = make_batch(setup, case, dp)
    sharding = batch.sharding  # over comm.size = case.cp ranks, the case's layout
    shard = lambda t: sharding.shard(t, comm.rank).to(device)  # noqa: E731
    q, k, v = (shard(t).requires_grad_(True) for t in (batch.q, batch.k, batch.v))  # (T / P, H, D)
    dout = shard(batch.dout)  # (T / P, Hq, D)
    kwargs = dict(mode=case.mode, causal=case.causal, window=case.window, **dict(case.options))
    # 2) the implementation: cpref.attention over TorchComm, or --impl over the process group
    if case.impl == "cpref":
        out = cpref.attention(q, k, v, sharding, comm=comm, kernel=kernel, **kwargs)  # (T / P, Hq, D)
    else:
        out = load_impl(case.impl)(q, k, v, sharding, process_group=comm.process_group, **kwargs)
    # 3) backward with the upstream gradient
    out.backward(dout)
    grads = (None if t.grad is None else t.grad.detach().cpu() for t in (q, k, v))
    return (out.detach().cpu(), *grads)


def run_without_cp(case: Case, setup: Setup, dp: int, device: torch.device, kernel: Any) -> Result:
    """CP group `dp`'s whole batch on this one device at P = 1 (`cpref.attention` on a `SingleRank`,
    the same kernel, in the case's dtype): `(out, dq, dk, dv)` over the whole stream, on the CPU."""
    batch = make_batch(setup, case, dp)
    q, k, v = (t.to(device).requires_grad_(True) for t in (batch.q, batch.k, batch.v))  # (T, H, D)
    whole = cpref.Sharding(batch.cu, cp_size=1, cu_seqlens_padded=batch.cu_padded)  # one rank: every document whole
    out = cpref.attention(q, k, v, whole, comm=cpref.SingleRank(), mode="all_gather", causal=case.causal,
                          window=case.window, kernel=kernel)  # fmt: skip
    out.backward(batch.dout.to(device))
    return out.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()


def rank_main(plan: Plan) -> list[Pair] | list[list[Pair]] | None:
    """Run every case of `plan` on this rank (see the module docstring).

    Returns:
        This rank's `(result, without CP)` per case (the second None but on CP rank 0); under
        torchrun, every rank's list on rank 0 (indexed by world rank) and None on the other ranks.

    Raises:
        CaseFailed: if a case raised on this rank.
    """
    groups, device = make_groups(plan), _device(plan.device_type)
    kernel = make_kernel(plan.setup.kernel)  # cpref's cases and every case's run without CP
    first = dist.get_rank() == 0
    bar = Progress(len(plan.cases), "ranks run the cases", enabled=plan.progress if first else False)
    results: list[Pair] = []
    for case in plan.cases:
        comm, dp = groups[(case.cp, case.strided)]
        try:
            got = run_case(case, plan.setup, comm, dp, device, kernel if case.impl == "cpref" else None)
            results.append((got, run_without_cp(case, plan.setup, dp, device, kernel) if comm.rank == 0 else None))
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
