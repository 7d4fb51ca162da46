"""A fuzz over the public API's argument space: every call gives its right result, or a `CPInputError`.

**Attention.** Each example draws a CP size, mode, layout, batch (documents of 1 to 20 tokens, padded by
`eod_padded`), head counts and head dim, `causal`, a window, a softmax scale and the mode's options, from ranges
that hold valid and invalid values alike (heads a mode cannot split, a window a mode does not take, a scale of 0,
`inf` or a string, an `a2a_size` that does not divide `P`), learnable sinks or none, and then perhaps one rank's own
mistake (a shard a token short, another dtype, keys of another head dim) or a difference from its peers that each
rank's own validation cannot see: its grad mode (the call under `torch.no_grad()`, or no input requiring grad,
while the others train) or its sinks' values (issue 56). Run on the simulated cluster, every rank returns its output
or its exception. Each example has exactly one of two outcomes: every rank raises a `CPInputError` (a rank whose
own input failed raises its own, the others a `PeerInputError` naming it), or every rank's output and gradients
(the sinks' summed over the ranks) equal the FP64 oracle's within float64's tolerance. Any other exception, a hang (which the cluster reports as a
timeout), or a wrong number fails it.

**The rest of the API**, each against what `tests/cpref/by_hand.py` computes from the documented rules:
`Sharding` and `eod_padded` (boundaries as lists, tuples, tensors or flawed; CP sizes and layouts valid or not),
`pad` (every dtype, values it holds or not), `shard`, `unshard`, `unpad`, `positions`, with one misuse at times;
`get_batch_on_this_cp_rank` (ranks, `pad_token_id`s, token dtypes); `cp_loss` over 1 to 3 ranks (counts given
or not, right or wrong, a rank's own mistake; NaN and inf losses on masked tokens); `bshd_to_thd` and
`thd_to_bshd`; `Varlen` (flawed or not) through `TorchKernel` against the masked softmax written out. A valid
call must not be refused, and an invalid one must be: the test says which it is before the call.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cpref
from sim import SimCluster, oracle
from tests.cpref.by_hand import (
    dense_reference,
    eod_bounds,
    expected_index,
    fits,
    outcome,
    pad_by_hand,
    positions_by_hand,  # fmt: skip
    same,
)
from tests.helpers import TOL

MODES = sorted(cpref.MODES)


@st.composite
def calls(draw):
    P = draw(st.sampled_from([1, 2, 3, 4]))
    mode = draw(st.sampled_from(MODES))
    lengths = draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))
    hq, hkv = draw(st.sampled_from([(4, 2), (4, 4), (4, 1), (2, 2), (8, 2), (6, 3), (4, 3), (3, 3)]))
    d = draw(st.sampled_from([4, 8]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1)] * 4 + [(3, 0), (0, 0), (2, 2), (-2, 0)]))
    scale = draw(st.sampled_from([None, 0.3, 1.7] * 4 + [0.0, -1.0, float("inf"), float("nan"), "0.5"]))
    options = dict(cpref.MODES[mode].example_options(P))
    if "a2a_size" in options:
        options["a2a_size"] = draw(st.sampled_from([options["a2a_size"], 1, 2, 3, P]))
    fault = draw(st.sampled_from([None] * 9 + ["short", "dtype", "head dim", "no_grad", "no requires_grad", "sinks values"]))
    if P == 1 and fault in PEER_FAULTS:  # a group of one has no peer to differ from
        fault = None
    sinks = fault == "sinks values" or draw(st.booleans())
    return dict(P=P, mode=mode, layout=draw(st.sampled_from(cpref.LAYOUTS)), lengths=lengths, heads=(hq, hkv), d=d,
                causal=causal, window=window, scale=scale, options=options, fault=fault, sinks=sinks)  # fmt: skip


PEER_FAULTS = ("no_grad", "no requires_grad", "sinks values")  # valid on the rank alone, different from its peers


def run(c: dict):
    """Every rank's `(out, dq, dk, dv)` of the call, or the exception it raised; and the oracle's shards."""
    cu = torch.tensor([0, *torch.tensor(c["lengths"]).cumsum(0).tolist()])
    sharding = cpref.Sharding.eod_padded(cu, cp_size=c["P"], layout=c["layout"])
    (hq, hkv), d, T = c["heads"], c["d"], int(cu[-1])
    g = torch.Generator().manual_seed(sum(c["lengths"]))
    q, k, v, dout = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    sinks = torch.linspace(-1.0, 2.0, hq, dtype=torch.float64) if c["sinks"] else None

    def rank(comm):
        local = [sharding.shard(sharding.pad(t), comm.rank) for t in (q, k, v, dout)]
        fault = c["fault"] if comm.rank == c["P"] - 1 else None  # the last rank's own mistake or difference
        if fault in ("short", "dtype", "head dim"):
            i, bad = {"short": (0, lambda t: t[:-1]), "dtype": (1, lambda t: t.float()),
                      "head dim": (1, lambda t: t[..., :-1])}[fault]  # fmt: skip
            local[i] = bad(local[i])
        trains = fault != "no requires_grad"
        q_r, k_r, v_r = (t.clone().requires_grad_(trains) for t in local[:3])
        s_r = None if sinks is None else torch.nn.Parameter(sinks + 2.0**-20 * (fault == "sinks values"), requires_grad=trains)
        try:
            with torch.no_grad() if fault == "no_grad" else contextlib.nullcontext():
                out = cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode=c["mode"], causal=c["causal"],
                                      window=c["window"], softmax_scale=c["scale"], sinks=s_r, **c["options"])  # fmt: skip
            out.backward(local[3])
        except cpref.CPInputError as err:
            return err
        return out.detach(), q_r.grad, k_r.grad, v_r.grad, None if s_r is None else s_r.grad

    results = SimCluster(c["P"], timeout=20.0).run(rank)
    return results, sharding, (q, k, v, dout, cu, sinks)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_every_call_gives_the_oracles_result_or_a_cpinputerror_on_every_rank(c):
    results, sharding, (q, k, v, dout, cu, sinks) = run(c)
    raised = [isinstance(r, cpref.CPInputError) for r in results]
    event("refused" if any(raised) else "computed")
    if any(raised):
        assert all(raised), f"some ranks raised, others returned: {results}"
        own = [r for r in results if not isinstance(r, cpref.base.errors.PeerInputError)]
        assert own, "every rank blames another"
        return
    assert c["fault"] is None, f"rank {c['P'] - 1}'s {c['fault']} shard was accepted"
    scale = c["scale"]
    out, _, dq, dk, dv, *dsinks = oracle.forward_backward(q, k, v, cu, dout, causal=c["causal"], scale=scale,
                                                          window=c["window"], sinks=sinks)  # fmt: skip
    for name, want, i in (("out", out, 0), ("dq", dq, 1), ("dk", dk, 2), ("dv", dv, 3)):
        got = sharding.unpad(sharding.unshard([r[i] for r in results]))
        torch.testing.assert_close(got, want, atol=TOL[torch.float64], rtol=TOL[torch.float64], msg=lambda m, name=name: f"{name}: {m}")
    if sinks is not None:  # each rank's share, summed over the group as a replicated parameter's gradient is
        got = sum(r[4] for r in results)
        torch.testing.assert_close(got, dsinks[0], atol=TOL[torch.float64], rtol=TOL[torch.float64])


def test_the_fuzz_reaches_both_outcomes():
    """The argument space is wide enough that both outcomes occur (a fuzz that only ever raised would pass vacuously)."""
    seen = set()
    valid = dict(P=2, mode="p2p", layout="zigzag", lengths=[5, 9], heads=(4, 2), d=8, causal=True, window=(-1, -1),
                 scale=None, options={}, fault=None, sinks=False)  # fmt: skip
    for change in ({}, {"scale": 0.0}, {"fault": "short"}, {"heads": (4, 3)}):
        results, _, _ = run({**valid, **change})
        seen.add(all(isinstance(r, cpref.CPInputError) for r in results))
    assert seen == {True, False}


@pytest.mark.parametrize("fault", PEER_FAULTS)
@pytest.mark.parametrize("mode", MODES)
def test_the_fuzz_s_differences_between_ranks_are_refused_on_every_rank_and_their_twins_computed(mode, fault):
    """The classes of issue 56 in every mode at P = 3, each against its twin without the difference: refused on
    every rank by the ranks' comparison (no rank blames another), and computed (sinks given) without it."""
    call = dict(P=3, mode=mode, layout="zigzag", lengths=[7, 12], heads=(6, 3), d=4, causal=True, window=(-1, -1),
                scale=None, options=cpref.MODES[mode].example_options(3), fault=fault, sinks=True)  # fmt: skip
    results, _, _ = run(call)
    assert all(type(r) is cpref.CPInputError and "pass different arguments" in str(r) for r in results), results
    results, _, _ = run({**call, "fault": None})
    assert not any(isinstance(r, Exception) for r in results) and all(r[4] is not None for r in results), results


