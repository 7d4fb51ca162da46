"""`SingleRank`: the protocol for a group of one; every mode then is attention over the whole stream."""

import pytest
import torch

import cpref
from cpref.comm.protocol import Collectives
from sim.cluster.harness import oracle_shards
from tests.helpers import assert_close, cu_from_lengths, random_qkv


def test_is_a_collectives_and_copies():
    comm = cpref.SingleRank()
    assert isinstance(comm, Collectives) and (comm.rank, comm.size) == (0, 1)
    x = torch.arange(4.0, requires_grad=True)
    for out in (comm.all_gather(x), comm.reduce_scatter(x), comm.all_to_all(x), comm.send_recv(x, 3),
                comm.send_recv_async(x).wait(), comm.all_reduce(x, "min")):  # fmt: skip
        assert torch.equal(out, x.detach()) and out.data_ptr() != x.data_ptr() and not out.requires_grad
    assert comm.split([[0]]) is comm
    with pytest.raises(ValueError, match="must partition the ranks"):
        comm.split([[0, 1]])
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(x, "avg")


def padded_batch() -> cpref.Sharding:
    """A new batch at cp_size = 1: documents of 5 and 13 tokens padded to 8 and 16 (24 tokens)."""
    return cpref.Sharding(cu_from_lengths([5, 13]), cp_size=1, cu_seqlens_padded=cu_from_lengths([8, 16]))


@pytest.mark.parametrize("mode, extra", [("all_gather", {}), ("p2p", {}), ("a2a", {}), ("a2a+p2p", {"a2a_size": 1})])
def test_every_mode_at_cp1_is_attention_over_the_stream(mode, extra):
    sharding = padded_batch()
    q, k, v = (t.requires_grad_() for t in random_qkv(24, 4, 2, 8))
    dout = random_qkv(24, 4, 4, 8, seed=1)[0]
    out = cpref.attention(q, k, v, sharding, comm=cpref.SingleRank(), mode=mode, **extra)
    out.backward(dout)
    want = oracle_shards(q.detach(), k.detach(), v.detach(), dout, sharding)[0]
    for got, ref in zip((out.detach(), q.grad, k.grad, v.grad), want):
        assert_close(got, ref, torch.float64)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode, extra", [("all_gather", {}), ("p2p", {}), ("a2a", {}), ("a2a+p2p", {"a2a_size": 1})])
def test_without_cp_any_document_length_runs_in_either_layout_unpadded(mode, extra, layout):
    """Issue 19: at cp_size = 1 there is nothing to balance, so odd lengths need no padding (was:
    "not a multiple of 2 (the zigzag layout over cp_size=1)"); the result is attention itself."""
    from sim.oracle import attention as oracle

    cu = cu_from_lengths([7, 5, 1])
    sharding = cpref.Sharding(cu, cp_size=1, layout=layout)
    q, k, v = (t.requires_grad_() for t in random_qkv(13, 4, 2, 8))
    dout = random_qkv(13, 4, 4, 8, seed=1)[0]
    assert torch.equal(sharding.shard(q.detach(), 0), q.detach())
    out = cpref.attention(q, k, v, sharding, comm=cpref.SingleRank(), mode=mode, **extra)
    out.backward(dout)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want, _ = oracle(qr, kr, vr, cu)
    want.backward(dout)
    for got, ref in zip((out.detach(), q.grad, k.grad, v.grad), (want.detach(), qr.grad, kr.grad, vr.grad)):
        assert_close(got, ref, torch.float64)


def test_without_cp_the_data_path_pads_nothing_and_with_cp_odd_lengths_still_need_padding():
    cu = cu_from_lengths([7, 5])
    batch = {"tokens": torch.arange(12), "labels": torch.arange(12)}
    part = cpref.get_batch_on_this_cp_rank(batch, cu, cp_size=1, rank=0)
    assert part["sharding"].cu_seqlens_padded == (0, 7, 12) and torch.equal(part["tokens"], batch["tokens"])
    assert cpref.batch.layout.layout_multiple("zigzag", 1) == 1 and cpref.batch.layout.layout_multiple("zigzag", 2) == 4
    with pytest.raises(ValueError, match=r"document 0 has length 7, not a multiple of 4 \(the zigzag layout over cp_size=2\)"):
        cpref.Sharding(cu, cp_size=2, layout="zigzag")


class CountingRank(cpref.SingleRank):
    """A group of one that records every collective called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name not in ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "send_recv_async", "all_gather_async",
                        "reduce_scatter_async", "all_to_all_async", "all_reduce", "barrier"):
            return attr
        calls = object.__getattribute__(self, "calls")
        return lambda *args, **kwargs: calls.append(name) or attr(*args, **kwargs)


@pytest.mark.parametrize("mode", ["all_gather", "p2p"])
def test_all_gather_and_ring_at_cp1_call_no_collective_and_select_no_rows(monkeypatch, mode):
    """At P = 1 the all-gather plan sends the kernel straight to the local K/V (no gather, no
    `index_select`, no `index_add_`, no reduce-scatter; see `cpref.modes.metadata`) and a ring of one
    rank is one kernel call: neither calls its group."""
    selected = []
    for name in ("index_select", "index_add_", "index_copy_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **kw: selected.append(_name) or _real(self, *a, **kw))
    sharding = padded_batch()
    q, k, v = (t.requires_grad_() for t in random_qkv(24, 4, 2, 8))
    comm = CountingRank()
    cpref.attention(q, k, v, sharding, comm=comm, mode=mode).sum().backward()
    assert comm.calls == [] and selected == []
    assert q.grad.isfinite().all() and k.grad.abs().sum() > 0


def test_a_bad_call_at_cp1_raises_without_calling_its_group():
    """A group of one has no peer to tell (`cpref.modes.consistency`): the error comes with no collective."""
    comm = CountingRank()
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="q/k/v hold 7/8/8 tokens"):
        cpref.attention(q[:-1], q, q, cpref.Sharding([0, 8], cp_size=1), comm=comm, mode="all_gather")
    assert comm.calls == []


def test_a_failing_report_to_the_peers_does_not_hide_the_ranks_own_error():
    """If telling the others fails as well (a broken group), the error raised is still the input's."""

    class BrokenGroup(CountingRank):
        size = 2

        def all_gather(self, x):
            raise RuntimeError("the group is gone")

    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="q/k/v hold 3/4/4 tokens"):
        cpref.attention(q[:3], q[:4], q[:4], cpref.Sharding([0, 8], cp_size=2), comm=BrokenGroup(), mode="all_gather")
