"""`python -m sim train` stops early in one line and an exit status of its own (`sim.tools.stops`), in process.

Issue 56, items 6 and 12. On the simulated cluster: a stalled rank named after `--timeout`, Ctrl-C, a refusal and
a rank's own error while the run trains; how each failure of gloo processes (`LaunchFailure`) is reported, from
failures built here; and the last checkpoint, read from the disk. Real processes and real signals are in
`test_train_signals.py` (full tier).
"""

from __future__ import annotations

import threading
import time

import pytest

import cpref.train.checkpoint as ck
from cpref.base.errors import CPInputError, NonFiniteStepError
from sim.tools.launch import LaunchFailure, RankFailure
from sim.tools.stops import STATUS, last_checkpoint, report, stopped
from sim.tools.train import main
from tests.training.test_parity import TINY

ARGS = ["--model", "llama", "--pack-tokens", "64"]


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    import sim.tools.train

    monkeypatch.setattr(sim.tools.train, "PRESETS", TINY)


def on_step_at(monkeypatch, step: int, action):
    """Make rank 0's per-step print (`_print_step`, rank 0 only) run `action()` at `step`."""
    import sim.tools.train

    printed = sim.tools.train._print_step

    def print_step(s):
        printed(s)
        if s.step == step:
            action()

    monkeypatch.setattr(sim.tools.train, "_print_step", print_step)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err), err
    return err[-1]


def test_a_stalled_rank_is_named_after_the_timeout(monkeypatch, capsys):
    """Rank 0 stalls outside any collective at step 1; rank 1 waits `--timeout 0.5` s for it in its next collective.
    Exit status 4, one line naming rank 0 and where it was (was: no --timeout, and 600 s of silence)."""
    release, stalled = threading.Event(), []

    def stall():
        stalled.append(time.monotonic())
        release.wait(60.0)

    on_step_at(monkeypatch, 1, stall)
    try:
        assert main([*ARGS, "--steps", "5", "--timeout", "0.5"]) == STATUS["timeout"] == 4
        assert time.monotonic() - stalled[0] < 5.0  # timeout + margin (0.5 s each), and slack for a busy machine
    finally:
        release.set()  # the stalled rank goes on, and ends at its next collective
        for t in threading.enumerate():
            if t.name.startswith("sim-rank-"):
                t.join(30.0)
    line = one_line(capsys)
    assert line.startswith("python -m sim train: error: rank 0 stalled: the others waited 0.5 s (--timeout) for it in a "
                           "collective, and it was still running outside any collective after that; rank 0 was at File ")
    assert "threading.py\", line" in line and line.endswith(", in wait; no checkpoint was saved")  # its innermost frame


def test_ctrl_c_is_one_line_status_130_and_the_last_checkpoint(monkeypatch, capsys, tmp_path):
    """Ctrl-C (a KeyboardInterrupt in the main thread) at step 2 of a run saving every step: one line naming the
    checkpoint on the disk, status 130, and no rank thread left running (was: 71 lines of KeyboardInterrupt, and
    at times SIGABRT at exit, 'terminate called without an active exception')."""
    import _thread

    on_step_at(monkeypatch, 2, _thread.interrupt_main)
    save = tmp_path / "ckpt"
    assert main([*ARGS, "--steps", "50", "--save", str(save), "--save-every", "1"]) == STATUS["interrupted"] == 130
    path, meta, _ = ck.find_checkpoint(save)  # ckpt, or ckpt.tmp where the interrupt cut a save short
    assert meta.step >= 2  # the saves after steps 1 and 2 at least (the ranks go on until the main thread notices)
    aside = "" if path == save else f" (--resume {save} takes it)"
    assert one_line(capsys) == f"python -m sim train: interrupted; the last checkpoint is step {meta.step} in {path}{aside}"
    assert not [t for t in threading.enumerate() if t.name.startswith("sim-rank-") and t.is_alive()]


def test_a_refusal_while_the_run_trains_is_one_line_and_status_2(monkeypatch, capsys, tmp_path):
    """A `CPInputError` raised on one rank during the run (as a save that another run holds is refused): status 2,
    its message in one line, and the checkpoint saved before it (was: a 34-line traceback)."""

    def refuse():
        raise CPInputError("checkpoint ckpt is being saved by another run (pid 4242); wait for it, or save elsewhere")

    on_step_at(monkeypatch, 3, refuse)
    save = tmp_path / "ckpt"
    assert main([*ARGS, "--steps", "8", "--save", str(save), "--save-every", "2"]) == STATUS["refused"] == 2
    assert one_line(capsys) == ("python -m sim train: error: checkpoint ckpt is being saved by another run (pid 4242); "
                                f"wait for it, or save elsewhere; the last checkpoint is step 2 in {save}")  # fmt: skip


