"""`sim.tools.launch` on gloo: every fault ends in a clear report, fast; a local launch listens on
loopback only; torchrun runs it unchanged.

(That results come back by rank is checked by the one launch of `test_torch_dist.py`; that ranks
die with a killed launcher, by `test_launch_watch.py`.)

The fault tests run with a process-group timeout of 120 s and must end in under 60 s (start-up
included, on a loaded machine), so a launcher that waited for the timeout instead of watching
its children fails them; except the faults only a timeout can end (a peer that neither calls
nor dies), which run with a 3 s timeout and must end within the grace period after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.tools.launch import _GRACE_S, LaunchFailure, launch, under_torchrun
from tests.backends import gloo_cases, launch_cases

ROOT = Path(__file__).resolve().parents[2]


def failing_launch(fn, nproc=2, timeout=120.0, **kw) -> tuple[LaunchFailure, float]:
    start = time.monotonic()
    with pytest.raises(LaunchFailure) as info:
        launch(fn, nproc, timeout=timeout, **kw)
    return info.value, time.monotonic() - start


def test_a_rank_that_raises_is_named_with_its_traceback():
    failure, elapsed = failing_launch(gloo_cases.raise_on_rank_1)
    assert (failure.root.rank, failure.root.kind, failure.root.exc_type) == (1, "raised", "ValueError")
    assert str(failure).startswith("rank 1 raised ValueError: rank 1 rejects its input (of 2 ranks)")
    assert "in raise_on_rank_1" in str(failure)  # the failing rank's traceback
    assert 0 in failure.failures and failure.results == {}
    assert elapsed < 60.0  # ended by the failure, not by the 120 s timeout


def test_a_rank_killed_mid_collective_is_reported_by_signal():
    failure, elapsed = failing_launch(gloo_cases.killed_mid_collective)
    assert (failure.root.rank, failure.root.kind, failure.root.exitcode) == (1, "died", -9)
    assert str(failure).startswith("rank 1 was killed by signal 9 (SIGKILL) without reporting a result")
    assert failure.failures[0].kind in ("raised", "terminated")  # the survivor lost its peer
    assert elapsed < 60.0


def test_mismatched_calls_raise_on_every_rank():
    failure, elapsed = failing_launch(gloo_cases.mismatched_shapes)
    assert {f.kind for f in failure.failures.values()} == {"raised"}
    assert "Detected mismatch between collectives" in str(failure)
    assert elapsed < 60.0


def test_mismatched_pairwise_exchange_aborts_instead_of_hanging():
    """Unchecked (`check_calls=False`), gloo's default pairwise all-gather of mismatched sizes
    does not hang: gloo aborts the receiving rank (its size message goes to that rank's stderr),
    and the launcher reports the rank killed by SIGABRT."""
    failure, elapsed = failing_launch(gloo_cases.mismatched_shapes, check_calls=False)
    assert "died" in {f.kind for f in failure.failures.values()}
    assert "SIGABRT" in str(failure)
    assert elapsed < 60.0


@pytest.mark.full
def test_a_silent_peer_is_named_with_its_stack():
    """Rank 1 sleeps outside any collective; rank 0 times out in the barrier (gloo's own timeout,
    unchecked). The root cause is rank 1, where it was, not rank 0."""
    failure, elapsed = failing_launch(gloo_cases.silent_peer, timeout=3.0, check_calls=False)
    assert (failure.root.rank, failure.root.kind) == (1, "hung")
    assert str(failure).startswith("rank 1 hung: it never reached the collective that rank 0 timed out in (of 2 ranks)")
    assert "stack of rank 1 when the launcher stopped it:" in str(failure)
    assert "in silent_peer" in failure.root.traceback  # faulthandler's frame: its time.sleep line
    waited = failure.failures[0]
    assert waited.kind == "raised" and "Timed out waiting 3000ms" in waited.message  # the configured 3 s
    assert time.time() - waited.at < _GRACE_S + 5.0  # the sleeping rank was stopped, not waited for
    assert elapsed < 60.0  # the silent rank sleeps for 120 s


@pytest.mark.full
def test_a_rank_waiting_in_a_collective_is_not_the_one_that_hung():
    """3 ranks (`launch_cases.one_never_arrives`): rank 2 hangs, rank 0 times out in the checked
    barrier, rank 1 is still waiting for rank 2 in a receive when the launcher stops it."""
    failure, elapsed = failing_launch(launch_cases.one_never_arrives, nproc=3, timeout=3.0)
    assert (failure.root.rank, failure.root.kind) == (2, "hung")
    assert "in one_never_arrives" in failure.root.traceback
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms" in failure.failures[0].message
    waiting = failure.failures[1]
    assert (waiting.kind, waiting.message) == ("terminated", "it was waiting in a collective")
    assert " in recv\n" in waiting.traceback  # torch.distributed's frame, where it waited
    assert "rank 1 was terminated by the launcher after another rank failed (it was waiting in a collective)" in str(failure)
    assert elapsed < 60.0


@pytest.mark.full
def test_after_a_real_error_a_rank_still_running_is_terminated_not_hung():
    failure, elapsed = failing_launch(launch_cases.raise_while_peer_sleeps)
    assert (failure.root.rank, failure.root.kind, failure.root.exc_type) == (0, "raised", "ValueError")
    assert (failure.failures[1].kind, failure.failures[1].traceback) == ("terminated", "")  # no stack asked for
    assert elapsed < 60.0


@pytest.mark.full
def test_a_local_launch_listens_on_loopback_only():
    """Every listening socket of the launcher and its ranks is bound to 127.0.0.1 or ::1 (gloo's
    own at least, so that the check can fail); the rendezvous file is gone after the launch."""
    exposed = launch(launch_cases.what_the_launch_exposes, 2, timeout=60.0)
    listening = {owner: addresses for rank in exposed for owner, addresses in rank["listening"].items()}
    assert listening["rank 0"] and listening["rank 1"], listening
    outside = [a for addresses in listening.values() for a in addresses if a.rsplit(":", 1)[0] not in ("127.0.0.1", "::1")]
    assert outside == [], f"listening beyond loopback: {listening}"
    # here the hostname may resolve to 127.0.0.1 anyway: that gloo was told to use loopback shows in its environment
    assert [rank["gloo_ifname"] for rank in exposed] == [os.environ.get("GLOO_SOCKET_IFNAME", "lo")] * 2
    store = Path(exposed[0]["store"])
    assert store.name == "store" and not store.parent.exists()


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="nproc"):
        launch(gloo_cases.whoami, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch(gloo_cases.whoami, 2, timeout=0)
    with pytest.raises(Exception, match="pickle|local object"):
        launch(lambda: None, 2)


@pytest.mark.full
def test_runs_in_process_under_torchrun(tmp_path):
    """`torchrun` sets RANK/WORLD_SIZE/LOCAL_RANK: launch runs fn in that process only."""
    assert not under_torchrun()
    script = tmp_path / "main.py"
    script.write_text(
        "import os, sys\n"
        "from sim.tools.launch import launch\n"
        "from tests.backends import gloo_cases\n"
        "if __name__ == '__main__':\n"
        # a file per worker: the two workers' writes to one shared stdout pipe interleave
        "    result = launch(gloo_cases.whoami, 99, args=('torchrun',), timeout=30.0)\n"
        "    with open(os.path.join(sys.argv[1], 'result-' + os.environ['RANK']), 'w') as f:\n"
        "        f.write(repr(result))\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = [(tmp_path / f"result-{r}").read_text() for r in range(2)]
    assert results == [f"[({r}, 2, 1, 'torchrun')]" for r in range(2)]


@pytest.mark.full
def test_a_group_split_from_the_world_times_out_as_the_world_does():
    """Issue 56, item 6: `TorchComm.split` passes the world's timeout to `new_group`. Rank 0 waits for a sleeping
    rank 1 in an all-reduce on the split group: the launch's 3 s end it (rank 1 named, hung); on main the group
    waited torch's default 30 minutes, so rank 0 waited until rank 1 woke after 40 s, and the launch succeeded."""
    failure, elapsed = failing_launch(launch_cases.stalls_in_a_split_group, timeout=3.0, args=(40.0,), check_calls=False)
    assert (failure.root.rank, failure.root.kind) == (1, "hung")
    assert "Timed out waiting 3000ms" in failure.failures[0].message
    assert elapsed < 35.0


@pytest.mark.full
def test_the_ranks_leave_ctrl_c_to_the_launcher():
    """Issue 56, item 12: Ctrl-C reaches every process of the job; the ranks start with SIGINT blocked, so that the
    launcher alone acts on it (it ends them); the launcher's own mask is as it was."""
    import signal

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert launch(launch_cases.blocked_signals, 2, timeout=60.0) == [["SIGINT"]] * 2
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_a_stopped_process_is_ended_by_sigterm_at_once():
    """`_stop` continues a stopped rank (SIGCONT) after its SIGTERM: it dies of that signal at once, instead of
    5 s later of SIGKILL."""
    import multiprocessing
    import signal

    from sim.tools.launch import _stop

    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60.0,))
    proc.start()
    os.kill(proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    _stop(proc, patience=0.0)
    assert proc.exitcode == -signal.SIGTERM and time.monotonic() - start < 4.0
