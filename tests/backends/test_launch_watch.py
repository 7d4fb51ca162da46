"""`sim.tools.launch_watch`: ranks die with their launcher; timeouts and collectives told by their text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.tools.launch import PREFIX, sweep
from sim.tools.launch_watch import in_collective, is_timeout

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = """
import sys
from sim.tools.launch import launch
from tests.backends import launch_cases
launch(launch_cases.pid_then_sleep, 2, args=(sys.argv[1],), timeout=120.0)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.full
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL runs no cleanup in the launcher: its ranks, mid-`fn`, must end by themselves."""
    (tmp_path / "tmp").mkdir()  # where the killed launcher leaves its temporary folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "TMPDIR": str(tmp_path / "tmp")}
    stderr = tmp_path / "stderr"  # a file, not a pipe: the ranks write to it too
    with stderr.open("w") as err:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=ROOT, env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    pid_files = [tmp_path / f"rank-{r}.pid" for r in range(2)]
    pids: list[int] = []
    try:
        started = _wait_for(lambda: all(p.exists() for p in pid_files) or launcher.poll() is not None, 60.0)
        assert started and launcher.poll() is None, f"no ranks started:\n{stderr.read_text()[-3000:]}"
        pids = [int(p.read_text()) for p in pid_files]
        assert all(_alive(pid) for pid in pids)
        launcher.kill()  # SIGKILL
        launcher.wait()
        assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 5.0), f"ranks {pids} outlived the launcher"
        # its folder is left behind, named for its pid; the next launch's sweep removes it, and keeps a live one's
        left = list((tmp_path / "tmp").glob(f"{PREFIX}{launcher.pid}-*"))
        assert len(left) == 1, list((tmp_path / "tmp").iterdir())
        live = tmp_path / "tmp" / f"{PREFIX}{os.getpid()}-alive"
        other = tmp_path / "tmp" / f"{PREFIX}x-notapid"
        live.mkdir(), other.mkdir()
        assert sweep(tmp_path / "tmp") == left and not left[0].exists() and live.is_dir() and other.is_dir()
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:  # on failure: no rank left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_timeouts_and_collectives_are_told_by_their_text():
    timeouts = [
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 3000ms for recv operation to complete",  # gloo, unchecked
        "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 3000 ms",  # check_calls=True
        "Wait timeout",  # the FileStore, waiting at the rendezvous
        "Timeout waiting for key: rank_1 after 3000 ms",
        "Application timeout caused pair closure",  # gloo, a pair an earlier timeout closed (a rank stopped in a save)
    ]
    assert all(is_timeout(text) for text in timeouts)
    assert not any(is_timeout(text) for text in ("Connection closed by peer [127.0.0.1]:4242", "rank 1 rejects its input"))
    stack = 'Current thread 0x00007f (most recent call first):\n  File "{}", line 5349 in barrier\n'
    assert in_collective(stack.format("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"))
    assert not in_collective(stack.format("/work/tests/backends/gloo_cases.py"))
    assert not in_collective("")
