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

from cpref.backends import TorchComm, unsupported_ops
from sim.launch import launch
from tests.backends import gloo_cases


def test_every_collective_on_every_group_and_dtype():
    outcomes = launch(gloo_cases.run_all_cases, 4, args=("tag",), timeout=60.0, check_calls=False)
    # launch hands back each rank's result, in rank order (rank, world size, torch threads, argument)
    assert [out.pop("whoami") for out in outcomes] == [(r, 4, 1, "tag") for r in range(4)]
    names = gloo_cases.CASES + list(gloo_cases.EXTRA)
    assert [sorted(out) for out in outcomes] == [sorted(names)] * 4
    failed = [f"{name} on rank {rank}:\n{out[name]}" for name in names for rank, out in enumerate(outcomes) if out[name]]
    assert not failed, f"{len(failed)} case(s) failed:\n" + "\n".join(failed)


@pytest.mark.parametrize("size", range(1, 10))
def test_hccl_limits_are_known_up_front(size):
    expected = {"all_gather", "reduce_scatter"} if size in (3, 5, 6, 7) else set()
    assert unsupported_ops("hccl", size) == expected
    assert unsupported_ops("HCCL", size) == expected
    assert unsupported_ops("gloo", size) == unsupported_ops("nccl", size) == frozenset()


def test_torch_comm_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchComm()