# ---- the rest of the public API: each call's right result (computed here, independently) or a CPInputError ----------
FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLAWS = ["float list", "bool tensor", "2-D tensor", "None", "str", "nested", "no leading 0", "empty doc", "decreasing"]


def flawed(draw, cu: list[int]):
    """`cu` as a list, a tensor of int32 or int64, or with one flaw; `(value, clean)`."""
    flaw = draw(st.sampled_from([None] * 12 + FLAWS))
    if flaw is None:
        return draw(st.sampled_from([list, tuple, torch.tensor, lambda c: torch.tensor(c, dtype=torch.int32)]))(cu), True
    bad = {"float list": lambda: [float(x) for x in cu], "bool tensor": lambda: torch.tensor(cu) > 0,
           "2-D tensor": lambda: torch.tensor([cu]), "None": lambda: None, "str": lambda: ",".join(map(str, cu)),
           "nested": lambda: [cu], "no leading 0": lambda: [1, *cu[1:]], "empty doc": lambda: [*cu, cu[-1]],
           "decreasing": lambda: [*cu, cu[-1] - 1]}[flaw]  # fmt: skip
    return bad(), False


VALUES = [0, -1, 7, 300, 2**63, -(2**63), 2**70, 2.0, 0.5, 1e6, 1e39, 1e300, float("inf"), float("nan"), None, "0", True,
          np.int64(3), np.float32(0.5), 1 + 2j]  # fmt: skip
DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int8, torch.uint8, torch.bool]


@st.composite
def shardings(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu_arg, clean = flawed(draw, cu)
    P = draw(st.sampled_from([1, 2, 3, 4] * 3 + [np.int64(2), 0, -1, 2.0, "2", True, None]))
    layout = draw(st.sampled_from(list(cpref.LAYOUTS) * 3 + ["diagonal", None]))
    build = draw(st.sampled_from(["eod_padded", "eod_padded", "unpadded", "given", "given short"]))
    clean = clean and type(P) in (int, np.int64) and P >= 1 and layout in cpref.LAYOUTS  # NumPy's ints are ints
    return dict(lengths=lengths, cu=cu, cu_arg=cu_arg, clean=clean, P=P, layout=layout, build=build,
                dtype=draw(st.sampled_from(DTYPES)), value=draw(st.sampled_from(VALUES)),
                fault=draw(st.sampled_from([None] * 6 + ["pad length", "unpad real", "shard length", "unshard short",
                                                         "rank", "positions rank"])))  # fmt: skip


def build(c):
    P, layout = c["P"], c["layout"]
    if c["build"] == "eod_padded":
        return cpref.Sharding.eod_padded(c["cu_arg"], cp_size=P, layout=layout), eod_bounds(c["lengths"], P, layout)
    padded = eod_bounds(c["lengths"], P, layout) if c["clean"] else c["cu"]
    if c["build"] == "given short":
        padded = [*padded[:-1], padded[-1] - 1]
    given = None if c["build"] == "unpadded" else padded
    return cpref.Sharding(c["cu_arg"], cp_size=P, layout=layout, cu_seqlens_padded=given), given or c["cu"]


@FAST
@given(shardings())
def test_sharding_pad_shard_unshard_unpad_positions_give_their_right_results_or_a_cpinputerror(c):
    made = outcome(lambda: build(c))
    if isinstance(made, cpref.CPInputError):
        padded = eod_bounds(c["lengths"], c["P"], c["layout"]) if c["clean"] else None  # clean: P and layout valid
        divisible = padded is not None and c["build"] != "given short" and (c["build"] != "unpadded" or padded == c["cu"])
        assert not divisible, f"a valid sharding was refused: {made}"
        return
    s, padded = made
    assert c["clean"] and s.cu_seqlens == tuple(c["cu"]) and s.cu_seqlens_padded == tuple(padded)
    P, layout, T, real = int(c["P"]), c["layout"], padded[-1], c["cu"]
    event(f"built {layout}")
    index = [s.global_index(r).tolist() for r in range(P)]
    assert sorted(sum(index, [])) == list(range(T)) and {len(i) for i in index} == {T // P}
    for r in range(P):
        assert expected_index(padded, P, layout, r) in (None, index[r])
        assert s.positions(r).tolist() == positions_by_hand(padded, index[r])
    x = (torch.arange(real[-1] * 2).reshape(-1, 2) % 5).to(c["dtype"])  # (T_real, 2)
    got = outcome(lambda: s.pad(x[: -1 if c["fault"] == "pad length" else None], value=c["value"]))
    if isinstance(got, cpref.CPInputError):
        assert c["fault"] == "pad length" or not fits(c["value"], c["dtype"]), got
        return
    assert c["fault"] != "pad length" and fits(c["value"], c["dtype"])
    want = pad_by_hand(x, real, padded, c["value"])
    same(got, want)
    shards = [s.shard(got, r) for r in range(P)]
    for sh, i in zip(shards, index):
        same(sh, got[i])
    faulty = {"unpad real": lambda: s.unpad(x), "shard length": lambda: s.shard(got[1:], 0),
              "unshard short": lambda: s.unshard(shards[:-1]), "rank": lambda: s.shard(got, P),
              "positions rank": lambda: s.positions(-1)}.get(c["fault"])  # fmt: skip
    if faulty is not None:
        result = outcome(faulty)
        legal = c["fault"] == "unpad real" and T == real[-1]  # without padding the real stream is the padded one
        assert isinstance(result, cpref.CPInputError) != legal, (c["fault"], result)
    same(s.unshard(shards), got)
    same(s.unpad(got), x)


@FAST
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=3), P=st.sampled_from([1, 2, 3, 4, 0, 2.0]),
       layout=st.sampled_from(cpref.LAYOUTS), rank=st.sampled_from([0, 1, 2, -1, 4, np.int64(1), 1.0]),
       pad=st.sampled_from([0, 5, -1, 255, 256, 2**70, 3.0, True, "0", None]),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]), masked=st.booleans())  # fmt: skip
