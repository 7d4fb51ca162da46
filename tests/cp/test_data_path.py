"""The EOD-padding data path: padding never changes the loss or the gradients of real tokens.

A tiny attention language model is trained one step two ways, in FP64:
* the reference: the real (unpadded) packed batch on one process, attention by the dense oracle;
* CP: `get_batch_on_this_cp_rank` pads every document to a multiple of 2P and slices it,
  `cpref.attention` runs on the simulated cluster with the batch's `Sharding` (both boundary lists), `cp_loss`
  normalises by the global count.
Loss and every parameter gradient (summed over ranks) must agree to 1e-10, causal or not.
"""

import pytest
import torch

import cpref
from sim import oracle
from sim.cluster.simcluster import SimCluster
from tests.helpers import cu_from_lengths

VOCAB, E, HQ, HKV, D = 13, 8, 4, 2, 6
MODE = "all_gather"


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (VOCAB, E), "pos": (1024, E), "wq": (E, HQ * D), "wk": (E, HKV * D), "wv": (E, HKV * D), "wo": (HQ * D, VOCAB)}
    return {n: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5 for n, s in shapes.items()}


def token_losses(p, tokens, labels, pos, attend):
    x = p["emb"][tokens] + p["pos"][pos]  # (T, E)
    q = (x @ p["wq"]).view(-1, HQ, D)
    k = (x @ p["wk"]).view(-1, HKV, D)
    v = (x @ p["wv"]).view(-1, HKV, D)
    o = attend(q, k, v).reshape(-1, HQ * D)  # (T, Hq D)
    return torch.nn.functional.cross_entropy(o @ p["wo"], labels, reduction="none")  # (T,)


def packed_batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    cu = cu_from_lengths(lengths)
    tokens = torch.randint(1, VOCAB, (int(cu[-1]),), generator=g)
    labels = torch.roll(tokens, -1)
    loss_mask = torch.ones(int(cu[-1]), dtype=torch.float64)
    loss_mask[cu[1:] - 1] = 0  # the last token of a document predicts nothing
    pos = torch.cat([torch.arange(n) for n in lengths])
    return cu, tokens, labels, loss_mask, pos


def reference(lengths, causal=True):
    cu, tokens, labels, mask, pos = packed_batch(lengths)
    p = {n: t.requires_grad_() for n, t in make_params().items()}
    losses = token_losses(p, tokens, labels, pos, lambda q, k, v: oracle.attention(q, k, v, cu, causal=causal)[0])
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), {n: t.grad for n, t in p.items()}


def with_cp(lengths, P, layout, causal=True):
    cu, tokens, labels, mask, _ = packed_batch(lengths)

    def rank_fn(comm):
        p = {n: t.requires_grad_() for n, t in make_params().items()}  # each rank's own replica
        b = cpref.get_batch_on_this_cp_rank(
            {"tokens": tokens, "labels": labels, "loss_mask": mask}, cu, cp_size=P, rank=comm.rank, layout=layout
        )
        attend = lambda q, k, v: cpref.attention(q, k, v, b["sharding"], comm=comm, mode=MODE, causal=causal)  # noqa: E731
        losses = token_losses(p, b["tokens"], b["labels"], b["position_ids"], attend)
        share = cpref.cp_loss(losses, b["loss_mask"], comm)
        share.backward()
        return share.detach(), {n: t.grad for n, t in p.items()}, b

    return SimCluster(P, timeout=30.0).run(rank_fn)


@pytest.mark.sweep
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", cpref.LAYOUTS)
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("lengths", [[7, 13, 5], [1, 22], [9]], ids=["three", "tiny-doc", "one"])
def test_padding_changes_neither_loss_nor_gradients(lengths, P, layout, causal):
    ref_loss, ref_grads = reference(lengths, causal)
    results = with_cp(lengths, P, layout, causal)
    loss = sum(r[0] for r in results)
    torch.testing.assert_close(loss, ref_loss, atol=1e-10, rtol=1e-10)
    for name, g in ref_grads.items():
        torch.testing.assert_close(sum(r[1][name] for r in results), g, atol=1e-10, rtol=1e-10, msg=name)


