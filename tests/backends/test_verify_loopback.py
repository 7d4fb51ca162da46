"""`sim.tools.verify.loopback`: at CP size 1 a ring's sends to itself are local copies, so it is its own baseline.

An educational ring (`verify_impls.ring_rotating`: every score, softmax and merge in bf16, K/V rotated P times, the
last time home) sends to itself at CP size 1, which gloo refuses: without the loopback its rows fell back to SDPA
and eager. Held to SDPA in bf16 they fail (4-8x: its own bf16 rounding, not CP's); held to itself, through the
loopback, they pass. The loopback itself: sends and receives matched in posting order, either first; a receive no
send matches raises when waited on; groups of more than one rank untouched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from sim.tools import verify
from sim.tools.launch import launch
from sim.tools.verify.cases import Setup, build_cases
from sim.tools.verify.loopback import loopback
from tests.backends import wire_ranks

RING = "tests.backends.verify_impls:ring_rotating"
SETUP = Setup(docs=(256,), forward_only=True)


def test_an_all_bf16_ring_is_held_to_itself_at_cp_size_1_and_passes():
    cases = build_cases(["p2p"], ["contiguous", "zigzag"], ["bf16"], cp=2, impls=(RING,))
    own = verify.run(cases, SETUP, nproc=2, timeout=60.0, progress=False)
    assert own.ok and {r.baseline for r in own.rows} == {"impl"} and not any(r.note for r in own.rows), own.format()
    sdpa = verify.run(cases, dataclasses.replace(SETUP, baseline="sdpa"), nproc=2, timeout=60.0, progress=False)
    assert not any(r.ok for r in sdpa.rows) and min(r.ratio for r in sdpa.rows) > 2 * max(r.ratio for r in own.rows)


@pytest.fixture
def alone(tmp_path):
    """A gloo world of this one process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_self_sends_are_copies_matched_in_posting_order(alone):
    first, second = torch.zeros(3), torch.zeros(3)
    with loopback():
        waiting = dist.irecv(first, 0)  # a receive posted before its send
        dist.isend(torch.arange(3.0), 0)
        dist.send(torch.full((3,), 5.0), 0)
        assert dist.recv(second, 0) == 0
        waiting.wait()
    assert first.tolist() == [0.0, 1.0, 2.0] and second.tolist() == [5.0] * 3


def test_a_receive_no_send_matches_raises_and_the_functions_come_back(alone):
    originals = dist.isend, dist.batch_isend_irecv
    with loopback():
        work = dist.irecv(torch.zeros(4), 0)
        with pytest.raises(RuntimeError, match=r"a receive from itself \(CP size 1\) of shape \(4,\) that no send matched"):
            work.wait()
    assert (dist.isend, dist.batch_isend_irecv) == originals
    with pytest.raises(RuntimeError):  # gloo again: no send to oneself
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 0), dist.P2POp(dist.irecv, torch.ones(1), 0)])


def test_groups_of_several_ranks_go_to_torch_distributed():
    assert launch(wire_ranks.exchange_under_loopback, 2, timeout=60.0) == [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 7.0, 7.0]]