def test_a_rank_s_own_error_keeps_its_traceback_above_the_line(monkeypatch, capsys):
    def boom():
        raise RuntimeError("a bug in the loop")

    on_step_at(monkeypatch, 0, boom)
    assert main([*ARGS, "--steps", "3"]) == STATUS["failed"] == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "python -m sim train: error: rank 0 raised RuntimeError: a bug in the loop; no checkpoint was saved"
    assert "Traceback (most recent call last):" in err and "in boom" in "\n".join(err)


# --- gloo processes: each kind of LaunchFailure, built here ------------------------------------------------------


def launch_failure(*failures: RankFailure, nproc: int = 2) -> LaunchFailure:
    return LaunchFailure({f.rank: f for f in failures}, nproc, {})


GLOO = {
    "killed": (launch_failure(RankFailure(1, "died", exitcode=-9, at=1.0), RankFailure(0, "terminated", at=2.0)), 3,
               "rank 1 was killed by signal 9 (SIGKILL) without reporting a result"),
    "stopped": (launch_failure(RankFailure(0, "raised", "RuntimeError", "Rank 1 failed to pass monitoredBarrier in 30000 "
                                           "ms", at=1.0),
                               RankFailure(1, "hung", message="it is stopped (SIGSTOP, Ctrl-Z): no answer to the "
                                           "launcher's request for its stack", at=2.0)), 4,
                "rank 1 stalled: the others waited 30 s (--timeout) for it in a collective (rank 1: it is stopped "
                "(SIGSTOP, Ctrl-Z): no answer to the launcher's request for its stack)"),
    "refused": (launch_failure(RankFailure(1, "raised", "PeerInputError", "rank 0's checkpoint is refused\nmore", at=1.0)),
                2, "rank 0's checkpoint is refused"),
    "diverged": (launch_failure(RankFailure(0, "raised", "NonFiniteStepError", "step 3: the loss is nan", at=1.0)), 1,
                 "step 3: the loss is nan"),
    "deadlock": (launch_failure(RankFailure(0, "raised", "RuntimeError", "Timed out waiting 30000ms for recv", at=1.0),
                                RankFailure(1, "raised", "RuntimeError", "Timed out waiting 30000ms for send", at=1.1)),
                 4, "ranks 0, 1 waited 30 s (--timeout) in a collective that no rank stalled outside of: Timed out "
                 "waiting 30000ms for recv"),
    "bug": (launch_failure(RankFailure(1, "raised", "KeyError", "'x'", "Traceback ...\nKeyError: 'x'", at=1.0)), 3,
            "rank 1 raised KeyError: 'x'"),
}  # fmt: skip


@pytest.mark.parametrize("kind", GLOO)
def test_each_failure_of_gloo_processes_has_its_line_and_status(kind):
    failure, status, line = GLOO[kind]
    got, said, detail = stopped(failure, 30.0)
    assert (got, said) == (status, line)
    assert (detail == "traceback of rank 1:\nTraceback ...\nKeyError: 'x'") == (kind == "bug")


def test_the_rest_in_process():
    assert stopped(KeyboardInterrupt(), 1.0) == (130, "interrupted", "")
    assert stopped(NonFiniteStepError("step 1: nan"), 1.0) == (1, "step 1: nan", "")
    status, lines = report(CPInputError("a\n  b"), 1.0, (None, None), "prog")
    assert (status, lines) == (2, ["prog: error: a b; no checkpoint was saved"])  # one line, whatever the message


def test_the_last_checkpoint_is_read_from_the_disk(tmp_path):
    """The newest complete checkpoint of --save, else of --resume: what a process of the run wrote counts too."""
    from sim.tools.train import RunSpec, run_sim

    saved, other = tmp_path / "saved", tmp_path / "other"
    assert last_checkpoint((str(saved), None)) == "no checkpoint was saved"
    run_sim(RunSpec(model="llama", steps=2, pack_tokens=64, save=str(other)))
    assert last_checkpoint((str(saved), str(other))) == f"the last checkpoint is step 2 in {other}"
    run_sim(RunSpec(model="llama", steps=1, pack_tokens=64, save=str(saved)))
    assert last_checkpoint((str(saved), str(other))) == f"the last checkpoint is step 1 in {saved}"
