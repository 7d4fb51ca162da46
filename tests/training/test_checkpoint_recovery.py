"""Recovery dead-ends after an interrupted save (issue 56, items 7 and 8).

7. Was: `SIGTERM` during the final deletion of `DIR.old` left it empty and unmarked, and every later save was
   refused ("DIR.old exists and was not written by cpref", which it was), `--overwrite` included. Now the mark
   goes last and a remainder is recognised: an interruption after any single deletion step (in-process, and a
   `SIGTERM` in a process of its own) leaves a state the next save cleans up.
8. Was: a complete `DIR.tmp` newer than `DIR` (a failure between writing it and the swap) was ignored by resume,
   which silently took the older step, and `--resume DIR --save DIR` was then refused naming the wrong step and
   suggesting the command just run. Now resume takes the newest complete one and says so, and the save goes on.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from cpref.base.errors import CPInputError
from cpref.train import checkpoint_files as cf
from cpref.train.checkpoint import TorchPayload, check_save, find_checkpoint, read_meta
from sim.tools.train import main, run_sim
from tests.training.test_checkpoint_safety import curve, spec, tiny_presets  # noqa: F401 (the fixture)
from tests.training.test_checkpoint_targets import one_rank_save


# ---- 8. a complete DIR.tmp newer than DIR -------------------------------------------------------------------------
def fail_the_swap_mark(monkeypatch) -> None:
    """The next save's swap finds no room for its `.cpref-old` mark (a full disk): the new checkpoint stays in DIR.tmp."""
    real = Path.write_text

    def write_text(self, text, *a, **kw):
        if self.name == cf.OLD_MARK:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    return lambda: monkeypatch.setattr(Path, "write_text", real)


def test_a_complete_tmp_newer_than_dir_is_resumed_from_said_and_saved_over(tmp_path, monkeypatch, capsys):
    whole = curve(run_sim(spec(6)))
    c, tmp = tmp_path / "c", tmp_path / "c.tmp"
    run_sim(spec(2, save=str(c)))
    restore = fail_the_swap_mark(monkeypatch)
    with pytest.raises(CPInputError, match=rf"the checkpoint of step 4 is complete in {tmp}, but could not be put in "
                                           rf"place of {c}: no space left on the device \(ENOSPC, {c}/.cpref-old\); "
                                           rf"resuming from {c} takes it"):  # fmt: skip
        run_sim(spec(4, resume=str(c), save=str(c)))
    restore()
    assert read_meta(c).step == 2 and read_meta(tmp).step == 4 and (tmp / cf.MARK).is_file()
    path, meta, note = find_checkpoint(c)
    assert (path, meta.step) == (tmp, 4)
    assert note == (f"{c} holds step 2, and a save interrupted before its swap left a newer one; resuming from {tmp}, "
                    "the newest complete one (step 4)")  # fmt: skip
    with pytest.raises(CPInputError, match=rf"{c} holds a checkpoint at step 4 \(in c.tmp, left by an interrupted save\); "
                                           "saving step 3 there would not move it forward"):  # fmt: skip
        check_save(c, 3, resumed=c)  # a run that loaded the older c by hand: the step named is the newest's
    argv = ["--model", "llama", "--steps", "5", "--pack-tokens", "64", "--micro-batches", "2", "--mode", "p2p"]
    assert main([*argv, "--resume", str(c)]) == 0  # resume only: says which, and trains from step 4
    err = capsys.readouterr().err
    assert note in err and f"resumed from {tmp} at step 4" in err
    rest = curve(run_sim(spec(6, resume=str(c), save=str(c))))
    assert rest == whole[4:]  # the interrupted save's step-4 checkpoint, continued bit for bit
    assert read_meta(c).step == 6 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the swap finished


class FullDisk(TorchPayload):
    def save(self, directory, model, optimizer, world):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "state.pt"))


def test_the_next_save_puts_the_newest_complete_one_in_place_before_it_writes(tmp_path):
    """The recovery itself: a complete DIR.tmp newer than DIR becomes DIR at the start of the next save, so that a
    failure of that save still leaves it (was: deleted as a leftover); an older or incomplete one is deleted."""
    c = tmp_path / "c"
    one_rank_save(c, 2)
    one_rank_save(tmp_path / "x", 5)
    (tmp_path / "x").rename(tmp_path / "c.tmp")
    (tmp_path / "c.tmp" / cf.MARK).write_text("")
    with pytest.raises(CPInputError, match="no space left on the device"):
        one_rank_save(c, 7, resumed=c, payload=FullDisk())
    assert read_meta(c).step == 5 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    one_rank_save(c, 7, resumed=c)
    assert read_meta(c).step == 7 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    one_rank_save(tmp_path / "y", 3)  # an older complete DIR.tmp: deleted, DIR kept
    (tmp_path / "y").rename(tmp_path / "c.tmp")
    (tmp_path / "c.tmp" / cf.MARK).write_text("")
    one_rank_save(c, 8, resumed=c)
    assert read_meta(c).step == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ---- 7. an interrupted deletion -----------------------------------------------------------------------------------
class Interrupt:
    """Count every `os.unlink` and `os.rmdir` of the save, and raise (as a signal would end it) at number `at`
    (not the empty directory the preflight makes and removes to prove the place writable: it holds no checkpoint)."""

    def __init__(self, monkeypatch, at: int | None):
        self.count, self.at, self.real = 0, at, (os.unlink, os.rmdir)
        monkeypatch.setattr(os, "unlink", self.wrap(os.unlink))
        monkeypatch.setattr(os, "rmdir", self.wrap(os.rmdir))
        self.undo = lambda: (monkeypatch.setattr(os, "unlink", self.real[0]), monkeypatch.setattr(os, "rmdir", self.real[1]))

    def wrap(self, fn):
        def call(*a, **kw):
            if os.path.basename(a[0]).startswith(".cpref-probe-"):
                return fn(*a, **kw)
            if self.count == self.at:
                raise KeyboardInterrupt(f"interrupted before removal {self.at}")
            self.count += 1
            return fn(*a, **kw)

        return call