def test_get_batch_on_this_cp_rank_gives_the_padded_shard_or_a_cpinputerror(lengths, P, layout, rank, pad, dtype, masked):
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    T_real = cu[-1]
    tokens = (torch.arange(T_real) * 7 % 200).to(dtype)
    batch = {"tokens": tokens, "labels": tokens.long(), "extra": torch.ones(T_real, 3)}
    if masked:
        batch["loss_mask"] = (torch.arange(T_real) % 3 != 0).float()
    got = outcome(lambda: cpref.get_batch_on_this_cp_rank(batch, cu, cp_size=P, rank=rank, layout=layout,
                                                          pad_token_id=pad))  # fmt: skip
    valid = type(P) is int and P >= 1 and type(rank) in (int, np.int64) and 0 <= rank < P and type(pad) is int and fits(pad, dtype)
    assert isinstance(got, cpref.CPInputError) != valid, (valid, got)
    if not valid:
        return
    padded = eod_bounds(lengths, P, layout)
    assert got["sharding"] == cpref.Sharding(cu, cp_size=P, layout=layout, cu_seqlens_padded=padded)
    index = got["sharding"].global_index(rank)
    assert expected_index(padded, P, layout, rank) in (None, index.tolist())
    mask = batch.get("loss_mask", torch.ones(T_real))
    for name, x, fill in (("tokens", tokens, pad), ("labels", batch["labels"], pad), ("loss_mask", mask, 0),
                          ("extra", batch["extra"], 0)):  # fmt: skip
        same(got[name], pad_by_hand(x, cu, padded, fill)[index])
    assert got["position_ids"].tolist() == positions_by_hand(padded, index.tolist())