def test_rank_holding_only_padding_gives_zero_loss_not_nan():
    """Field bug 6: every token on ranks 1..3 is padding; no NaN, no division by zero."""
    results = with_cp([1, 2], P=4, layout="zigzag")
    batches = [r[2] for r in results]
    assert [int(b["loss_mask"].sum()) for b in batches] == [1, 0, 0, 0]
    for share, grads, _ in results:
        assert torch.isfinite(share) and all(torch.isfinite(g).all() for g in grads.values())
    assert all(r[0] == 0 for r in results[1:])


def test_batch_slicing_pads_with_masked_eod_and_restarts_positions():
    cu, tokens, labels, mask, _ = packed_batch([5, 3])
    batch = {"tokens": tokens, "labels": labels}
    parts = [cpref.get_batch_on_this_cp_rank(batch, cu, cp_size=2, rank=r, pad_token_id=0) for r in range(2)]
    sharding = parts[0]["sharding"]
    assert sharding.cu_seqlens_padded == (0, 8, 12) and sharding.cu_seqlens == (0, 5, 8)
    full = {n: sharding.unshard([p[n] for p in parts]) for n in ("tokens", "loss_mask", "position_ids")}
    assert full["tokens"][:5].tolist() == tokens[:5].tolist() and full["tokens"][5:8].tolist() == [0, 0, 0]
    assert full["loss_mask"].tolist() == [1] * 5 + [0] * 3 + [1] * 3 + [0]
    assert full["position_ids"].tolist() == list(range(8)) + list(range(4))


def test_tail_padding_698_to_704_at_cp4_is_exact_and_deterministic():
    """Field bug 2: a 698-token document padded to 704 at CP=4 must not be mis-detected."""
    lengths = [698, 120]
    ref_loss, ref_grads = reference(lengths)
    first = with_cp(lengths, 4, "zigzag")
    assert first[0][2]["sharding"].cu_seqlens_padded == (0, 704, 824)
    torch.testing.assert_close(sum(r[0] for r in first), ref_loss, atol=1e-10, rtol=1e-10)
    for name, g in ref_grads.items():
        torch.testing.assert_close(sum(r[1][name] for r in first), g, atol=1e-10, rtol=1e-10, msg=name)
    second = with_cp(lengths, 4, "zigzag")
    for a, b in zip(first, second):
        assert all(torch.equal(a[1][n], b[1][n]) for n in ref_grads)


def test_cp_loss_with_no_loss_token_anywhere_is_zero_with_zero_gradient():
    """Global count 0: the loss is 0 (not NaN) and so is its gradient."""

    def rank_fn(comm):
        token_loss = torch.randn(4, dtype=torch.float64, requires_grad=True)
        share = cpref.cp_loss(token_loss, torch.zeros(4, dtype=torch.float64), comm)
        share.backward()
        return share.detach(), token_loss.grad

    for share, grad in SimCluster(2).run(rank_fn):
        assert share == 0 and torch.equal(grad, torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("mask_shape", [(4, 1), (1, 4), (3,)])
def test_cp_loss_refuses_a_mask_of_another_shape(mask_shape):
    """A (N, 1) mask would broadcast against (N,) losses into an (N, N) sum: 18 instead of 4.5."""
    with pytest.raises(ValueError, match=r"token_loss has shape \(4,\) but loss_mask"):
        SimCluster(2).run(lambda comm: cpref.cp_loss(torch.arange(4.0), torch.ones(mask_shape), comm))


def test_cp_loss_sums_to_the_global_masked_mean():
    losses = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])]
    shares = SimCluster(2).run(lambda comm: cpref.cp_loss(losses[comm.rank], masks[comm.rank], comm))
    assert sum(shares).item() == pytest.approx((1 + 3 + 6) / 3)


def test_cp_loss_with_a_known_count_makes_no_all_reduce():
    """Gradient accumulation passes the step's total: the same share, no all-reduce (only the host
    exchange that tells every rank whether each rank's inputs passed validation)."""
    losses, masks = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])]
    cluster = SimCluster(2)
    shares = cluster.run(lambda comm: cpref.cp_loss(losses[comm.rank], masks[comm.rank], comm, count=torch.tensor(3.0)))
    assert [(e.op, e.param) for e in cluster.trace] == [("all_gather", "host")]
    assert sum(shares).item() == pytest.approx((1 + 2 + 4) / 3)
    shares_counted = SimCluster(2).run(lambda comm: cpref.cp_loss(losses[comm.rank], masks[comm.rank], comm))
    assert [s.item() for s in shares] == [s.item() for s in shares_counted]


