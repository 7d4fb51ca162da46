"""`kill -9` during a training run with `--save-every`, on the simulated cluster and on gloo processes:
the resumed run continues the loss curve of an uninterrupted run to the last printed digit (issue 18)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # runs killed and resumed on gloo processes: make test-all

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "sim", "train", "--model", "llama", "--cp", "2", "--mode", "p2p", "--steps", "6",
         "--pack-tokens", "64"]  # fmt: skip


def start(backend: str, *args: str) -> subprocess.Popen:
    """The training command in a session of its own, so that one signal reaches the launcher and every rank."""
    return subprocess.Popen([*TRAIN, "--backend", backend, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def step_lines(out: str) -> dict[int, str]:
    """`{step: "loss ... grad_norm ..."}` from the printed lines (tokens_per_s is a timing, left out)."""
    lines = [line.split() for line in out.splitlines() if line.startswith("step ")]
    return {int(w[1]): " ".join(w[2:6]) for w in lines}


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_a_kill_at_a_random_step_resumes_to_the_last_digit_of_the_uninterrupted_run(tmp_path, backend):
    ckpt = str(tmp_path / "ckpt")
    kill_after = random.Random(1818).randrange(2, 5)  # a save (after step 1) has completed by then
    whole = start(backend)
    victim = start(backend, "--save", ckpt, "--save-every", "2")
    try:
        seen = []
        for line in victim.stdout:  # rank 0 prints one flushed line a step
            seen.append(line)
            if line.startswith(f"step {kill_after} "):
                os.killpg(victim.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run (maybe mid-save)
                break
        victim.wait(timeout=60)
        assert victim.returncode == -signal.SIGKILL, (victim.returncode, seen, victim.stderr.read())
        seen += victim.stdout.readlines()  # steps the run printed before the signal landed, after the one read
        out, err = whole.communicate(timeout=300)
        assert whole.returncode == 0, err
        resumed = start(backend, "--resume", ckpt, "--save", ckpt, "--save-every", "2")
        r_out, r_err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, r_err
    finally:
        for p in (whole, victim):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    reference, got = step_lines(out), step_lines(r_out)
    assert sorted(reference) == list(range(6)) and got, (out, r_out)
    first, last = min(got), max(step_lines("".join(seen)))  # each step is printed before its save
    assert first in (2, 4) and last + 1 - 2 <= first <= last + 1, (first, last)  # at most --save-every steps lost
    # on a mismatch, every run's lines: which of the three printed the odd value tells a resume fault from a run's
    assert got == {s: reference[s] for s in range(first, 6)}, (f"killed after step {last}, resumed at {first}; "
                                                               f"uninterrupted {reference}, killed {step_lines(''.join(seen))}, "
                                                               f"resumed {got}")  # fmt: skip
