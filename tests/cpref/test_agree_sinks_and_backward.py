"""The ranks' comparison (`cpref.modes.consistency`) of what issue 56 found unchecked: the sinks' values (item 2:
different values on different ranks gave wrong results without an error) and whether a call records a backward
(item 5: one rank under `torch.no_grad()`, or with no input requiring grad, left the others waiting in the
backward's collectives until the timeout). The same on gloo processes: `tests/backends/test_torch_dist.py`.
"""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.modes import consistency
from cpref.modes.consistency import BACKWARD, SINKS_READ
from sim import SimCluster
from tests.cp.test_every_mode import HostSyncCounter
from tests.helpers import attention_inputs, cu_from_lengths, only_the_comparison

P = 2
MODES = sorted(cpref.MODES)
SHARDING = cpref.Sharding(cu_from_lengths([8, 24]), cp_size=P, layout="zigzag")
Q, K, V, DOUT = attention_inputs(32, (4, 2, 8, 8))
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)


def digest(values) -> str:
    """The documented code of the sinks values column: blake2b(repr of the float64 values as a tuple), 7 bytes
    little-endian, shown as 14 hex digits (computed here, not copied)."""
    code = int.from_bytes(hashlib.blake2b(repr(tuple(values)).encode(), digest_size=7).digest(), "little")
    return f"digest {code:014x}"


def run(rank_fn, size=P):
    """`rank_fn(comm, local q, k, v, dout)` on every rank; `(cluster, results or the exception)`."""
    cluster = SimCluster(size, timeout=20.0)
    try:
        return cluster, cluster.run(lambda comm: rank_fn(comm, *[SHARDING.shard(t, comm.rank) for t in (Q, K, V, DOUT)]))
    except Exception as exc:  # noqa: BLE001 -- the caller asserts what it is
        return cluster, exc


def options(mode):
    return cpref.MODES[mode].example_options(P)


# ---- item 2: the sinks' values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_ranks_passing_different_sinks_values_are_named_with_the_values_from_the_first_head_that_differs(mode):
    """Was: no error, every rank computing with its own sinks. Rank 1's third sink differs."""
    theirs = SINKS.clone()
    theirs[2] = 3.0

    def rank_fn(comm, q, k, v, dout):
        return cpref.attention(q, k, v, SHARDING, comm=comm, mode=mode, sinks=[SINKS, theirs][comm.rank], **options(mode))

    cluster, result = run(rank_fn)
    assert isinstance(result, CPInputError), result  # the same message on every rank: re-raised as is
    message = str(result)
    assert f"\n  sinks values: rank 0: {digest(SINKS.tolist())}; rank 1: {digest(theirs.tolist())}\n" in message, message
    assert ("sinks values from head 1 (first difference at head 2): rank 0: [..., -1.0, 2.0, 0.25]; "
            "rank 1: [..., -1.0, 3.0, 0.25]") in message, message  # fmt: skip
    assert "Sinks are a parameter that every rank of the CP group holds alike" in message
    assert "variants" not in message and BACKWARD not in message  # only the values differ
    assert [e.param for e in cluster.trace] == ["host"] * 3, cluster.trace  # the comparison, then the values' two


def test_sinks_given_on_one_rank_only_are_named_as_none_beside_the_digest_without_showing_values():
    """The variants column names it; the values column says none where a rank passes no sinks, and shows no
    values (nothing to compare them with: no exchange beyond the comparison)."""

    def rank_fn(comm, q, k, v, dout):
        return cpref.attention(q, k, v, SHARDING, comm=comm, mode="p2p", sinks=SINKS if comm.rank else None)

    cluster, result = run(rank_fn)
    assert isinstance(result, CPInputError), result
    assert f"\n  sinks values: rank 0: none; rank 1: {digest(SINKS.tolist())}\n" in str(result), str(result)
    assert "variants (softcap, chunk, sinks): rank 0: digest" in str(result) and "first difference" not in str(result)
    assert only_the_comparison(cluster.trace), cluster.trace