@FAST
@given(P=st.sampled_from([1, 2, 3]), sizes=st.lists(st.integers(0, 5), min_size=3, max_size=3),
       count=st.sampled_from([None] * 4 + ["exact", "twice", "short", 0, float("inf"), float("nan"), "3", True,
                                           "tensor", "2 elements", "numpy"]),
       fault=st.sampled_from([None] * 6 + ["int loss", "shape", "count differs"]), seed=st.integers(0, 3))  # fmt: skip
def test_cp_loss_gives_the_global_masked_mean_or_a_cpinputerror_on_every_rank(P, sizes, count, fault, seed):
    g = torch.Generator().manual_seed(seed)
    losses = [torch.rand(n, generator=g, dtype=torch.float64) for n in sizes[:P]]
    masks = [torch.tensor([(0.0, 1.0, 0.5)[(i + r) % 3] for i in range(n)]) for r, n in enumerate(sizes[:P])]
    for loss, mask in zip(losses, masks):  # a masked token's loss of NaN or inf takes no part
        loss[mask == 0] = torch.tensor([math.nan, math.inf]).double().repeat(len(loss))[: int((mask == 0).sum())]
    total = float(sum(m.sum() for m in masks))
    given_count = {"exact": total, "twice": 2 * total, "short": total - 1, "tensor": torch.tensor(total),
                   "2 elements": torch.ones(2), "numpy": np.int64(math.ceil(total))}.get(count, count)  # fmt: skip

    def rank(comm):
        loss, mask, n = losses[comm.rank], masks[comm.rank], given_count
        if comm.rank == P - 1 and fault is not None:
            loss, mask, n = {"int loss": (loss.long(), mask, n), "shape": (loss, mask[:-1] if len(mask) else
                             torch.ones(1), n), "count differs": (loss, mask, total + 0.25)}[fault]  # fmt: skip
        return outcome(lambda: cpref.cp_loss(loss, mask, comm, count=n))

    results = SimCluster(P, timeout=20.0).run(rank)
    if fault == "count differs" and P == 1:
        given_count = total + 0.25  # the only rank's count
    valid_count = given_count is None or (
        not isinstance(given_count, (bool, str)) and (not isinstance(given_count, torch.Tensor) or given_count.numel() == 1)
        and float(given_count) == float(given_count) and total <= float(given_count) < float("inf"))  # fmt: skip
    valid = valid_count and (fault is None or (fault == "count differs" and P == 1))
    assert {isinstance(r, cpref.CPInputError) for r in results} == {not valid}, (valid, results)
    if valid:
        denominator = max(float(total if given_count is None else given_count), 1.0)
        want = sum(float((loss[m != 0] * m[m != 0]).sum()) for loss, m in zip(losses, masks)) / denominator
        assert sum(float(r) for r in results) == pytest.approx(want, rel=1e-12, abs=1e-15)


