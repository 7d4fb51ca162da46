"""Decode over a KV cache spread over the ranks (`cpref.infer`): every step equal to the FP64 oracle, every rank alike.

The reference of a decode step is the oracle's causal attention over the whole sequence so far, read at the step's
new rows: a rank that merged a partial output with the wrong weight, skipped a rank's share, saw a drafted token after
its own, kept a key the window no longer reaches or wrote a token to the wrong rank is off by far more than 1e-9.
"""

from __future__ import annotations

import pytest
import torch

from cpref.base.errors import CPInputError
from cpref.infer import CacheLayout, KVCache, decode_attention
from cpref.kernels import TorchKernel
from sim import SimCluster, oracle

EXACT = 1e-9  # FP64 against the FP64 oracle, relative to the output's scale (the bound)
PROMPTS = (5, 17, 30)  # three sequences of different lengths
LONGEST = 40  # tokens of the longest sequence a test grows (its prompt and every step)
# a layout for P ranks: interleaved by 1 (SGLang) and 4 (vLLM's blocks), contiguous just long enough
LAYOUTS = {"interleaved 1": lambda P: CacheLayout("interleaved", 1), "interleaved 4": lambda P: CacheLayout("interleaved", 4),
           "contiguous": lambda P: CacheLayout("contiguous", -(-LONGEST // P))}  # fmt: skip


def sequences(heads, steps: int, n: int, seed: int = 0):
    """Per sequence, q, k, v of the prompt and of every step's `n` new tokens, float64: `(T, H, D)` each."""
    Hq, Hkv, D, Dv = heads
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in PROMPTS:
        T = L + steps * n
        out.append(tuple(torch.randn(T, h, d, generator=g, dtype=torch.float64) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv))))
    return out


def run_steps(P, layout, heads, steps, n, *, window=None, sinks=None, softcap=None, max_tokens=None, scale=None):
    """Every rank: the prompts written to its cache, then `steps` decode steps of `n` tokens a sequence. Returns the
    ranks' `(outputs per step, cache)`."""
    seqs = sequences(heads, steps, n)
    Hq, Hkv, D, Dv = heads

    def rank_fn(comm):
        cache = KVCache(layout, rank=comm.rank, size=comm.size, heads=(Hkv, D, Dv), dtype=torch.float64, window=window,
                        max_tokens=max_tokens)  # fmt: skip
        for s, (L, (_, k, v)) in enumerate(zip(PROMPTS, seqs)):
            cache.append(s, k[:L], v[:L])  # the prompt, as prefill leaves it
            cache.evict(s)
        outs = []
        for t in range(steps):
            rows = [slice(L + t * n, L + (t + 1) * n) for L in PROMPTS]
            q, k, v = (torch.cat([x[i][r] for x, r in zip(seqs, rows)]) for i in range(3))
            outs.append(decode_attention(q, k, v, cache, comm, seqs=range(len(PROMPTS)), kernel=TorchKernel(),
                                         sinks=sinks, softcap=softcap, scale=scale))  # fmt: skip
        return outs, cache

    return seqs, SimCluster(P).run(rank_fn)


def expected(seqs, steps, n, *, window=None, sinks=None, softcap=None, scale=None):
    """The oracle's rows of every step: each sequence's causal attention over all its tokens, at the new positions."""
    per_step = [[] for _ in range(steps)]
    for L, (q, k, v) in zip(PROMPTS, seqs):
        w = (-1, -1) if window is None else (window, 0)
        out, _ = oracle.attention(q, k, v, torch.tensor([0, len(q)]), causal=True, window=w, sinks=sinks, softcap=softcap,
                                  scale=scale)  # fmt: skip
        for t in range(steps):
            per_step[t].append(out[L + t * n : L + (t + 1) * n])
    return [torch.cat(rows) for rows in per_step]


def assert_exact(got, want):
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= EXACT * scale


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 2, 8, 8), (4, 4, 8, 8), (4, 1, 8, 4)], ids=["gqa", "mha", "mqa-mla"])
def test_every_decode_step_is_the_oracle_on_every_rank(P, layout, heads):
    steps, n = 3, 1
    seqs, ranks = run_steps(P, LAYOUTS[layout](P), heads, steps, n)
    want = expected(seqs, steps, n)
    for outs, _ in ranks:
        for t in range(steps):
            assert_exact(outs[t], want[t])
            assert torch.equal(outs[t], ranks[0][0][t])  # the same bits on every rank: the merge runs in rank order


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("n", [2, 4])
def test_drafted_tokens_see_each_other_causally(P, n):
    """Speculative decoding: n new tokens a sequence, each sees the cache and the drafted tokens up to itself."""
    seqs, ranks = run_steps(P, LAYOUTS["interleaved 1"](P), (4, 2, 8, 8), 2, n)
    want = expected(seqs, 2, n)
    for outs, _ in ranks:
        for t in range(2):
            assert_exact(outs[t], want[t])


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 3, 9])
@pytest.mark.parametrize("layout", ["interleaved 1", "contiguous"])
def test_a_window_sees_what_it_should_and_the_cache_keeps_only_that(P, window, layout):
    steps, n = 3, 2
    seqs, ranks = run_steps(P, LAYOUTS[layout](P), (4, 2, 8, 8), steps, n, window=window)
    want = expected(seqs, steps, n, window=window)
    for rank, (outs, cache) in enumerate(ranks):
        for t in range(steps):
            assert_exact(outs[t], want[t])
        for s, L in enumerate(PROMPTS):
            _, _, pos = cache.rows(s)
            length = L + steps * n
            assert cache.length(s) == length
            # kept: exactly this rank's positions a later query (at `length` or after) can still see
            kept = [t for t in range(max(0, length - window), length) if cache.layout.owner(torch.tensor(t), P) == rank]
            assert pos.tolist() == kept


