"""`TorchComm` on gloo: every collective against independently built tensors, in one launch.

One world of 4 processes runs every case of `gloo_cases` (process start-up costs seconds;
collectives cost milliseconds), and one test reads every case's outcome on every rank (one
test, not one per case, so that `pytest -n auto` does not start the world once per worker).
Groups: the world (P=4), splits into {0,2},{1,3} (non-consecutive), {2,0},{3,1} (listed
order), {0,1},{2,3}, {0,1,2},{3} (P=3 and P=1), and the CP axis of 2x2 DeviceMeshes with
axes ("dp", "cp") and ("cp", "dp"); dtypes float16, bfloat16, float32, float64.

The launch runs without `check_calls` (the raw backend, as in production and timings); the
fault tests of `test_launch.py` run with it.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from cpref.base.errors import CPInputError
from cpref.comm import TorchComm, default_exchange, unsupported_ops
from sim.tools.launch import launch
from tests.backends import gloo_cases


def test_every_collective_on_every_group_and_dtype():
    outcomes = launch(gloo_cases.run_all_cases, 4, args=("tag",), timeout=60.0, check_calls=False)
    # launch hands back each rank's result, in rank order (rank, world size, torch threads, argument)
    assert [out.pop("whoami") for out in outcomes] == [(r, 4, 1, "tag") for r in range(4)]
    names = gloo_cases.CASES + list(gloo_cases.EXTRA)
    assert [sorted(out) for out in outcomes] == [sorted(names)] * 4
    failed = [f"{name} on rank {rank}:\n{out[name]}" for name in names for rank, out in enumerate(outcomes) if out[name]]
    assert not failed, f"{len(failed)} case(s) failed:\n" + "\n".join(failed)


@pytest.mark.full
def test_ranks_that_differ_in_grad_mode_or_sinks_raise_on_every_gloo_process_in_every_mode():
    """Issue 56, items 5 and 2, on 4 gloo processes (`gloo_cases.grad_mode_and_sinks_divergence`), with a process-group
    timeout of 20 s: without the comparison's columns, rank 0's backward waited in the mode's collectives for rank 1,
    which never made them, until that timeout (61.7 s at 60 s), and other sinks values gave no error."""
    outcomes = launch(gloo_cases.grad_mode_and_sinks_divergence, 4, timeout=20.0)
    assert outcomes == [sorted(cpref.MODES)] * 4


def test_gloo_exchanges_pairwise_unless_torch_checks_the_calls(monkeypatch):
    """Pairwise on gloo, except under TORCH_DISTRIBUTED_DEBUG=DETAIL, whose mismatch check
    covers collectives only; NCCL and HCCL keep their collectives."""
    import torch.distributed as dist

    assert [default_exchange(b) for b in ("gloo", "cpu:gloo,cuda:nccl", "nccl", "hccl")] == ["p2p", "p2p", "native", "native"]
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.DETAIL)
    assert default_exchange("gloo") == "native"


@pytest.mark.parametrize("size", range(1, 10))
def test_hccl_limits_are_known_up_front(size):
    expected = {"all_gather", "reduce_scatter"} if size in (3, 5, 6, 7) else set()
    assert unsupported_ops("hccl", size) == expected
    assert unsupported_ops("HCCL", size) == expected
    assert unsupported_ops("gloo", size) == unsupported_ops("nccl", size) == frozenset()


def test_only_a_gloo_older_than_bfloat16_support_widens_a_dtype(monkeypatch):
    """gloo gained bfloat16 around torch 2.2: before 2.3 it travels as float32, from then on nothing is widened."""
    from cpref.comm.capabilities import widened_dtypes

    assert widened_dtypes("gloo") == widened_dtypes("nccl") == {}  # the pinned torch
    monkeypatch.setattr(torch, "__version__", "2.2.1+cpu")
    assert widened_dtypes("gloo") == widened_dtypes("GLOO") == {torch.bfloat16: torch.float32}
    assert widened_dtypes("nccl") == widened_dtypes("hccl") == {}
    monkeypatch.setattr(torch, "__version__", "2.3.0")
    assert widened_dtypes("gloo") == {}


def test_torch_comm_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchComm()


def test_control_tensors_live_where_the_backend_carries_them(monkeypatch):
    """NCCL and HCCL carry no CPU tensors: the split digest must travel on the accelerator
    (seen on CUDA: "No backend type associated with device type cpu")."""
    from cpref.comm.capabilities import control_device
    from cpref.comm.torch_dist import TorchComm

    assert control_device("gloo") == torch.device("cpu")
    assert control_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert control_device("nccl") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert control_device("ucc") == torch.device("cuda", 3)  # another backend: torch's current accelerator

    comm = object.__new__(TorchComm)  # a communicator without a process group: only its all_reduce is called
    comm.device, comm.rank, comm.group = torch.device("meta"), 0, (0,)
    seen = []
    comm.all_reduce = lambda x, op="sum": seen.append(x.device) or torch.zeros(2, dtype=torch.int64)
    comm._check_same_partition(((0,),))
    assert seen == [torch.device("meta")]


def test_new_group_keeps_the_listed_order_or_refuses():
    """torch 2.11's new_group has no sort_ranks (seen on the GPU machine): ascending parts still
    work there, a part that sorting would renumber is refused instead of silently reordered."""
    from cpref.comm.capabilities import NEW_GROUP_PARAMS, new_group_options

    assert "sort_ranks" in NEW_GROUP_PARAMS  # the pinned torch keeps any order
    with_sort = {"ranks", "use_local_synchronization", "sort_ranks"}
    assert new_group_options([3, 1], with_sort) == {"use_local_synchronization": True, "sort_ranks": False}
    without = {"ranks", "use_local_synchronization"}
    assert new_group_options([1, 3], without) == {"use_local_synchronization": True}
    with pytest.raises(CPInputError, match=r"\[3, 1\].*ascending"):
        new_group_options([3, 1], without)


def test_a_part_this_torch_cannot_make_fails_on_every_rank(monkeypatch):
    """Without sort_ranks, a split whose *other* part is out of order must still fail on this
    rank too: a rank that went on to its own group would later wait for peers that raised."""
    import cpref.comm.capabilities as caps
    import cpref.comm.torch_dist as td

    monkeypatch.setattr(caps, "NEW_GROUP_PARAMS", frozenset({"ranks", "use_local_synchronization"}))
    monkeypatch.setattr(td.dist, "new_group", lambda *a, **k: pytest.fail("a group was made before the check"))
    comm = object.__new__(TorchComm)  # rank 0 of a group of 4 whose own part [0, 1] is ascending
    comm.rank, comm.size, comm.group, comm._splits = 0, 4, (0, 1, 2, 3), {}
    comm._check_same_partition = lambda parts: None
    with pytest.raises(CPInputError, match=r"\[3, 2\].*ascending"):
        comm.split([[0, 1], [3, 2]])
