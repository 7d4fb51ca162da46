"""The planner's counts are the modes' own: a dry run on meta tensors against a real run on the simulated cluster.

For every mode (and its options), layout, P = 2, 4, 8, with and without a window, chunks or a `cpref.Mask`: each rank's collectives
(op, group, input shape and dtype, shift) equal the trace's, group by group in order; the bytes each rank sends per
link level add up to the trace's bytes for every collective (nodes of 2 ranks, so that P = 4 and 8 have both
levels); each rank's kernel calls (pass, work, rows, heads, dims) equal those of the real run, in order; and the
bytes the step saves for the backward equal the real run's saved tensors.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpref
from cpref.base.errors import CPInputError
from cpref.kernels import TorchKernel, Varlen
from sim.cluster.simcluster import SimCluster
from sim.plan.dry import Collective, KernelCall, band_width, dry_run
from sim.plan.links import LEVELS, link_bytes
from tests.helpers import cu_from_lengths, random_qkv

LENGTHS = [96, 48, 240]  # every document a multiple of 2 P for P <= 8
HEADS = (8, 4, 8, 8)  # Hq, Hkv, D, Dv: a2a's head groups of 2 at P = 2
LAYOUTS = ["contiguous", "zigzag", "stream", "balanced"]
CU = cu_from_lengths(LENGTHS).tolist()
MASKS = {"causal": {}, "window": {"window": (20, 0)}, "chunk": {"chunk": 40},
         "prefix-lm": {"mask": cpref.Mask.prefix_lm(CU, [30, 0, 100])},  # under a cpref.Mask, balanced is by the mask
         "shared-prompt": {"mask": cpref.Mask.shared_prompt([(96, [48, 240])])}}  # fmt: skip
OPTIONS = [("p2p", {}), ("all_gather", {}), ("all_gather", {"overlap": True}), ("all_gather", {"save_gathered_kv": True}),
           ("a2a", {}), ("a2a", {"head_groups": 2}), ("a2a+p2p", {"a2a_size": 2}),
           ("a2a+p2p", {"a2a_size": 2, "head_groups": 2})]  # fmt: skip


class Recording:
    """A real kernel whose calls are kept as the dry run's `TallyKernel` describes them."""

    deterministic, variants = True, frozenset({"softcap"})

    def __init__(self) -> None:
        self.kernel, self.calls = TorchKernel(), []

    def _keep(self, direction, q, k, v, seqs, causal, window) -> None:
        band = tuple(window) != (-1, -1)
        self.calls.append(KernelCall(direction, seqs.work(causal, tuple(window)), q.shape[0], k.shape[0], q.shape[1],
                                     k.shape[1], q.shape[2], v.shape[2], band, seqs.rows_seeing(causal, tuple(window)),
                                     widest_row(seqs, causal, tuple(window)) if band else 0))  # fmt: skip

    def forward(self, q, k, v, seqs, *, causal, scale, window=(-1, -1), **kw):
        self._keep("forward", q, k, v, seqs, causal, window)
        return self.kernel.forward(q, k, v, seqs, causal=causal, scale=scale, window=window, **kw)

    def backward(self, dout, q, k, v, out, lse, seqs, *, causal, scale, window=(-1, -1), **kw):
        self._keep("backward", q, k, v, seqs, causal, window)
        return self.kernel.backward(dout, q, k, v, out, lse, seqs, causal=causal, scale=scale, window=window, **kw)


def widest_row(seqs, causal: bool, window: tuple[int, int]) -> int:
    """The most keys a row sees, row by row (the dry run's `band_width` finds it at a few rows)."""
    widths = [max(0, hi - lo) for i in range(seqs.num_seqs)
              for lo, hi in (seqs.visible(i, x, causal, window) for x in range(seqs.cu_q[i + 1] - seqs.cu_q[i]))]  # fmt: skip
    return max(widths, default=0)


