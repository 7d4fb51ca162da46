"""One run at a time saves into a checkpoint directory (issue 56, item 4).

Was: two runs saving into one target at once (a requeued job whose first copy still runs) deleted each
other's live `DIR.tmp`, and one swapped a half-written directory in: the last good checkpoint and its `.old`
were gone (1 in 10 to 5 in 12 tries), and one of the runs exited 0. Now the second run is refused before its
first step, on every rank, and a dead run holds nothing.
"""

from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import cpref.train.checkpoint_lock as lk
from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as cf
from cpref.train.checkpoint import check_save, read_meta
from sim import SimCluster
from sim.tools.train import main, run_sim
from tests.training.test_checkpoint_safety import Steps, spec, tiny_presets, tree  # noqa: F401 (the fixture)
from tests.training.test_checkpoint_targets import snapshot

ROOT = Path(__file__).resolve().parents[2]
# a process holding DIR.lock as a cpref run does, in plain Python (it starts in milliseconds)
HOLDER = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
          "os.write(fd, (sys.argv[2] + f': pid {os.getpid()} on host-x, since noon\\n').encode()); print('held', flush=True); "
          "time.sleep(120)")  # fmt: skip


def hold_elsewhere(target: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(cf.lock_file(target)), cf.LOCK_HEADER], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    assert child.stdout.readline() == "held\n"
    return child


def test_a_run_saving_where_another_holds_the_lock_is_refused_before_its_first_step_and_a_dead_one_holds_nothing(
        tmp_path, capsys):  # fmt: skip
    c = tmp_path / "c"
    run_sim(spec(2, save=str(c)))
    child = hold_elsewhere(c)
    try:
        before, steps = tree(tmp_path), Steps()
        busy = rf"cannot save a checkpoint to {c}: another run is saving there \(pid {child.pid} on host-x, since noon\)"
        with pytest.raises(CPInputError, match=busy):
            run_sim(spec(4, resume=str(c), save=str(c), cp=4, overwrite=True), on_step=steps)
        assert steps.seen == [] and tree(tmp_path) == before
        with pytest.raises(CPInputError, match=busy) as err:  # the ranks' own lock, as where two runs race
            SimCluster(4).run(lambda world: lk.hold(c, world).__enter__())
        assert type(err.value) is CPInputError  # rank 0 failed to take it, and every rank raised alike
        assert tree(tmp_path) == before
        argv = ["--model", "llama", "--steps", "4", "--pack-tokens", "64", "--micro-batches", "2", "--mode", "p2p"]
        assert main([*argv, "--resume", str(c), "--save", str(c)]) == 2  # the command: refused before it starts
        assert capsys.readouterr().err.count("another run is saving there") == 1
        with pytest.raises(CPInputError, match=busy):  # a save of the library's own, without train
            lk.SaveLock(c).acquire()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL and cf.lock_file(c).is_file()  # it died holding it: the file stays
    run_sim(spec(4, resume=str(c), save=str(c)))  # the kernel let go with the process: the lock is taken over
    assert read_meta(c).step == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # its file deleted too


@pytest.mark.parametrize("kind", ["folder", "file of the user's", "link"])
def test_a_lock_file_that_is_not_cprefs_is_refused_and_kept(tmp_path, kind):
    c, lock = tmp_path / "c", cf.lock_file(tmp_path / "c")
    if kind == "folder":
        lock.mkdir()
    elif kind == "link":
        os.symlink(tmp_path / "elsewhere", lock)
    else:
        lock.write_text("my notes")
    before, steps = snapshot(tmp_path), Steps()
    with pytest.raises(CPInputError, match=rf"{lock} exists and is not cpref's lock file .*; choose another directory"):
        run_sim(spec(2, save=str(c)), on_step=steps)
    assert steps.seen == [] and snapshot(tmp_path) == before


