"""Chunked attention (issue 45, Llama 4's chunked layers) in every mode, layout and CP size, against the FP64 oracle,
with traffic that follows the chunks: counted from the oracle's mask, independently of the plans.

A query sees the keys of its own document whose position lies in its chunk of `C` positions (positions counted from
the document's start). The bugs these catch: chunks counted from the stream's start instead of the document's (every
test batch packs several documents of lengths no multiple of C), a chunk cut where a rank's shard ends instead of at
its positions, a chunk bound lost in one plan (the ring's off-diagonal steps, a Ulysses exchange, a split mode's own
documents), keys sent to a rank none of whose chunks reads them.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from sim.cluster.harness import trace_split
from sim.cluster.simcluster import SimCluster
from tests.cp.conftest import CountingKernel, oracle_shards, run_cp
from tests.helpers import assert_close, attention_inputs, cu_from_lengths, expected_costs, only_the_comparison

HEADS = (8, 2, 8, 8)  # (Hq, Hkv, D, Dv): GQA, split by a2a at P = 2, 4, 8
NAMES = ("out", "dq", "dk", "dv")
ROW = 2 * (8 + 8) * 8  # bytes of one K/V row: Hkv (D + Dv) float64


def lengths(P: int) -> list[int]:
    """Four documents, no length a multiple of the chunks below: chunks counted from the stream would differ."""
    return [6 * P + 1, 3 * P, 2, 11 * P + 3]


@pytest.mark.sweep
@pytest.mark.parametrize("mode", sorted(cpref.MODES))
@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (3, 0)), (False, (-1, -1)), (False, (2, 3))],
                         ids=["causal", "causal-window", "full", "full-window"])  # fmt: skip
@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_chunked_attention_in_every_mode_matches_the_oracle_rank_by_rank(mode, P, layout, causal, window, chunk):
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths(P)), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, HEADS, seed=P)
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, causal=causal, window=window, chunk=chunk,
                        **cpref.MODES[mode].example_options(P))  # fmt: skip
    refs = oracle_shards(q, k, v, dout, sharding, causal=causal, window=window, chunk=chunk)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} P={P} {layout} chunk={chunk} window={window} rank {r} {name}")


@pytest.mark.sweep
@pytest.mark.parametrize("mode, options", [
    ("a2a", dict(head_groups=2)), ("a2a+p2p", dict(a2a_size=2, head_groups=2)), ("a2a", dict(balance=False)),
    ("a2a+p2p", dict(a2a_size=2, balance=False)), ("a2a+p2p", dict(a2a_size=4)), ("a2a+p2p", dict(a2a_size=1)),
    ("all_gather", dict(save_gathered_kv=True)), ("p2p", {}),
], ids=str)  # fmt: skip
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
def test_chunks_under_every_option_of_the_modes(mode, options, layout):
    P, chunk = 4, 7
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths(P)), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (8, 8, 8, 8), seed=3)  # MHA: head_groups=2 splits a rank's heads
    results, _ = run_cp(q, k, v, dout, sharding, mode=mode, chunk=chunk, **options)
    refs = oracle_shards(q, k, v, dout, sharding, chunk=chunk)
    for r, (got, want) in enumerate(zip(results, refs)):
        for name, a, b in zip(NAMES, got, want):
            assert_close(a, b, torch.float64, msg=f"{mode} {options} {layout} rank {r} {name}")


# ---- what travels: counted from the oracle's rule, token by token ----------------------------------------------------


def sees(sharding: cpref.Sharding, causal: bool, chunk: int) -> torch.Tensor:
    """`(T, T)`: padded-stream token x sees token y (same document, both real, causal, same chunk of positions)."""
    b = sharding.bounds
    doc = torch.tensor([d for d in range(b.num_docs) for _ in range(b.padded_len(d))])
    pos = torch.cat([torch.arange(b.padded_len(d)) for d in range(b.num_docs)])
    real = pos < torch.tensor([b.real_len(d) for d in range(b.num_docs)])[doc]
    mask = (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :] & (pos[:, None] // chunk == pos[None, :] // chunk)
    return mask & (pos[None, :] <= pos[:, None]) if causal else mask


def read_from(sharding: cpref.Sharding, mask: torch.Tensor, reader: int, owner: int) -> int:
    """How many of `owner`'s rows some query of `reader` sees."""
    rows, cols = sharding.global_index(reader), sharding.global_index(owner)
    return int(mask[rows][:, cols].any(0).sum())