def real_run(mode: str, sharding: cpref.Sharding, **arguments):
    """`(per rank: (kernel calls, saved bytes), trace)` of one forward + backward on the simulated cluster."""
    hq, hkv, d, dv = HEADS
    q, k, v = random_qkv(sharding.total, hq, hkv, d, dv, dtype=torch.float32)
    dout = random_qkv(sharding.total, hq, hq, dv, seed=1, dtype=torch.float32)[0]
    cluster = SimCluster(sharding.cp_size, timeout=60.0)

    def rank(comm):
        kernel, saved = Recording(), []
        local = [sharding.shard(x, comm.rank).requires_grad_() for x in (q, k, v)]
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x,
                                                      lambda x: x):  # fmt: skip
            out = cpref.attention(*local, sharding, comm=comm, mode=mode, kernel=kernel, **arguments)
        out.backward(sharding.shard(dout, comm.rank))
        return kernel.calls, sum(saved)

    return cluster.run(rank), cluster.trace


def by_group(collectives):
    """`{group: [(op, shape, dtype, shift), ...]}` in order."""
    out = {}
    for c in collectives:
        out.setdefault(c.group, []).append((c.op, c.shape, c.dtype, c.shift))
    return out


def traced(trace, rank: int) -> tuple[dict, list[tuple[Collective, int]]]:
    """The trace's collectives of `rank` (payload only): by group, and each with the bytes it sent."""
    mine = [ev for ev in trace if rank in ev.group and ev.op not in ("split", "barrier") and ev.param != "host"]
    as_dry = []
    for ev in mine:
        shift = int(ev.param.removeprefix("shift=")) if ev.param.startswith("shift=") else 0
        as_dry.append((Collective(ev.op, ev.group, ev.group.index(rank), ev.shape, ev.dtype, shift),
                       ev.bytes_sent[ev.group.index(rank)]))  # fmt: skip
    return by_group(c for c, _ in as_dry), as_dry


CASES = [(mode, options, layout, P, mask) for (mode, options), layout, P, mask
         in itertools.product(OPTIONS, LAYOUTS, (2, 4, 8), MASKS)]  # fmt: skip


@pytest.mark.sweep
@pytest.mark.parametrize("mode, options, layout, P, mask", CASES,
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items())}-{la}-P{P}-{ma}" for m, o, la, P, ma in CASES])  # fmt: skip
def test_a_dry_run_counts_what_the_mode_does_on_every_rank(mode, options, layout, P, mask):
    arguments = {**options, **MASKS[mask]}
    sharding = cpref.Sharding(CU, cp_size=P, layout=layout, mask=arguments.get("mask") if layout == "balanced" else None)
    try:
        dry = [dry_run(mode, sharding, r, heads=HEADS, dtype=torch.float32, **arguments) for r in range(P)]
    except CPInputError as refused:  # the head counts or the mask do not allow it: the real run refuses alike
        with pytest.raises(CPInputError, match=re.escape(str(refused).split(":")[0])):
            real_run(mode, sharding, **arguments)
        return
    ranks, trace = real_run(mode, sharding, **arguments)
    for r in range(P):
        groups, sent = traced(trace, r)
        assert by_group(dry[r].collectives) == groups, f"rank {r}: collectives"
        for c, nbytes in sent:
            per_level = link_bytes(c, ranks_per_node=2)
            assert sum(per_level.values()) == nbytes and set(per_level) == set(LEVELS), (r, c)
        calls, saved = ranks[r]
        assert list(dry[r].calls) == calls, f"rank {r}: kernel calls"
        assert dry[r].saved_bytes == saved, f"rank {r}: saved bytes"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-50, 50)), min_size=1, max_size=4),
       st.integers(-1, 45), st.integers(-1, 45), st.booleans())  # fmt: skip
def test_band_width_is_the_widest_row_of_every_call(seqs, left, right, causal):
    """Closed form against row by row: sequences of any lengths and shifts (bottom-right, the ring's and the pieces'
    explicit ones), windows narrower and wider than the keys, one side unbounded, causal or not."""
    q_lens, k_lens, shifts = zip(*seqs)
    varlen = Varlen.from_lengths(q_lens, k_lens, shifts)
    window = (left, 0 if causal else right)
    assert band_width(varlen, causal, window) == widest_row(varlen, causal, window)