def test_a_run_that_opened_the_file_as_its_holder_let_go_checks_what_it_locked(tmp_path, monkeypatch):
    """The holder deletes `DIR.lock` as it lets go; a run that opened the old file just before then locks a file
    no longer named `DIR.lock`: it must notice and open the new one (without that check, two runs held 'the' lock)."""
    c = tmp_path / "c"
    first = lk.SaveLock(c)
    first.acquire()  # holds the file now named c.lock
    orphan = tmp_path / "orphan"
    orphan.write_text("")
    late = lk.SaveLock(c)
    opened = iter([os.open(orphan, os.O_RDWR)])  # as if opened before a holder deleted it
    real = late._open
    monkeypatch.setattr(late, "_open", lambda: next(opened, None) or real())
    orphan.unlink()
    with pytest.raises(CPInputError, match="another run is saving there"):
        late.acquire()  # the orphan locked fine, but it is not c.lock: it tried again, and c.lock is held
    assert not late.held
    first.release()
    assert not cf.lock_file(c).exists()
    late.acquire()
    assert late.held and cf.lock_file(c).read_text().startswith(f"{cf.LOCK_HEADER}: pid {os.getpid()} ")
    late.release()


def test_a_filesystem_without_locks_warns_and_saves(tmp_path, monkeypatch):
    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lk.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match=r"this filesystem does not lock files \(No locks available\); a second run"):
        run_sim(spec(2, save=str(tmp_path / "c")))
    assert read_meta(tmp_path / "c").step == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_target_named_as_a_checkpoints_lock_is_refused(tmp_path):
    run_sim(spec(1, save=str(tmp_path / "c")))
    with pytest.raises(CPInputError, match="that is the name a save of the checkpoint .*c uses beside it"):
        check_save(tmp_path / "c.lock", 1)


# ---- the race itself, repeated, with the command (the slow tier) -------------------------------------------------
TRAIN = [sys.executable, "-m", "sim", "train", "--model", "llama", "--cp", "2", "--pack-tokens", "64", "--steps", "8",
         "--save-every", "1", "--overwrite"]  # fmt: skip


def start(c: Path) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, "--save", str(c)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_to_train(runs: list[subprocess.Popen]) -> subprocess.Popen:
    """The run that prints its step 0 first (a refused run ends without a line)."""
    with selectors.DefaultSelector() as sel:
        for r in runs:
            sel.register(r.stdout, selectors.EVENT_READ, r)
        while sel.get_map():
            for key, _ in sel.select(timeout=300):
                line = key.fileobj.readline()
                if line.startswith("step 0 "):
                    return key.data
                if not line:
                    sel.unregister(key.fileobj)
    raise AssertionError(f"no run trained: {[r.stderr.read()[-600:] for r in runs]}")


@pytest.mark.full
@pytest.mark.parametrize("when", ["together", "after the first's step 0"])
def test_two_runs_saving_into_one_target_end_with_one_refused_before_its_first_step(tmp_path, when):
    """`--overwrite` on both, so that only the lock can refuse one: each round, exactly one run trains and saves
    every step, the other is refused before its first step, and the checkpoint is the winner's last, complete.
    Both start at once and race for the lock, or the second starts once the first trains; the one that trains
    is then stopped (`SIGSTOP`: a job whose first copy still runs when it is requeued) until the other has
    ended, so that they overlap however the machine schedules them."""
    for round_ in range(3):
        c = tmp_path / f"r{round_}" / "c"
        runs = [start(c), start(c)] if when == "together" else [start(c)]
        try:
            trains = first_to_train(runs)
            os.kill(trains.pid, signal.SIGSTOP)
            if when != "together":
                runs.append(start(c))
            for r in runs:
                if r is not trains:
                    r.wait(timeout=300)
            os.kill(trains.pid, signal.SIGCONT)
            done = [(r.returncode, out, err) for r in runs for out, err in [r.communicate(timeout=300)]]
        finally:
            for r in runs:  # none left stopped or running, whatever failed
                if r.poll() is None:
                    os.kill(r.pid, signal.SIGCONT)
                    r.kill()
                    r.wait()
        won = [d for d in done if d[0] == 0]
        lost = [d for d in done if d[0] != 0]
        assert len(won) == 1 and len(lost) == 1, f"round {round_}: {[(d[0], d[2][-600:]) for d in done]}"
        assert "another run is saving there" in lost[0][2] and "step " not in lost[0][1], lost[0]
        assert read_meta(c).step == 8 and sorted(p.name for p in c.parent.iterdir()) == ["c"]