@pytest.mark.parametrize("P", [2, 4])
def test_sinks_softcap_and_a_scale_are_the_oracle(P):
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    seqs, ranks = run_steps(P, LAYOUTS["interleaved 1"](P), (4, 2, 8, 8), 2, 1, sinks=sinks, softcap=3.0, scale=0.9)
    want = expected(seqs, 2, 1, sinks=sinks, softcap=3.0, scale=0.9)
    for outs, _ in ranks:
        for t in range(2):
            assert_exact(outs[t], want[t])


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_holds_its_share_of_the_cache_and_no_rank_the_whole(P, layout):
    """Interleaved by 1: rank r holds the positions t = r mod P, T / P of T rounded; its memory T / P Hkv (D + Dv)
    elements. Every layout: the ranks' rows add up to the cache, each row on the rank the layout names."""
    heads, steps = (4, 2, 8, 4), 2
    seqs, ranks = run_steps(P, LAYOUTS[layout](P), heads, steps, 1)
    Hkv, D, Dv = 2, 8, 4
    total = sum(L + steps for L in PROMPTS)
    assert sum(cache.tokens() for _, cache in ranks) == total
    for rank, (_, cache) in enumerate(ranks):
        assert cache.nbytes() == cache.tokens() * Hkv * (D + Dv) * 8
        for s in range(len(PROMPTS)):
            _, _, pos = cache.rows(s)
            assert bool((cache.layout.owner(pos, P) == rank).all())
        if layout == "interleaved 1":
            assert cache.tokens() == sum(len(range(rank, L + steps, P)) for L in PROMPTS)
    assert max(cache.tokens() for _, cache in ranks) < total