def test_sinks_changed_in_place_on_one_rank_before_a_later_call_are_named_there():
    """On the CPU the values are read at every call: rank 1 edits its sinks (the same tensor) between two calls."""

    def rank_fn(comm, q, k, v, dout):
        sinks = SINKS.clone()
        cpref.attention(q, k, v, SHARDING, comm=comm, mode="p2p", sinks=sinks)
        if comm.rank == 1:
            sinks[0] += 2.0**-40  # a difference far below any tolerance still computes another function
        return cpref.attention(q, k, v, SHARDING, comm=comm, mode="p2p", sinks=sinks)

    cluster, result = run(rank_fn)
    assert isinstance(result, CPInputError), result
    assert f"first difference at head 0): rank 0: [0.5, -1.0, 2.0, 0.25]; rank 1: [{0.5 + 2.0**-40!r}," in str(result)
    assert sum(e.param == "host" for e in cluster.trace) == 2 + 2  # two comparisons, then the error path's two exchanges


def test_equal_sinks_in_new_tensors_or_another_dtype_agree_and_change_nothing():
    """Identical values are identical: rank 1 passes a fresh tensor at every call, in float32 (the values hold
    exactly), and every rank's output is bitwise that of a run in which both ranks pass the same tensor."""

    def rank_fn(comm, q, k, v, dout, fresh=False):
        outs = []
        for _ in range(2):
            sinks = SINKS.float() if fresh and comm.rank == 1 else SINKS  # on rank 1, a new float32 tensor at every call
            outs.append(cpref.attention(q, k, v, SHARDING, comm=comm, mode="p2p", sinks=sinks))
        return outs

    _, plain = run(rank_fn)
    _, fresh = run(lambda *a: rank_fn(*a, fresh=True))
    assert not isinstance(fresh, Exception), fresh
    assert all(torch.equal(a, b) for r in range(P) for a, b in zip(fresh[r], plain[r]))


@pytest.fixture
def on_an_accelerator(monkeypatch):
    """The comparison's policy for sinks on an accelerator, on this CPU: `_on_host` says no for every device."""
    assert consistency._on_host(torch.device("cpu")) and not consistency._on_host(torch.device("cuda", 0))
    assert not consistency._on_host(torch.device("meta"))
    monkeypatch.setattr(consistency, "_on_host", lambda device: False)


def test_on_an_accelerator_a_sinks_tensor_is_read_once_and_goes_with_its_tensor(on_an_accelerator, monkeypatch):
    """One host copy per tensor, at its first call; an in-place change afterwards is not read (the docstring's
    limit); another tensor is read again; the entry dies with its tensor."""
    sinks, first, doubled = SINKS.clone(), tuple(SINKS.tolist()), tuple((2 * SINKS).tolist())
    counter = HostSyncCounter(monkeypatch)
    assert SINKS_READ(sinks) == first and counter.calls == ["tolist"]
    sinks.mul_(2)
    assert SINKS_READ(sinks) == first and counter.calls == ["tolist"]  # not read again: the values read then
    other = sinks.clone()
    assert SINKS_READ(other) == doubled and counter.calls == ["tolist", "tolist"]
    held = len(SINKS_READ.by_tensor)
    del other
    gc.collect()
    assert len(SINKS_READ.by_tensor) == held - 1


