"""A fuzz over the public attention API's argument space: the FP64 oracle's result, or a `CPInputError`, on every rank.

Each example draws a CP size, mode, layout, batch (documents of 1 to 20 tokens, padded by `eod_padded`), head
counts and head dim, `causal`, a window, a softmax scale and the mode's options, from ranges that hold valid and
invalid values alike (heads a mode cannot split, a window a mode does not take, a scale of 0, `inf` or a string,
an `a2a_size` that does not divide `P`), and then perhaps one rank's own mistake (a shard a token short, another
dtype, keys of another head dim). Run on the simulated cluster, every rank returns its output or its exception.
The test holds each example to exactly one of two outcomes: every rank raises a `CPInputError` (a rank whose own
input failed raises its own, the others a `PeerInputError` naming it), or every rank's output and gradients
equal the oracle's within float64's tolerance. Any other exception, a hang (which the cluster reports as a
timeout), or a wrong number fails it.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cpref
from sim import SimCluster, oracle
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
    fault = draw(st.sampled_from([None] * 9 + ["short", "dtype", "head dim"]))
    return dict(P=P, mode=mode, layout=draw(st.sampled_from(cpref.LAYOUTS)), lengths=lengths, heads=(hq, hkv), d=d,
                causal=causal, window=window, scale=scale, options=options, fault=fault)  # fmt: skip


def run(c: dict):
    """Every rank's `(out, dq, dk, dv)` of the call, or the exception it raised; and the oracle's shards."""
    cu = torch.tensor([0, *torch.tensor(c["lengths"]).cumsum(0).tolist()])
    sharding = cpref.Sharding.eod_padded(cu, cp_size=c["P"], layout=c["layout"])
    (hq, hkv), d, T = c["heads"], c["d"], int(cu[-1])
    g = torch.Generator().manual_seed(sum(c["lengths"]))
    q, k, v, dout = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))

    def rank(comm):
        local = [sharding.shard(sharding.pad(t), comm.rank) for t in (q, k, v, dout)]
        if comm.rank == c["P"] - 1 and c["fault"] is not None:  # the last rank's own mistake
            i, bad = {"short": (0, lambda t: t[:-1]), "dtype": (1, lambda t: t.float()),
                      "head dim": (1, lambda t: t[..., :-1])}[c["fault"]]  # fmt: skip
            local[i] = bad(local[i])
        q_r, k_r, v_r = (t.clone().requires_grad_() for t in local[:3])
        try:
            out = cpref.attention(q_r, k_r, v_r, sharding, comm=comm, mode=c["mode"], causal=c["causal"],
                                  window=c["window"], softmax_scale=c["scale"], **c["options"])  # fmt: skip
            out.backward(local[3])
        except cpref.CPInputError as err:
            return err
        return out.detach(), q_r.grad, k_r.grad, v_r.grad

    results = SimCluster(c["P"], timeout=20.0).run(rank)
    return results, sharding, (q, k, v, dout, cu)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_every_call_gives_the_oracles_result_or_a_cpinputerror_on_every_rank(c):
    results, sharding, (q, k, v, dout, cu) = run(c)
    raised = [isinstance(r, cpref.CPInputError) for r in results]
    event("refused" if any(raised) else "computed")
    if any(raised):
        assert all(raised), f"some ranks raised, others returned: {results}"
        own = [r for r in results if not isinstance(r, cpref.errors.PeerInputError)]
        assert own, "every rank blames another"
        return
    assert c["fault"] is None, f"rank {c['P'] - 1}'s {c['fault']} shard was accepted"
    scale = c["scale"]
    out, _, dq, dk, dv = oracle.forward_backward(q, k, v, cu, dout, causal=c["causal"], scale=scale, window=c["window"])
    for name, want, i in (("out", out, 0), ("dq", dq, 1), ("dk", dk, 2), ("dv", dv, 3)):
        got = sharding.unpad(sharding.unshard([r[i] for r in results]))
        torch.testing.assert_close(got, want, atol=TOL[torch.float64], rtol=TOL[torch.float64], msg=lambda m, name=name: f"{name}: {m}")


def test_the_fuzz_reaches_both_outcomes():
    """The argument space is wide enough that both outcomes occur (a fuzz that only ever raised would pass vacuously)."""
    seen = set()
    valid = dict(P=2, mode="p2p", layout="zigzag", lengths=[5, 9], heads=(4, 2), d=8, causal=True, window=(-1, -1),
                 scale=None, options={}, fault=None)  # fmt: skip
    for change in ({}, {"scale": 0.0}, {"fault": "short"}, {"heads": (4, 3)}):
        results, _, _ = run({**valid, **change})
        seen.add(all(isinstance(r, cpref.CPInputError) for r in results))
    assert seen == {True, False}