def test_a_token_lands_on_the_rank_its_layout_names():
    layout = CacheLayout("interleaved", 2)
    assert layout.owner(torch.arange(10), 3).tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1]
    contiguous = CacheLayout("contiguous", 4)
    assert contiguous.owner(torch.arange(9), 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert contiguous.longest(2) == 8 and layout.longest(3) is None


# -- bad input: refused on every rank alike, before anything moves ------------------------------------------------


def one_step(P, *, cache_kwargs=None, tweak=None, seqs=(0,), **step):
    """A cache holding sequence 0 (8 tokens) on every rank, then one decode step; `tweak(rank, args)` changes a
    rank's arguments."""
    g = torch.Generator().manual_seed(1)
    k0, v0 = torch.randn(8, 2, 8, generator=g, dtype=torch.float64), torch.randn(8, 2, 8, generator=g, dtype=torch.float64)
    q, k, v = (torch.randn(len(seqs), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))

    def rank_fn(comm):
        kwargs = {"layout": CacheLayout(), **(cache_kwargs or {})}
        cache = KVCache(rank=comm.rank, size=comm.size, heads=(2, 8, 8), dtype=torch.float64, **kwargs)
        cache.append(0, k0, v0)
        args = {"q": q, "k": k, "v": v, "seqs": list(seqs)}
        if tweak is not None:
            tweak(comm.rank, args, cache)
        out = decode_attention(args["q"], args["k"], args["v"], cache, comm, seqs=args["seqs"],
                               **{"kernel": TorchKernel(), **step})  # fmt: skip
        return out, cache

    return SimCluster(P).run(rank_fn)


def test_a_sequence_the_cache_does_not_hold_is_refused_on_every_rank():
    with pytest.raises(CPInputError, match=r"sequences \[5\] are not in the cache: prefill their prompt first"):
        one_step(2, seqs=(5,))


def test_one_rank_with_a_wrong_shape_makes_every_rank_raise_its_message():
    def tweak(rank, args, cache):
        if rank == 1:
            args["k"] = args["k"][:, :1]

    with pytest.raises(CPInputError, match=r"k and v must be \(1, 2, 8\)"):
        one_step(3, tweak=tweak)


def test_ranks_a_token_apart_are_refused_not_silently_wrong():
    def tweak(rank, args, cache):
        if rank == 0:  # this rank's cache has one more token of the sequence than the others'
            cache.append(0, args["k"], args["v"])

    with pytest.raises(CPInputError, match=r"decode_attention: the ranks pass different values.*lengths"):
        one_step(2, tweak=tweak)


def test_a_cache_that_would_overflow_is_refused_before_anything_moves():
    with pytest.raises(CPInputError, match=r"rank 0 would hold 5 cached tokens, over its max_tokens = 4"):
        one_step(2, cache_kwargs={"max_tokens": 4})
    with pytest.raises(CPInputError, match=r"more than the contiguous cache's P x C = 2 x 4 = 8.*C >= 5"):
        one_step(2, cache_kwargs={"layout": CacheLayout("contiguous", 4)})


def test_a_cache_built_for_another_layout_or_rank_is_refused():
    with pytest.raises(CPInputError, match="CacheLayout kind 'zigzag' is not one of"):
        CacheLayout("zigzag", 1)
    with pytest.raises(CPInputError, match="size must be an int >= 1"):
        CacheLayout("interleaved", 0)

    def tweak(rank, args, cache):
        cache.layout = CacheLayout("interleaved", 2 if rank else 1)

    with pytest.raises(CPInputError, match=r"the ranks pass different values.*layout"):
        one_step(2, tweak=tweak)


@pytest.mark.parametrize("logits", [1, 30, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_low_precision_decode_is_within_twice_the_error_without_cp(dtype, P, logits):
    """The merge runs in float32 and the output is rounded once: a rank count costs no more than the rounding of one
    device's step, by the house's `vs P=1` criterion (`precision_ratio` <= `RATIO_LIMIT`, the worst over three
    batches, every step's rows, queries scaled so that the logits are x1, x30 and x1000). Rounding the
    lse to the input dtype before the merge fails it (x1000, bf16)."""
    from sim.tools.verify.table import RATIO_LIMIT
    from sim.tools.verify.truth import precision_ratio

    heads, steps = (4, 2, 8, 8), 2

    def outputs(P, rounded):
        def rank_fn(comm):
            cache = KVCache(CacheLayout(), rank=comm.rank, size=comm.size, heads=(2, 8, 8), dtype=dtype)
            for s, (L, (_, k, v)) in enumerate(zip(PROMPTS, rounded)):
                cache.append(s, k[:L].to(dtype), v[:L].to(dtype))
            outs = []
            for t in range(steps):
                q, k, v = (torch.cat([x[i][L + t : L + t + 1] for x, L in zip(rounded, PROMPTS)]).to(dtype)
                           for i in range(3))  # fmt: skip
                outs.append(decode_attention(q, k, v, cache, comm, seqs=range(len(PROMPTS)), kernel=TorchKernel()))
            return torch.cat(outs)

        return SimCluster(P).run(rank_fn)[0]

    got, alone, truth = [], [], []
    for seed in range(3):
        # the values every dtype holds exactly
        scaled = [(q * logits, k, v) for q, k, v in sequences(heads, steps, 1, seed=seed)]
        rounded = [tuple(x.to(dtype).double() for x in s) for s in scaled]
        got.append(outputs(P, rounded))
        alone.append(outputs(1, rounded))
        truth.append(torch.cat(expected(rounded, steps, 1)))
    assert precision_ratio(got, alone, truth, dtype) <= RATIO_LIMIT


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_step_moves_one_all_gather_of_the_partial_outputs(P, dtype):
    """Counted from the simulated cluster's trace: besides the check's host exchanges, one all-gather of
    `(N, Hq, Dv + 1)` in the compute dtype (float32 for bf16), `(P - 1) N Hq (Dv + 1)` elements sent per rank."""
    N, Hq, Hkv, D, Dv = 3, 4, 2, 8, 4
    g = torch.Generator().manual_seed(2)
    prompt = [torch.randn(12, Hkv, d, generator=g, dtype=torch.float64).to(dtype) for d in (D, Dv)]
    q, k, v = (torch.randn(N, h, d, generator=g, dtype=torch.float64).to(dtype) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
    cluster = SimCluster(P)

    def rank_fn(comm):
        cache = KVCache(CacheLayout(), rank=comm.rank, size=comm.size, heads=(Hkv, D, Dv), dtype=dtype)
        for s in range(N):
            cache.append(s, *prompt)
        comm.barrier()
        return decode_attention(q, k, v, cache, comm, seqs=range(N), kernel=TorchKernel())

    cluster.run(rank_fn)
    events = [e for e in cluster.trace if e.param != "host"]
    step = events[[e.op for e in events].index("barrier") + 1 :]
    wide = 8 if dtype == torch.float64 else 4
    assert [(e.op, tuple(e.shape)) for e in step] == [("all_gather", (N, Hq, Dv + 1))]
    assert step[0].bytes_sent[0] == (P - 1) * N * Hq * (Dv + 1) * wide


def test_softcap_with_a_kernel_that_cannot_is_refused_on_every_rank():
    class Plain:  # a kernel of the contract that lists no variants
        def forward(self, *args, **kwargs):
            return TorchKernel().forward(*args, **kwargs)

    with pytest.raises(CPInputError, match="softcap needs a kernel that lists it in its variants; Plain does not"):
        one_step(2, kernel=Plain(), softcap=5.0)
