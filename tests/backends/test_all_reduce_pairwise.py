"""`TorchComm.all_reduce` on gloo is two pairwise exchanges (issue 56, item 13: no gloo worker thread holds a tensor of
cpref's): the simulator's `native` fold, bit for bit, on every rank, for every op, dtype and shape."""

from __future__ import annotations

import pytest

from sim.tools.launch import launch
from tests.backends import launch_cases

pytestmark = pytest.mark.full  # processes


def test_the_pairwise_all_reduce_is_the_simulator_s_native_fold_bit_for_bit():
    wrong = launch(launch_cases.pairwise_all_reduce_against_the_simulator, 3, timeout=60.0, check_calls=False)
    assert wrong == [[], [], []]
