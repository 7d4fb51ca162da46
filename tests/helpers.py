"""Shared test helpers: the tolerances every issue states, random packed batches, and the sweeps' two tiers."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from sim.oracle import TOL  # atol = rtol per dtype, as the issues state them


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """`torch.testing.assert_close` at the stated tolerance of `dtype`, comparing in float64."""
    tol = TOL[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol, rtol=tol, equal_nan=False, msg=lambda m: f"{msg}\n{m}"
    )


def random_qkv(
    total: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv) with entries ~ N(0, 1), deterministic by seed."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (Hq, Hkv, D, Dv) of the four attention kinds the mode suites run (tests/cp/test_modes.py, test_mode_costs.py)
HEADS = {"mha": (8, 8, 8, 8), "gqa": (8, 2, 8, 8), "mqa": (8, 1, 8, 8), "mla": (8, 2, 12, 8)}


def attention_inputs(
    total: int, heads: tuple[int, int, int, int], *, dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, k, v, dout)` of `total` tokens and head shape `(Hq, Hkv, D, Dv)`: q, k, v from `seed`, the
    upstream gradient `dout (T, Hq, Dv)` from `seed + 1`, entries ~ N(0, 1), rounded to `dtype`."""
    hq, hkv, d, dv = heads
    q, k, v = random_qkv(total, hq, hkv, d, dv, dtype=dtype, seed=seed)
    dout = random_qkv(total, hq, hq, dv, dtype=dtype, seed=seed + 1)[0]
    return q, k, v, dout


def cu_from_lengths(lengths: list[int]) -> torch.Tensor:
    """cu_seqlens (int64, leading 0) from document lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


def only_the_comparison(trace) -> bool:
    """Whether a simulated cluster's trace holds nothing but the ranks' comparison of their arguments
    (`cpref.modes.consistency`: one all-gather of `(1, F)` int64, or its two all-reduces): an error came
    before any of the mode's communication."""
    from cpref.modes.consistency import FIELDS

    row = (torch.int64, (1, len(FIELDS)))
    events = [(e.op, e.dtype, e.shape) for e in trace]
    return events in ([], [("all_gather", *row)], [("all_reduce", *row)] * 2)


def expected_costs(mode: str, sharding, heads, dtype, causal: bool = True, window=(-1, -1), rank: int = 0, chunk=None):
    """`mode_costs` of one call as the mode states it for rank `rank` (its formulas over the amounts of the plan it
    runs), with the options the tools run it with at this CP size."""
    import cpref
    from cpref.api import mode_costs

    options = cpref.MODES[mode].example_options(sharding.cp_size)
    return mode_costs(mode, sharding, heads=heads, dtype=dtype, causal=causal, window=window, rank=rank, chunk=chunk,
                      **options)


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 300.0):
    """`torchrun --standalone --nproc-per-node nproc script *args` from the repository root (cpref from src/,
    sim and examples from the root): the finished `subprocess.CompletedProcess`, output captured as text."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    return subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(nproc), script, *args],
                          capture_output=True, text=True, cwd=root, env=env, timeout=timeout)  # fmt: skip


# ---- the two tiers of a sweep ---------------------------------------------------------------------------------------
def _pairs(case: tuple, strength: int = 2) -> set[tuple]:
    """Every (field, value) of `case` and, for strength 2, every pair of them: what a cover must hold."""
    pairs = {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)} if strength > 1 else set()
    return {(i, case[i]) for i in range(len(case))} | pairs


def pairwise(cases: Sequence[tuple], strength: int = 2) -> list[tuple]:
    """A subset of `cases` in which every value of a field, and (strength 2) every pair of values two of their
    fields take together somewhere in `cases`, occurs too (a covering array), chosen greedily (the case covering
    most of what is not yet covered, the first of equals), in the sweep's order; deterministic.

    Examples:
        >>> len(pairwise(list(itertools.product("ab", "xyz", (1, 2, 3)))))  # 18 cases, 9 cover every pair
        9
        >>> len(pairwise(list(itertools.product("ab", "xyz", (1, 2, 3))), strength=1))  # every value once
        3
    """
    todo = set().union(*(_pairs(c, strength) for c in cases)) if cases else set()
    chosen: list[tuple] = []
    while todo:
        best = max(cases, key=lambda c: len(_pairs(c, strength) & todo))
        chosen.append(best)
        todo -= _pairs(best, strength)
    return [c for c in cases if c in chosen]
