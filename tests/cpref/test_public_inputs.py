"""Issue 41: the public functions around attention validate what they take, with a `CPInputError` naming the
value and the fix, and the per-step values the ranks must agree on are cross-checked as attention's are.

On the main the issue was filed against: `Sharding.unpad` of the real stream or of one rank's shard returned a
mis-sliced tensor; `cp_loss(count=0)` with loss tokens divided by 1, and ranks passing different counts went
unnoticed; `unshard` of mixed shards, `pad(value=None)`, a string `pad_token_id`, `cu_seqlens` on the meta device
and `thd_to_bshd` of the wrong length raised raw torch or Python errors.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from sim import ClusterFailure, SimCluster

S = cpref.Sharding.eod_padded([0, 7, 13], cp_size=2)  # padded to (0, 8, 16): 8 tokens a rank
LONG = torch.zeros(13, dtype=torch.long)

CALLS = {
    "unpad of the real stream": (lambda: S.unpad(torch.zeros(13)), "padded stream has 16 tokens.*already the real stream"),
    "unpad of one shard": (lambda: S.unpad(torch.zeros(8)), "it is one rank's shard: unshard every rank's first"),
    "unpad of a list": (lambda: S.unpad([1, 2]), "x has shape list"),
    "unshard of mixed dtypes": (lambda: S.unshard([torch.zeros(8), torch.zeros(8, dtype=torch.long)]),
                                "shard of rank 1 is torch.int64 .* the same dtype, device and trailing dims"),
    "unshard of mixed shapes": (lambda: S.unshard([torch.zeros(8, 2), torch.zeros(8, 3)]), "shard of rank 1 is"),
    "unshard of one tensor": (lambda: S.unshard(torch.zeros(2, 8)), "unshard got a tensor \\(2, 8\\)"),
    "unshard of a non-tensor": (lambda: S.unshard([torch.zeros(8), [0] * 8]), "shard of rank 1 is list"),
    "pad with None": (lambda: S.pad(torch.zeros(13), value=None), "pad value must be a number .* got None"),
    "pad of ints with 0.5": (lambda: S.pad(LONG, value=0.5), "pad value must be an integer for torch.int64, got 0.5"),
    # round 3: values the dtype cannot hold (on main a raw RuntimeError, or -1 silently 255)
    "pad of uint8 with 300": (lambda: S.pad(LONG.to(torch.uint8), value=300), r"pad value=300 does not fit torch.uint8, "
                              r"whose values are the integers in \[0, 255\]"),
    "pad of uint8 with -1": (lambda: S.pad(LONG.to(torch.uint8), value=-1), "pad value=-1 does not fit torch.uint8"),
    "pad of int64 with 2**63": (lambda: S.pad(LONG, value=2**63), "pad value=9223372036854775808 does not fit torch.int64"),
    "pad of fp16 with 1e6": (lambda: S.pad(torch.zeros(13, dtype=torch.float16), value=1e6),
                             r"pad value=1000000.0 does not fit torch.float16, whose values are the numbers in "
                             r"\[-65504, 65504\], inf and nan"),
    "pad of bools with 2": (lambda: S.pad(LONG > 0, value=2), "pad value=2 does not fit torch.bool"),
    "pad of ints with nan": (lambda: S.pad(LONG, value=float("nan")), "pad value must be an integer for torch.int64"),
    "a pad_token_id beyond int64": (lambda: cpref.get_batch_on_this_cp_rank({"tokens": LONG, "labels": LONG}, [0, 7, 13],
                                    cp_size=2, rank=0, pad_token_id=2**70), "pad_token_id=1180591620717411303424 does "
                                    "not fit torch.int64"),
    "a pad_token_id beyond uint8 tokens": (lambda: cpref.get_batch_on_this_cp_rank(
        {"tokens": LONG.to(torch.uint8), "labels": LONG}, [0, 7, 13], cp_size=2, rank=0, pad_token_id=256),
        "pad_token_id=256 does not fit torch.uint8"),
    "a Varlen of a string": (lambda: cpref.Varlen("abc"), "Varlen: cu_q is str 'abc'; pass cumulative lengths"),
    "a Varlen of None": (lambda: cpref.Varlen(None), "Varlen: cu_q is NoneType None"),
    "a Varlen of floats": (lambda: cpref.Varlen([0, 2.5]), r"Varlen: cu_q\[1\] is 2.5 \(float\), not an int"),
    "Varlen shifts of a string": (lambda: cpref.Varlen([0, 2], shifts="1"), "Varlen: shifts is str '1'; pass one int"),
    "Boundaries of strings": (lambda: _seqlens().Boundaries("x", "y"), "cu_seqlens is str 'x'"),
    "Boundaries that pad nothing": (lambda: _seqlens().Boundaries((0, 5), (0, 4)), "document 0 has 5 real tokens but only 4"),
    "Boundaries of one list": (lambda: _seqlens().Boundaries((0, 5), None), "cu_seqlens_padded is NoneType None"),
    "a string pad_token_id": (lambda: cpref.get_batch_on_this_cp_rank({"tokens": LONG, "labels": LONG}, [0, 7, 13],
                              cp_size=2, rank=0, pad_token_id="0"), "pad_token_id must be an int, got '0'"),
    "a list pad_token_id": (lambda: cpref.get_batch_on_this_cp_rank({"tokens": LONG, "labels": LONG}, [0, 7, 13],
                            cp_size=2, rank=0, pad_token_id=[0]), "pad_token_id must be an int"),
    "a batch value of another length": (lambda: cpref.get_batch_on_this_cp_rank({"tokens": LONG, "labels": LONG[:5]},
                                        [0, 7, 13], cp_size=2, rank=0), "batch\\['labels'\\] is \\(5,\\)"),
    "a batch of lists": (lambda: cpref.get_batch_on_this_cp_rank({"tokens": [1] * 13, "labels": LONG}, [0, 7, 13],
                         cp_size=2, rank=0), "batch\\['tokens'\\] is list"),
    "cu_seqlens on the meta device": (lambda: cpref.Sharding(torch.tensor([0, 4], device="meta"), cp_size=1),
                                      "on the meta device, which holds no values"),
    "thd_to_bshd of another length": (lambda: cpref.thd_to_bshd(torch.zeros(5), [0, 4, 8]), "cu_seqlens holds 8 tokens"),
    "count=0 with loss tokens": (lambda: cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(), count=0),
                                 "count=0 is below this rank's 3 loss tokens"),
    "count=inf": (lambda: cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(), count=float("inf")),
                  "count must be a finite number >= 0, got inf"),
    "a count tensor of nan": (lambda: cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(),
                              count=torch.tensor(float("nan"))), "count must be a finite number >= 0, got nan"),
    "a count of two elements": (lambda: cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(),
                                count=torch.ones(2)), "a one-element tensor, got a tensor of shape \\(2,\\)"),
    "a string count": (lambda: cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(), count="3"),
                       "count must be a number or a one-element tensor, got '3'"),
    "bshd_to_thd of a 1-D tensor": (lambda: cpref.bshd_to_thd(torch.zeros(5)), "takes a batch \\(B, S, ...\\)"),
    "bshd_to_thd of a list": (lambda: cpref.bshd_to_thd([[1, 2]]), "got list"),
    "shard of a list": (lambda: S.shard([0] * 16, 0), "x has shape list"),
    "attention_work with a triple": (lambda: S.attention_work(0, window=(1, 2, 3)), "window must be a pair"),
    "attention_work with a string causal": (lambda: S.attention_work(0, causal="yes"), "causal must be True or False"),
    "cp_loss without a communicator": (lambda: cpref.cp_loss(torch.ones(2), torch.ones(2), None),
                                       "comm must be the CP group's collectives"),
    "a Topology of None": (lambda: _training().Topology(None, None), "pass the CP group's collectives as cp"),
    "a pack source of 1 token": (lambda: _training().PackSource(lambda: iter([]), 1), "pack_tokens=1 is outside"),
    "a pack source of a list": (lambda: _training().PackSource([], 8), "documents must be a function"),
    "an infinite learning rate": (lambda: _training().TrainConfig(lr=float("inf")), "lr must be a finite number > 0"),
    "a negative clip": (lambda: _training().TrainConfig(grad_clip=-1.0), "grad_clip must be None or a finite number"),
}  # fmt: skip


def _seqlens():
    import cpref.batch.seqlens

    return cpref.batch.seqlens


def _training():
    import cpref.train.training

    return cpref.train.training


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_bad_value_is_a_cpinputerror_naming_it(name):
    call, match = CALLS[name]
    with pytest.raises(CPInputError, match=match):
        call()


def test_the_checks_let_the_valid_calls_through():
    x = torch.arange(13.0)
    padded = S.pad(x, value=-1)
    assert torch.equal(S.unpad(padded), x) and torch.equal(S.unshard([S.shard(padded, r) for r in (0, 1)]), padded)
    assert S.pad(LONG, value=2.0).dtype == torch.int64 and S.pad(x > 3, value=False).dtype == torch.bool
    assert cpref.cp_loss(torch.ones(3), torch.ones(3), cpref.SingleRank(), count=6).item() == 0.5
    assert cpref.cp_loss(torch.ones(3), torch.zeros(3), cpref.SingleRank(), count=0).item() == 0.0  # no loss token
    assert S.pad(LONG.to(torch.uint8), value=255)[-1] == 255 and S.pad(LONG, value=2**63 - 1)[-1] == 2**63 - 1
    assert S.pad(torch.zeros(13, dtype=torch.float16), value=float("-inf"))[-1] == float("-inf")
    assert S.pad(torch.zeros(13, dtype=torch.float16), value=65504)[-1] == 65504
    assert cpref.Varlen(torch.tensor([0, 2, 6])).cu_q == (0, 2, 6) and cpref.Varlen(range(3)).cu_kv == (0, 1, 2)
    b = _seqlens().Boundaries([0, 5], [0, 8])  # lists become the tuples of host ints parse makes
    assert b == _seqlens().Boundaries.parse([0, 5], [0, 8]) and b.real == (0, 5) and hash(b) == hash(b)


def test_a_masked_token_s_nan_or_inf_loss_takes_no_part():
    """On main `(loss * mask).sum()` made the loss NaN: NaN x 0 is NaN; a select keeps it out, gradients too."""
    for bad in (float("nan"), float("inf")):
        loss = torch.tensor([1.0, bad, 3.0], requires_grad=True)
        share = cpref.cp_loss(loss, torch.tensor([1.0, 0.0, 1.0]), cpref.SingleRank())
        share.backward()
        assert share.item() == 2.0 and loss.grad.tolist() == [0.5, 0.0, 0.5]
    weighted = cpref.cp_loss(torch.tensor([2.0, 4.0]), torch.tensor([0.5, 1.0]), cpref.SingleRank(), count=2)
    assert weighted.item() == 2.5  # a fractional mask still weighs its token: (0.5 x 2 + 4) / 2


def shares(counts, P=3):
    """Every rank's cp_loss with rank r's `count=counts[r]` (2 loss tokens a rank); its exception if it raised."""

    def rank(comm):
        try:
            return cpref.cp_loss(torch.ones(4, dtype=torch.float64), torch.tensor([1.0, 1, 0, 0]), comm,
                                 count=counts[comm.rank])  # fmt: skip
        except CPInputError as err:
            return err

    cluster = SimCluster(P, timeout=20.0)
    return cluster.run(rank), cluster.trace


@pytest.mark.parametrize("counts, match", [
    ([6, 6, 7], "the ranks pass different count=: rank 0: 6; rank 1: 6; rank 2: 7"),
    ([6, None, 6], "count= is given on rank 0, rank 2 and not on rank 1"),
    ([5, 5, 5], "count=5 is below the 6 loss tokens of the group's ranks"),
    ([0, 0, 0], "count=0 is below the 6 loss tokens of the group's ranks"),  # on main: divided by 1
])  # fmt: skip
def test_a_count_the_ranks_do_not_agree_on_or_that_is_short_is_refused_on_every_rank(counts, match):
    results, trace = shares(counts)
    assert all(isinstance(r, CPInputError) for r in results), results
    assert all(match in str(r) for r in results) and len({str(r) for r in results}) == 1  # from the exchanged rows
    assert [(e.op, e.param) for e in trace] == [("all_gather", "host")]  # nothing but the exchange


def test_an_agreed_count_makes_no_all_reduce_and_the_shares_add_up():
    results, trace = shares([6, 6, 6])
    assert sum(float(r) for r in results) == pytest.approx(1.0)  # 6 tokens of loss 1, over 6
    assert [(e.op, e.param) for e in trace] == [("all_gather", "host")]
    results, _ = shares([torch.tensor(12.0)] * 3)  # e.g. two micro-batches' count, as a tensor
    assert sum(float(r) for r in results) == pytest.approx(0.5)


def test_a_rank_failing_its_own_count_check_is_named_by_the_others():
    with pytest.raises(ClusterFailure):
        SimCluster(2, timeout=20.0).run(lambda comm: cpref.cp_loss(torch.ones(2), torch.ones(2), comm,
                                                                   count=[1, float("nan")][comm.rank]))  # fmt: skip


@pytest.mark.parametrize("mode", sorted(cpref.MODES))
@pytest.mark.parametrize("cu", [[0, 16, 32], [0, 13, 32]], ids=["aligned", "padded"])
def test_an_in_place_edit_of_the_output_is_refused_alike_in_every_mode_and_a_clone_trains(mode, cu):
    """On main `out.add_(1)` raised autograd's error in the ring and the all-gather (they save the output) and
    passed elsewhere. Now refused in every mode and layout, naming CPAttentionOutput; a clone trains, and
    without autograd the output is an ordinary tensor."""
    from tests.helpers import random_qkv

    for layout in cpref.LAYOUTS:
        s = cpref.Sharding.eod_padded(cu, cp_size=2, layout=layout)
        q, k, v = (s.pad(t) for t in random_qkv(cu[-1], 4, 2, 8))

        def rank(comm, s=s, q=q, k=k, v=v):  # this layout's, bound
            local = [s.shard(t, comm.rank).detach().requires_grad_() for t in (q, k, v)]
            run = lambda: cpref.attention(*local, s, comm=comm, mode=mode, **cpref.MODES[mode].example_options(2))  # noqa: E731
            with pytest.raises(RuntimeError, match="Output 0 of CPAttentionOutput is a view and is being modified "
                                                   "inplace.*cloning the output"):  # fmt: skip
                run().add_(1)
            out = run()
            out.clone().mul_(2).sum().backward()  # the edit of a clone: gradient 2 everywhere
            grads = [t.grad.clone() for t in local]
            for t in local:
                t.grad = None
            (2 * run()).sum().backward()
            with torch.no_grad():
                run().add_(1)  # no autograd: edited in place
            return all(torch.equal(a, t.grad) for a, t in zip(grads, local))

        assert SimCluster(2).run(rank) == [True, True], layout


def test_ranks_that_train_with_other_settings_are_refused_alike_before_any_step():
    """On main a rank alone with other micro-batches waited in another collective than its peers."""
    from cpref.train.training import PackSource, Topology, TrainConfig, train

    def rank(comm):
        model = torch.nn.Linear(2, 2)
        try:
            train(model, torch.optim.SGD(model.parameters(), lr=0.1), PackSource(lambda: iter([]), 8),
                  Topology(comm, comm), TrainConfig(mode="p2p", micro_batches=1 + (comm.rank == 2)), 1)  # fmt: skip
        except CPInputError as err:
            return str(err)

    cluster = SimCluster(3, timeout=20.0)
    results = cluster.run(rank)
    assert len(set(results)) == 1 and "config: rank 0, rank 1 vs rank 2" in results[0]
    assert [(e.op, e.param) for e in cluster.trace] == [("all_gather", "host")]