def payloads():
    from cpref.train.checkpoint import TorchPayload
    from cpref.train.dcp import DcpPayload

    return {"torch": TorchPayload(), "dcp": DcpPayload(local=True)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_save_interrupted_at_any_removal_leaves_what_the_next_save_cleans_up(tmp_path, monkeypatch, fmt):
    payload = payloads()[fmt]
    one_rank_save(tmp_path / "n" / "c", 1, payload=payload)
    probe = Interrupt(monkeypatch, None)  # a save that runs through: how many removals it makes
    one_rank_save(tmp_path / "n" / "c", 2, payload=payload, resumed=tmp_path / "n" / "c")
    probe.undo()
    assert probe.count >= 5  # the old checkpoint's files, its mark, the directory (and dcp/ in that format)
    for at in range(probe.count):
        c = tmp_path / str(at) / "c"
        one_rank_save(c, 1, payload=payload)
        cut = Interrupt(monkeypatch, at)
        with pytest.raises(KeyboardInterrupt):
            one_rank_save(c, 2, payload=payload, resumed=c)
        cut.undo()
        found, meta, _ = find_checkpoint(c)
        assert meta.step in (1, 2), at  # a complete checkpoint, whatever was cut
        check_save(c, 3, resumed=c)  # not refused
        one_rank_save(c, 3, payload=payload, resumed=c)
        assert read_meta(c).step == 3 and sorted(p.name for p in c.parent.iterdir()) == ["c"], at


def test_a_failure_to_delete_the_previous_checkpoint_says_the_new_one_is_in_place(tmp_path, monkeypatch):
    import cpref.train.checkpoint_swap as cs

    c = tmp_path / "c"
    one_rank_save(c, 1)
    real = cs.delete

    def refused(path, mark):
        raise PermissionError(errno.EACCES, "Permission denied", str(path / "state.pt"))

    monkeypatch.setattr(cs, "delete", refused)
    with pytest.raises(CPInputError, match=rf"^the checkpoint of step 2 is in place in {c}, but the previous one in "
                                           rf"{c}.old could not be deleted: Permission denied \(EACCES, "
                                           rf"{c}.old/state.pt\); the next save deletes it; change that, or save "
                                           "elsewhere$"):  # fmt: skip
        one_rank_save(c, 2, resumed=c)
    monkeypatch.setattr(cs, "delete", real)
    assert read_meta(c).step == 2 and find_checkpoint(c)[0] == c
    one_rank_save(c, 3, resumed=c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


@pytest.mark.parametrize("left", ["the mark alone", "an empty directory", "a marked remainder"])
def test_a_deletion_cut_short_is_recognised_as_cprefs(tmp_path, left):
    c, old = tmp_path / "c", tmp_path / "c.old"
    one_rank_save(c, 1)
    one_rank_save(tmp_path / "x", 0)
    (tmp_path / "x").rename(old)
    (old / cf.OLD_MARK).write_text("")
    for f in sorted(old.iterdir()):
        if left == "an empty directory" or f.name != cf.OLD_MARK and (left == "the mark alone" or f.name == "state.pt"):
            f.unlink()
    assert cf.is_ours(old, cf.OLD_MARK)
    one_rank_save(c, 2, resumed=c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    (old / "sub").mkdir(parents=True)  # but a folder with anything of the user's in it is not
    (old / "sub" / "notes.txt").write_text("mine")
    assert not cf.is_ours(old, cf.OLD_MARK)
    with pytest.raises(CPInputError, match="c.old exists and was not written by cpref"):
        check_save(c, 3, resumed=c)


def killed_at(c: Path, payload, at: int, count_file: Path) -> bool:
    """Save step 2 over `c` in a process of its own (forked), which a `SIGTERM` ends (its default action: at once)
    at removal number `at`; whether it was killed (else it writes the number of removals it made to `count_file`)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            count = [0]

            def wrap(fn):
                def call(*a, **kw):
                    if not os.path.basename(a[0]).startswith(".cpref-probe-"):  # the preflight's, not the save's
                        if count[0] == at:
                            os.kill(os.getpid(), signal.SIGTERM)
                        count[0] += 1
                    return fn(*a, **kw)

                return call

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.unlink, os.rmdir = wrap(os.unlink), wrap(os.rmdir)
            one_rank_save(c, 2, payload=payload, resumed=c)
            count_file.write_text(str(count[0]))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status) or os.WTERMSIG(status) == signal.SIGTERM, status
    return os.WIFSIGNALED(status)


@pytest.mark.full
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_sigterm_at_any_removal_of_a_save_leaves_what_the_next_save_cleans_up(tmp_path, fmt):
    payload, count = payloads()[fmt], tmp_path / "count"
    at = 0
    while not count.exists():  # until the save runs through: every removal it makes has had its signal
        c = tmp_path / str(at) / "c"
        one_rank_save(c, 1, payload=payload)
        killed = killed_at(c, payload, at, count)
        assert killed != count.exists(), at
        one_rank_save(c, 3, payload=payload, resumed=c)  # never refused: whatever the signal left is cpref's
        assert read_meta(c).step == 3 and sorted(p.name for p in c.parent.iterdir()) == ["c"], at
        at += 1
    assert int(count.read_text()) == at - 1 >= 5