@FAST
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=4), docs=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       short=st.booleans())  # fmt: skip
def test_bshd_to_thd_and_back_or_a_cpinputerror(shape, docs, short):
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    got = outcome(lambda: cpref.bshd_to_thd(x))
    valid = len(shape) >= 2 and shape[0] >= 1 and shape[1] >= 1
    assert isinstance(got, cpref.CPInputError) != valid, (shape, got)
    if valid:
        thd, cu = got
        B, S = shape[:2]
        same(thd, x.reshape(B * S, *shape[2:]))
        assert cu.tolist() == [S * b for b in range(B + 1)]
        same(cpref.thd_to_bshd(thd, cu), x)
    cu = [0, *torch.tensor(docs).cumsum(0).tolist()]
    y = torch.arange(cu[-1] - short, dtype=torch.float64)
    back = outcome(lambda: cpref.thd_to_bshd(y, cu))
    valid = len(set(docs)) == 1 and not short
    assert isinstance(back, cpref.CPInputError) != valid, (docs, short, back)
    if valid:
        same(back, y.reshape(len(docs), docs[0]))


@FAST
@given(q_lens=st.lists(st.integers(0, 5), min_size=1, max_size=3), kv_lens=st.lists(st.integers(0, 6), min_size=1, max_size=3),
       flaw=st.sampled_from([None] * 8 + ["str", "None", "floats", "decreasing", "no leading 0", "short kv", "shifts"]),
       shifted=st.booleans(), causal=st.booleans(), window=st.sampled_from([(-1, -1), (2, 0), (1, 1), (0, 0), (-1, 2)]),
       seed=st.integers(0, 3))  # fmt: skip
def test_a_varlen_attends_as_written_or_is_a_cpinputerror(q_lens, kv_lens, flaw, shifted, causal, window, seed):
    from cpref.kernels import TorchKernel

    n = min(len(q_lens), len(kv_lens))
    cu_q, cu_kv = ([0, *torch.tensor(lens[:n]).cumsum(0).tolist()] for lens in (q_lens, kv_lens))
    shifts = [(seed + i) % 5 - 2 for i in range(n)] if shifted else None
    args = {"str": ("0,2", cu_kv, shifts), "None": (None, cu_kv, shifts), "floats": ([float(x) for x in cu_q], cu_kv, shifts),
            "decreasing": ([*cu_q, cu_q[-1] - 1], [*cu_kv, cu_kv[-1]], shifts), "no leading 0": ([1, *cu_q[1:]], cu_kv, shifts),
            "short kv": (cu_q, cu_kv[:-1], shifts), "shifts": (cu_q, cu_kv, [0] * (n + 1))}.get(flaw, (cu_q, cu_kv, shifts))  # fmt: skip
    seqs = outcome(lambda: cpref.Varlen(*args))
    assert isinstance(seqs, cpref.CPInputError) == (flaw is not None), (flaw, seqs)
    if flaw is not None:
        return
    assert (seqs.cu_q, seqs.cu_kv) == (tuple(cu_q), tuple(cu_kv)) and seqs.shifts == (None if shifts is None else tuple(shifts))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, 4, generator=g, dtype=torch.float64) for t, h in ((cu_q[-1], 4), (cu_kv[-1], 2), (cu_kv[-1], 2)))
    got = outcome(lambda: TorchKernel().forward(q, k, v, seqs, causal=causal, scale=0.5, window=window))
    if isinstance(got, cpref.CPInputError):
        assert causal and window[1] > 0, got  # a causal call's window reaches no key to the right
        return
    out, lse, seen = dense_reference(q, k, v, cu_q, cu_kv, shifts, causal, window, 0.5)
    torch.testing.assert_close(got[0], out, atol=TOL[torch.float64], rtol=TOL[torch.float64])
    torch.testing.assert_close(got[1], lse, atol=TOL[torch.float64], rtol=TOL[torch.float64])
    assert seqs.work(causal, window) == seen * 1  # score entries per head