def test_on_an_accelerator_sinks_that_differ_from_the_start_are_named_and_later_steps_read_nothing(
    on_an_accelerator, monkeypatch
):
    """The hardening check with sinks: 3 layers of 2 steps, each layer its own sinks on each rank, updated in place
    alike between the steps; after the first step no tensor is copied to the host. And where rank 1's sinks
    differ at the first call, every rank names them."""
    counter = {}

    def rank_fn(comm, q, k, v, dout, differ=False):
        layers = [torch.nn.Parameter(SINKS + i + (differ and comm.rank == 1)) for i in range(3)]  # each rank its own
        local = [t.requires_grad_() for t in (q, k, v)]
        for step in range(2):
            if step == 1:
                comm.barrier()
                if comm.rank == 0:
                    counter["sync"] = HostSyncCounter(monkeypatch)
                comm.barrier()
            out = local[0]
            for sinks in layers:
                out = cpref.attention(out * 0.5 + local[0], local[1], local[2], SHARDING, comm=comm, mode="p2p", sinks=sinks)
            out.backward(dout)
            with torch.no_grad():
                for layer in layers:
                    layer.sub_(0.1 * layer.grad)  # each rank's own share: the replicas drift apart, unread
        return [s.detach() for s in layers]

    cluster, result = run(rank_fn)
    assert not isinstance(result, Exception), result
    assert not torch.equal(result[0][0], result[1][0])  # they drifted apart (no all-reduce here), and no read saw it
    assert counter["sync"].calls == []
    assert sum(e.param == "host" for e in cluster.trace) == 6  # still one comparison per call
    _, result = run(lambda *a: rank_fn(*a, differ=True))
    assert isinstance(result, CPInputError) and "first difference at head 0): rank 0: [0.5," in str(result), result


# ---- item 5: whether the call records a backward --------------------------------------------------------------------


def differing(how):
    """Rank 1's call in the way `how`, rank 0's recording a backward; each returns (out, whether to backward)."""

    def call(comm, q, k, v, mode, sinks=None):
        return cpref.attention(q, k, v, SHARDING, comm=comm, mode=mode, sinks=sinks, **options(mode))

    def rank_fn(comm, q, k, v, dout, mode):
        grad = comm.rank == 0
        if how == "sinks alone":  # rank 0: only its sinks require grad; rank 1: frozen sinks, q, k, v not
            sinks = torch.nn.Parameter(SINKS.clone(), requires_grad=grad)
            out = call(comm, q, k, v, mode, sinks)
        elif how == "inputs not requiring grad":
            out = call(comm, *(t.clone().requires_grad_(grad) for t in (q, k, v)), mode)
        else:
            ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[how]
            with ctx() if comm.rank == 1 else torch.enable_grad():
                out = call(comm, *(t.clone().requires_grad_() for t in (q, k, v)), mode)
        if out.requires_grad:
            out.backward(dout)
        return out

    return rank_fn


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "inputs not requiring grad", "sinks alone"])
@pytest.mark.parametrize("mode", MODES)
def test_ranks_that_differ_in_grad_mode_are_named_on_every_rank_in_every_mode(mode, how):
    """Was: rank 0's backward waited in the mode's collectives for rank 1 (on the simulated cluster a PeerFailure,
    `rank 1 finished without calling send_recv`; on gloo until the process group's timeout)."""
    cluster, result = run(lambda comm, *t: differing(how)(comm, *t, mode))
    assert isinstance(result, CPInputError), result
    assert f"\n  {BACKWARD}: rank 0: True; rank 1: False\n" in str(result), str(result)
    assert "A rank that records no backward (under torch.no_grad() or torch.inference_mode()" in str(result)
    assert only_the_comparison(cluster.trace), cluster.trace


@pytest.mark.parametrize("mode", MODES)
def test_ranks_whose_calls_all_record_a_backward_run_it_whichever_inputs_require_grad(mode):
    """Rank 0 trains q, k and v, rank 1 only v: both record a backward, whose collectives are the same, so the
    column agrees and both gradients are those of a run where every rank trains q, k and v."""

    def rank_fn(comm, q, k, v, dout, all_three=False):
        local = [t.clone().requires_grad_(all_three or comm.rank == 0 or i == 2) for i, t in enumerate((q, k, v))]
        cpref.attention(*local, SHARDING, comm=comm, mode=mode, **options(mode)).backward(dout)
        return [t.grad for t in local]

    _, mixed = run(rank_fn)
    _, plain = run(lambda *a: rank_fn(*a, all_three=True))
    assert not isinstance(mixed, Exception), mixed
    for r in range(P):
        for got, want in zip(mixed[r], plain[r]):
            assert got is None or torch.equal(got, want)
    assert mixed[1][0] is None and mixed[1][2] is not None