@pytest.mark.sweep
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("chunk, causal", [(4, True), (7, True), (16, True), (6, False)])
def test_the_ring_sends_a_rank_only_the_keys_its_chunks_read(layout, chunk, causal):
    """p2p, P = 4: one direct shift per distance d at which some rank reads a key of the rank d back, each of the
    most rows any rank reads at that distance, forward; the backward sends them again and their dK/dV home."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([40, 21, 64, 3]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    _, cluster = run_cp(q, k, v, dout, sharding, mode="p2p", causal=causal, chunk=chunk, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    mask = sees(sharding, causal, chunk)
    sizes = {d: max(read_from(sharding, mask, (s + d) % P, s) for s in range(P)) for d in range(1, P)}
    sizes = {d: m for d, m in sizes.items() if m}  # the distances the chunks reach
    for r in range(P):
        (fwd, fwd_ops), (bwd, bwd_ops) = trace_split(cluster.trace, r)
        assert fwd == sum(sizes.values()) * ROW and fwd_ops == ({"send_recv": len(sizes)} if sizes else {}), r
        assert bwd == 2 * fwd and bwd_ops == ({"send_recv": 2 * len(sizes)} if sizes else {}), r
        want = expected_costs("p2p", sharding, (4, 2, 8, 8), torch.float64, causal, rank=r, chunk=chunk)
        assert (want.forward_bytes, want.backward_bytes) == (fwd, bwd), r  # what cpref.api.mode_costs says


def test_mode_costs_refuses_a_bad_chunk_by_name():
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=2)
    with pytest.raises(CPInputError, match="chunk=0 must be an int >= 1"):
        expected_costs("p2p", sharding, (4, 2, 8, 8), torch.float64, chunk=0)


@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("chunk", [4, 9])
def test_all_gather_gathers_only_the_rows_other_ranks_chunks_read(layout, chunk):
    """all_gather, P = 4: every rank contributes the most rows any rank has that another rank's chunks read, m,
    so the forward sends (P - 1) m rows of K and V; with chunks of whole shards, none."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([40, 21, 64, 3]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    _, cluster = run_cp(q, k, v, dout, sharding, mode="all_gather", chunk=chunk, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    mask = sees(sharding, True, chunk)
    rows = [sharding.global_index(r) for r in range(P)]
    read_by_others = []
    for s in range(P):
        others = torch.cat([rows[r] for r in range(P) if r != s])
        read_by_others.append(int(mask[others][:, rows[s]].any(0).sum()))
    m = max(read_by_others)
    for r in range(P):
        (fwd, _), _ = trace_split(cluster.trace, r)
        assert fwd == (P - 1) * m * ROW, (r, m)


@pytest.mark.parametrize("mode", ["p2p", "all_gather"])
@pytest.mark.parametrize("layout, lengths_, chunk", [
    ("contiguous", [32], 8),  # each rank's shard one chunk
    ("zigzag", [64], 8),  # each zigzag chunk (of 8) one chunk of positions
    ("balanced", [64, 16, 16, 32], 2),  # balanced cuts every document here at even positions
], ids=["contiguous", "zigzag", "balanced"])  # fmt: skip
def test_chunks_that_lie_whole_on_one_rank_move_nothing(mode, layout, lengths_, chunk):
    """Where the layout's cuts fall on chunk boundaries, no rank reads another's key: nothing is sent, and each rank
    makes one forward kernel call whose work is its chunks' causal triangles."""
    P = 4
    sharding = cpref.Sharding.eod_padded(cu_from_lengths(lengths_), cp_size=P, layout=layout)
    for r in range(P):
        for doc, s, e in sharding.local_chunks(r):
            assert (s - sharding.bounds.padded[doc]) % chunk == 0 and (e - s) % chunk == 0  # the premise
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    kernels = [CountingKernel() for _ in range(P)]
    _, cluster = run_cp(q, k, v, dout, sharding, mode=mode, chunk=chunk, kernels=kernels, check_ranks=False,
                        between=lambda comm: comm.barrier())  # fmt: skip
    mask = sees(sharding, True, chunk)
    for r in range(P):
        (fwd, _), (bwd, _) = trace_split(cluster.trace, r)
        assert fwd == bwd == 0, r
        assert sum(kind == "forward" for kind, *_ in kernels[r].calls) == 1, r
        idx = sharding.global_index(r)
        assert kernels[r].forward_work() == int(mask[idx][:, idx].sum()), r


@pytest.mark.parametrize("mode", ["p2p", "all_gather"])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
def test_every_kernel_call_computes_only_what_the_chunks_see(mode, layout):
    """The forward's work on each rank, summed over its calls, is the visible (query, key) pairs of its queries."""
    P, chunk = 4, 6
    sharding = cpref.Sharding.eod_padded(cu_from_lengths([40, 21, 64, 3]), cp_size=P, layout=layout)
    q, k, v, dout = attention_inputs(sharding.total, (4, 2, 8, 8))
    kernels = [CountingKernel() for _ in range(P)]
    run_cp(q, k, v, dout, sharding, mode=mode, chunk=chunk, kernels=kernels)
    mask = sees(sharding, True, chunk)
    for r in range(P):
        assert kernels[r].forward_work() == int(mask[sharding.global_index(r)].sum()), r


def test_all_gather_overlap_with_chunks_is_refused_on_every_rank_before_any_communication():
    sharding = cpref.Sharding(cu_from_lengths([16, 8]), cp_size=2)
    q, k, v, _ = attention_inputs(sharding.total, HEADS)
    cluster = SimCluster(2, timeout=30.0)

    def rank(comm):
        ql, kl, vl = (sharding.shard(t, comm.rank) for t in (q, k, v))
        with pytest.raises(CPInputError, match="overlap=True.*not chunk=4.*pass overlap=False"):
            cpref.attention(ql, kl, vl, sharding, comm=comm, mode="all_gather", chunk=4, overlap=True)

    cluster.run(rank)
    assert only_the_comparison(cluster.trace)

