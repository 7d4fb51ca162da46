r"""The mask probe: which pairs an implementation attended, rank by rank, against the pairs the mask allows.

A wrong mask is rarely a small error. A window dropped, a mask replaced by `is_causal=True`
(accelerate #4177), documents that see each other: each moves the output by order 1, and the
verifier's table says only *that* a rank is wrong. The probe says *why*: it reads the attention
pattern straight off the output.

**The inputs.** On a small batch of $T$ tokens (the padded stream; $T \le$ `MAX_T`), every head gets

$$ q = 0, \qquad k = 0, \qquad v_y = e_y \in \mathbb{R}^{T} \quad (D = D_v = T), $$

so every score is 0, every key a query sees gets the same weight $1 / n_x$ ($n_x$ the keys it sees),
and key $y$'s value is the one-hot vector of its own index. The output is the weight matrix itself:

$$ o_{x, y} = \sum_{y'} p_{x, y'}\, [y' = y] = p_{x, y} = \frac{[x \text{ sees } y]}{n_x}. $$

A seen pair weighs at least $1 / T$ (at most $T$ keys share the weight), an unseen one exactly 0, so
"attended" is $o_{x, y} > 1 / (2T)$: unambiguous in every dtype, float64 by default.

**The truth.** The pairs the mask allows, dense over the real tokens: `sim.oracle.slice_mask` of
the case's `cpref.Mask` (`--mask`), else `sim.oracle.visibility_mask` of its documents (causal or full,
the window, chunks), placed in the padded stream (padding sees nothing and is seen by nothing).

**The report.** Each rank's output is its rows of the matrix (`sharding.global_index(rank)`); every
row of the report counts, for that rank's real queries, the pairs it attended that the mask forbids,
by why they are forbidden (across documents, after the query, outside the window, outside the chunk,
outside the mask, padding keys), and the pairs it missed, each with the first queries and their keys,
in the indices of the real packed batch (the ones `mask.slices` uses):

```text
mask probe p2p/zigzag/fp64/cp2/window=7,0 (tests.backends.probe_impls:drops_window): T=120, documents 40,56,24
  rank 0: FAIL: 961 pairs outside the window (query 8 saw key 0; query 9 saw keys 0..1; ...); none missed
  rank 1: FAIL: 879 pairs outside the window (query 10 saw keys 0..2; query 11 saw keys 0..3; ...); none missed
```

A pair attended by any head counts as attended, a pair some head missed as missed. Forward only: the
probe needs no backward, so an implementation without one is probed all the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

import cpref
from sim.tools.launch import launch, under_torchrun
from sim.tools.verify.cases import DTYPES, Case, Setup, call_variants, lengths
from sim.tools.verify.impls import load_impl
from sim.tools.verify.probe_pairs import MaskReport, compare, probe_sharding
from sim.tools.verify.rank import DEVICE_TYPES, SKIPPED, Plan, make_groups, make_kernel, mask_call
from sim.tools.verify.runner import check_cases

__all__ = ["MAX_T", "check_mask", "check_size", "probe_rank"]

MAX_T = 512  # the largest padded batch the probe takes: D = Dv = T, an output of T x T per head


def check_size(setup: Setup, cases: Sequence[Case]) -> None:
    """Refuse a batch the probe cannot take (its `Dv` is the batch's `T`), in one line naming the fix.

    Raises:
        ValueError: a case's padded batch over `MAX_T` tokens.
    """
    for case in cases:
        T = sum(lengths(setup, case)[1])
        if T > MAX_T:
            docs = ",".join(map(str, setup.docs))
            raise ValueError(f"--check-mask: case {case.label}: documents {docs} make T = {T} tokens; the probe's "
                             f"values are one-hot (Dv = T), so it takes at most {MAX_T}: give small documents, e.g. "
                             "--docs 40,56,24")  # fmt: skip


# ---- every rank: the probe's inputs through the implementation, forward only -------------------------------------
@dataclass(frozen=True)
class ProbePlan:
    """What every rank of the probe needs: the cases (in order), what they share, the backend and the dtype."""

    setup: Setup
    cases: tuple[Case, ...]
    backend: str = "gloo"


def probe_rank(plan: ProbePlan) -> list[tuple[torch.Tensor | None, str]] | list[Any] | None:
    """Run every case of `plan` on this rank with the probe's inputs, forward only: `(out on the CPU, "")` per case,
    or `(None, why)` where the output is not a tensor (under torchrun every rank's list on rank 0, None elsewhere)."""
    setup = replace(plan.setup, baseline="kernel")  # no group of one rank: the probe runs no baseline
    groups, kernel = make_groups(Plan(setup, plan.cases, plan.backend)), make_kernel(setup.kernel)
    kind = DEVICE_TYPES[plan.backend]
    device = torch.device("cpu") if kind == "cpu" else torch.device(kind, getattr(torch, kind).current_device())
    results: list[tuple[torch.Tensor | None, str]] = []
    for case in plan.cases:
        comm, _ = groups[(case.cp, case.strided)]
        sharding, (hq, hkv), dtype = probe_sharding(setup, case), setup.heads, DTYPES[case.dtype]
        T = sharding.total
        # q = 0, k = 0: every score 0; v_y = e_y: the output is the weight matrix
        q, k = torch.zeros(T, hq, T, dtype=dtype), torch.zeros(T, hkv, T, dtype=dtype)  # (T, Hq, T), (T, Hkv, T)
        v = torch.eye(T, dtype=dtype)[:, None, :].expand(T, hkv, T).contiguous()  # (T, Hkv, Dv = T)
        q, k, v = (sharding.shard(t, comm.rank).to(device) for t in (q, k, v))  # (T / P, H, T)
        variants = call_variants(case, hq, device=device)
        variants.pop("sinks", None)  # a sink takes weight: the seen keys' would depend on it
        kwargs = dict(**mask_call(setup, case), **variants, **dict(case.options), **dict(case.impl_options))
        with torch.no_grad():
            if case.impl == "cpref":
                out = cpref.attention(q, k, v, sharding, comm=comm, kernel=kernel, **kwargs)  # (T / P, Hq, T)
            else:
                try:
                    out = load_impl(case.impl)(q, k, v, sharding, process_group=comm.process_group, **kwargs)
                except NotImplementedError as why:  # a case it does not support, said before it communicates
                    results.append((None, f"{SKIPPED} ({why or 'not supported'})"))
                    continue
        if isinstance(out, torch.Tensor):
            results.append((out.detach().cpu(), ""))
        else:
            results.append((None, f"is a {type(out).__name__}, not a tensor"))
    if not under_torchrun():
        return results
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results, gathered, dst=0)  # no parent process: rank 0 compares
    return gathered


def check_mask(cases: Sequence[Case], setup: Setup | None = None, *, nproc: int = 2, backend: str = "gloo",
               timeout: float = 300.0) -> MaskReport | None:  # fmt: skip
    """Probe `cases` on `nproc` processes (one launch): which pairs every rank attended, against the mask's.

    Args:
        cases: the cases (`sim.tools.verify.cases.Case`: mode, layout, CP size, causal, window, mask, `impl`); a
            case's dtype is the probe's (fp64 reads the pattern exactly; any dtype reads it unambiguously).
        setup: the documents (a padded batch of at most `MAX_T` tokens) and the heads.
        nproc: the world size; ignored under torchrun.
        backend: `"gloo"`, `"nccl"` or `"hccl"`.
        timeout: the process-group timeout in seconds.

    Returns:
        The report; under torchrun, None on every rank but 0.

    Raises:
        ValueError: before any process starts, a batch over `MAX_T` tokens or a case `sim verify` would refuse.
        LaunchFailure: if a rank raised or died.
    """
    setup = Setup(docs=(40, 56, 24)) if setup is None else setup
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    check_size(setup, cases)
    check_cases(cases, world, backend, setup.heads)
    plan = ProbePlan(setup, tuple(cases), backend)
    per_rank = launch(probe_rank, nproc, backend=backend, timeout=timeout, args=(plan,), device=DEVICE_TYPES[backend])
    if under_torchrun():
        per_rank = per_rank[0]
        if per_rank is None:
            return None
    report = MaskReport(setup)
    for i, case in enumerate(cases):
        report.rows += [compare(setup, case, g, world, *per_rank[g][i]) for g in range(world)]
    return report
