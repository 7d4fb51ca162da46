"""Prefill (`cpref.infer.prefill`): a packed prompt sharded as for training, attended forward only by every mode in
every layout, its keys and values moved into the cache layout; then decode over that cache equals the oracle.

A prompt row sent to the wrong rank, a padding row written, a document's rows out of order, or a forward that kept
tensors for a backward each fail here.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.infer import CacheLayout, KVCache, decode_attention, prefill_attention
from cpref.kernels import TorchKernel
from sim import SimCluster, oracle

EXACT = 1e-9
DOCS = (5, 17, 30)  # a packed prompt of three documents (sequences 0, 1, 2)
HEADS = (4, 2, 8, 4)  # GQA with Dv < D
STEPS = 2


def data(seed: int = 0):
    """Per document: q, k, v of its prompt and of its `STEPS` decoded tokens, float64."""
    Hq, Hkv, D, Dv = HEADS
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(L + STEPS, h, d, generator=g, dtype=torch.float64) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
            for L in DOCS]  # fmt: skip


def stream(docs, padded):
    """The docs' prompt rows laid in the padded stream (zeros in the padding): q, k, v `(T, H, D)`."""
    out = []
    for i in range(3):
        parts = []
        for (a, b), x in zip(zip(padded, padded[1:]), (d[i] for d in docs)):
            L = DOCS[len(parts)]
            parts.append(torch.cat([x[:L], x.new_zeros(b - a - L, *x.shape[1:])]))
        out.append(torch.cat(parts))
    return out


def run(P, layout, mode, cache_layout, window=None):
    docs = data()
    cu = [0]
    for L in DOCS:
        cu.append(cu[-1] + L)
    sharding = cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout)
    q, k, v = stream(docs, sharding.cu_seqlens_padded)
    Hq, Hkv, D, Dv = HEADS
    options = cpref.MODES[mode].example_options(P)

    def rank_fn(comm):
        cache = KVCache(cache_layout, rank=comm.rank, size=comm.size, heads=(Hkv, D, Dv), dtype=torch.float64,
                        window=window)  # fmt: skip
        # the prompt as a model's layer gives it, requiring grad: prefill keeps nothing for a backward all the same
        shard = [sharding.shard(x, comm.rank).requires_grad_() for x in (q, k, v)]
        out = prefill_attention(*shard, sharding, cache, comm, seqs=[0, 1, 2], mode=mode, kernel=TorchKernel(),
                                **options)  # fmt: skip
        steps = []
        for t in range(STEPS):
            new = [torch.cat([d[i][L + t : L + t + 1] for d, L in zip(docs, DOCS)]) for i in range(3)]
            steps.append(decode_attention(*new, cache, comm, seqs=[0, 1, 2], kernel=TorchKernel()))
        return out, steps, cache

    return docs, sharding, SimCluster(P).run(rank_fn)


def check(docs, sharding, ranks, window=None):
    w = (-1, -1) if window is None else (window, 0)
    want = [oracle.attention(q, k, v, torch.tensor([0, len(q)]), causal=True, window=w)[0] for q, k, v in docs]
    scale = max(x.abs().max().item() for x in want)
    real = torch.tensor(sharding.cu_seqlens)
    padded = torch.tensor(sharding.cu_seqlens_padded)
    for rank, (out, steps, cache) in enumerate(ranks):
        assert out.grad_fn is None and not out.requires_grad  # forward only: nothing kept for a backward
        assert all(not x.requires_grad for s in cache.sequences.values() for x in (s.k, s.v))  # values, no history
        idx = sharding.global_index(rank)
        doc = torch.searchsorted(padded, idx, right=True) - 1
        pos = idx - padded[doc]
        for row, (i, p) in enumerate(zip(doc.tolist(), pos.tolist())):
            if p < real[i + 1] - real[i]:  # padding rows are no token's
                assert (out[row] - want[i][p]).abs().max().item() <= EXACT * scale
        for t, got in enumerate(steps):
            expect = torch.cat([want[i][L + t : L + t + 1] for i, L in enumerate(DOCS)])
            assert (got - expect).abs().max().item() <= EXACT * scale


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("mode", list(cpref.MODES))
def test_prefill_in_every_mode_and_layout_then_decode_is_the_oracle(P, layout, mode):
    if mode == "a2a" and P > HEADS[0]:
        pytest.skip("a2a needs P to divide the heads")
    docs, sharding, ranks = run(P, layout, mode, CacheLayout("interleaved", 1))
    check(docs, sharding, ranks)


@pytest.mark.parametrize("cache_layout", [CacheLayout("interleaved", 3), CacheLayout("contiguous", 16)],
                         ids=["interleaved 3", "contiguous 16"])  # fmt: skip
@pytest.mark.parametrize("layout", ["zigzag", "stream"])
def test_any_cache_layout_takes_the_prompt_from_any_training_layout(cache_layout, layout):
    docs, sharding, ranks = run(4, layout, "p2p", cache_layout)
    check(docs, sharding, ranks)
    for rank, (_, _, cache) in enumerate(ranks):
        for s, L in enumerate(DOCS):
            _, _, pos = cache.rows(s)
            mine = [t for t in range(L + STEPS) if int(cache_layout.owner(torch.tensor(t), 4)) == rank]
            assert pos.tolist() == mine  # exactly its tokens, in order, no padding


@pytest.mark.parametrize("P", [2, 4])
def test_each_rank_holds_t_over_p_of_the_prompt(P):
    """Interleaved by 1, a rank holds ceil or floor of L / P of each document: T / P Hkv (D + Dv) elements in all,
    counted; no rank holds the whole cache."""
    _, _, ranks = run(P, "zigzag", "all_gather", CacheLayout("interleaved", 1))
    Hq, Hkv, D, Dv = HEADS
    for rank, (_, _, cache) in enumerate(ranks):
        assert cache.tokens() == sum(len(range(rank, L + STEPS, P)) for L in DOCS)
        assert cache.nbytes() == cache.tokens() * Hkv * (D + Dv) * 8
        assert cache.tokens() < sum(DOCS)


@pytest.mark.parametrize("window", [2, 7])
def test_a_windowed_prefill_keeps_only_what_decode_can_see(window):
    docs, sharding, ranks = run(4, "zigzag", "p2p", CacheLayout("interleaved", 1), window=window)
    check(docs, sharding, ranks, window=window)
    for _, _, cache in ranks:
        for s, L in enumerate(DOCS):
            _, _, pos = cache.rows(s)
            assert all(p >= L + STEPS - window for p in pos.tolist())


def test_a_prompt_written_twice_is_refused_on_every_rank():
    sharding = cpref.Sharding([0, 8], cp_size=2, layout="zigzag")

    def rank_fn(comm):
        cache = KVCache(CacheLayout(), rank=comm.rank, size=2, heads=(2, 8, 8), dtype=torch.float64)
        k = torch.zeros(4, 2, 8, dtype=torch.float64)
        from cpref.infer import write_prompt

        write_prompt(k, k, sharding, cache, comm, seqs=[0])
        write_prompt(k, k, sharding, cache, comm, seqs=[0])

    with pytest.raises(CPInputError, match=r"sequences \[0\] are already in the cache"):
        SimCluster(2).run(rank_fn)