def test_padding_fills_tokens_and_labels_with_pad_token_id_and_everything_else_with_zero():
    cu = cu_from_lengths([5, 3])
    batch = {"tokens": torch.arange(1, 9), "labels": torch.arange(11, 19), "weights": torch.full((8,), 2.5)}
    parts = [cpref.get_batch_on_this_cp_rank(batch, cu, cp_size=2, rank=r, pad_token_id=99) for r in range(2)]
    sharding = parts[0]["sharding"]  # 5 -> 8 and 3 -> 4 tokens (multiples of 2P = 4)
    full = {n: sharding.unshard([p[n] for p in parts]).tolist() for n in ("tokens", "labels", "loss_mask", "weights")}
    # documents [1..5] and [6..8], each followed by its padding
    assert full["tokens"] == [1, 2, 3, 4, 5, 99, 99, 99, 6, 7, 8, 99]
    assert full["labels"] == [11, 12, 13, 14, 15, 99, 99, 99, 16, 17, 18, 99]
    assert full["loss_mask"] == [1] * 5 + [0] * 3 + [1] * 3 + [0]  # never pad_token_id
    assert full["weights"] == [2.5] * 5 + [0] * 3 + [2.5] * 3 + [0]


def test_the_default_loss_mask_is_float32_whatever_the_token_dtype():
    cu = cu_from_lengths([5, 3])
    for dtype in (torch.int64, torch.int32):
        tokens = torch.arange(8, dtype=dtype)
        part = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=2, rank=0)
        assert part["loss_mask"].dtype == torch.float32


def test_contiguous_layout_pads_each_document_to_a_multiple_of_p_not_2p():
    cu = cu_from_lengths([5, 3])
    tokens = torch.arange(8)
    batch = {"tokens": tokens, "labels": tokens}
    parts = [cpref.get_batch_on_this_cp_rank(batch, cu, cp_size=2, rank=r, layout="contiguous") for r in range(2)]
    # P = 2: 5 -> 6 and 3 -> 4 tokens, so each rank holds (6 + 4) / 2 = 5
    assert parts[0]["sharding"].cu_seqlens_padded == (0, 6, 10)
    assert [p["tokens"].shape[0] for p in parts] == [5, 5]


def test_the_returned_sharding_holds_host_int_boundaries_whatever_the_input_dtype():
    """The boundaries come back once, in the `Sharding` (no `cu_seqlens` keys): host ints, a copy,
    so an in-place edit of the caller's int32 tensor afterwards changes nothing."""
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    tokens = torch.arange(8)
    part = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=2, rank=0)
    sharding = part["sharding"]
    assert "cu_seqlens" not in part and "cu_seqlens_padded" not in part
    assert (sharding.cp_size, sharding.layout) == (2, "zigzag")
    assert sharding.cu_seqlens == (0, 5, 8) and sharding.cu_seqlens_padded == (0, 8, 12)
    assert all(type(n) is int for n in sharding.cu_seqlens + sharding.cu_seqlens_padded)
    cu[1] = 4
    assert sharding.cu_seqlens == (0, 5, 8) and sharding.cu_seqlens_padded == (0, 8, 12)


def test_cp_loss_share_keeps_the_dtype_of_token_loss_whatever_the_mask_dtype():
    """A float64 mask must not promote bf16 losses: the share is bf16, like the losses."""
    losses = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3.0, 4.0], dtype=torch.bfloat16)]
    masks = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)]
    shares = SimCluster(2).run(lambda comm: cpref.cp_loss(losses[comm.rank], masks[comm.rank], comm))
    assert [s.dtype for s in shares] == [torch.bfloat16, torch.bfloat16]
    # 3 loss tokens: rank 0 (1 + 2) / 3 = 1, rank 1 4 / 3 (bf16: 1.3359375)
    assert [s.item() for s in shares] == [1.0, pytest.approx(4 / 3, rel=1e-2)]
