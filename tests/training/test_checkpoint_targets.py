"""A save never destroys or corrupts what is not its own, and every target problem is one line before training.

The cases of issue 41, each failing on the main it was filed against: a save over a checkpoint into which the
user put a folder and a notes file (it replaced them), a target inside the checkpoint being resumed (the outer
one no longer loaded), a target under a regular file (a raw `NotADirectoryError` after training), a fresh run
saving over another run's checkpoint; and of issue 56: a checkpoint (or a folder in it, or a leftover beside it)
that cannot be changed, read-only or immutable, passed the preflight and failed after training. Then a fuzz over
directory states (user files and folders, links, siblings that are a save's leftovers or the user's copies,
nested targets, truncated and edited files, and the class "concurrent saves": a `DIR.lock` held by another run,
left by a dead one, or the user's): a save either writes a complete checkpoint and changes nothing but cpref's
own files, or is refused in one line before anything changes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpref.train.checkpoint_files as cf
import cpref.train.checkpoint_lock as lk
from cpref.base.errors import CPInputError
from cpref.comm.protocol import SingleRank
from cpref.train.checkpoint import CheckpointMeta, check_save, find_checkpoint, read_meta, save_checkpoint
from sim.tools.train import main, run_sim
from tests.training.test_checkpoint_safety import Steps, spec, tiny_presets, tree  # noqa: F401 (the fixture)


def one_rank_save(directory, step, **kw) -> Path:
    """A tiny model's checkpoint, written on one rank (no training)."""
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    meta = CheckpointMeta(step, 1, 1, "p2p", "zigzag", 1, {"family": "linear"}, {"lr": 1e-3})
    return save_checkpoint(directory, model, torch.optim.SGD(model.parameters(), lr=1e-3), meta, SingleRank(), **kw)


# ---- the cases of the issue ---------------------------------------------------------------------------------------
def test_a_save_over_a_checkpoint_holding_the_users_files_is_refused_and_keeps_them(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "c")))
    (tmp_path / "c" / "notes.txt").write_text("what I tried")
    (tmp_path / "c" / "plots").mkdir()
    (tmp_path / "c" / "plots" / "loss.png").write_bytes(b"png")
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match=r"it is a checkpoint but it holds notes.txt, plots/, which cpref did not "
                                           r"write; .* never deletes yours"):  # fmt: skip
        run_sim(spec(4, save=str(tmp_path / "c")), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before


def test_a_target_inside_the_checkpoint_being_resumed_is_refused(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "c")))
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match=r"it is inside the checkpoint .*/c, which would then hold files its sums do "
                                           "not list"):  # fmt: skip
        run_sim(spec(4, resume=str(tmp_path / "c"), save=str(tmp_path / "c" / "inner")), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before
    read_meta(tmp_path / "c")  # it still loads


def test_a_target_under_a_file_or_where_nothing_can_be_written_is_refused_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    argv = ["--model", "llama", "--steps", "2", "--pack-tokens", "64"]
    assert main([*argv, "--save", str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "afile is a file, not a directory; name a directory to save into" in err

    def no_writes(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cf.tempfile, "mkdtemp", no_writes)  # as root, a mode of 0o555 does not stop a write
    assert main([*argv, "--save", str(tmp_path / "ro" / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"nothing can be written in {tmp_path} (PermissionError: Permission denied)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@contextlib.contextmanager
def frozen(path: Path, root: Path):
    """`path` made unchangeable: immutable (`chattr +i`) as root, whom a mode of 0o555 does not stop; else 0o555.
    Undone under `root`, wherever a save that should not have run moved it."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("as root, only an immutable directory cannot be changed, and chattr +i fails here")
        undo = ["chattr", "-R", "-i", str(root)]
    else:
        path.chmod(0o555)
        undo = ["chmod", "-R", "u+w", str(root)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True, capture_output=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("what", ["the checkpoint", "a folder in it", "a leftover beside it"])
def test_a_checkpoint_directory_that_cannot_be_changed_is_refused_before_training(tmp_path, capsys, what):
    """Was: the preflight tried only the parent; the run trained, and its save failed with a 52-line PermissionError
    (a save writes its mark into the checkpoint and deletes the previous one's files, and leftovers beside it)."""
    from cpref.models import CausalLM
    from cpref.train.dcp import DcpPayload

    c = tmp_path / "c"
    run = spec(2, save=str(c))
    model = CausalLM(run.model_config(), seed=0)
    payload = DcpPayload(local=True) if what == "a folder in it" else None  # a checkpoint with a folder: dcp/
    save_checkpoint(c, model, torch.optim.AdamW(model.parameters()), run.meta(2), SingleRank(), payload)
    if what == "a leftover beside it":
        (tmp_path / "c.old").mkdir()
        (tmp_path / "c.old" / cf.OLD_MARK).write_text("")  # what a deletion cut short leaves
    locked = {"the checkpoint": c, "a folder in it": c / "dcp", "a leftover beside it": tmp_path / "c.old"}[what]
    argv = ["--model", "llama", "--steps", "3", "--pack-tokens", "64", "--micro-batches", "2", "--mode", "p2p"]
    with frozen(locked, tmp_path):
        before = tree(tmp_path)
        assert main([*argv, "--resume", str(c), "--save", str(c)]) == 2
        out, err = capsys.readouterr()
        assert tree(tmp_path) == before
    assert "step " not in out and err.count("\n") == 1, err
    assert f"cannot save a checkpoint to {c}: this process may not change {locked} (read-only, immutable" in err
    assert "make it writable (chmod u+w, chattr -i) or save elsewhere" in err


def test_a_fresh_run_does_not_replace_another_runs_checkpoint_unless_told_to(tmp_path):
    """On main a new run with the same --save replaced a checkpoint at an earlier step at its first save."""
    run_sim(spec(2, save=str(tmp_path / "c")))
    before, steps = tree(tmp_path), Steps()
    with pytest.raises(CPInputError, match="holds a checkpoint at step 2 that this run does not continue"):
        run_sim(spec(4, save=str(tmp_path / "c")), on_step=steps)
    assert steps.seen == [] and tree(tmp_path) == before
    run_sim(spec(4, save=str(tmp_path / "c"), overwrite=True))
    assert read_meta(tmp_path / "c").step == 4


def test_overwrite_still_keeps_the_users_files(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "c")))
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(CPInputError, match="it is a checkpoint but it holds notes.txt"):
        run_sim(spec(4, save=str(tmp_path / "c"), overwrite=True))
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_a_file_that_appears_during_training_stops_the_save_and_keeps_both(tmp_path):
    run_sim(spec(2, save=str(tmp_path / "c")))
    drop = lambda s: (tmp_path / "c" / "notes.txt").write_text("mine") if s.step == 3 else None  # noqa: E731
    with pytest.raises(BaseException, match="now holds files cpref did not write .*complete in .*c.tmp"):
        run_sim(spec(4, resume=str(tmp_path / "c"), save=str(tmp_path / "c")), on_step=drop)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine" and read_meta(tmp_path / "c.tmp").step == 4
    assert (tmp_path / "c.tmp" / cf.MARK).is_file()  # still the save's own: the user may rename it in place


def test_a_link_inside_a_checkpoint_is_the_users(tmp_path):
    path = one_rank_save(tmp_path / "c", 1)
    (tmp_path / "elsewhere").write_text("x")
    os.symlink(tmp_path / "elsewhere", path / "state-link.pt")
    assert cf.foreign(path) == ["state-link.pt"] and not cf.is_ours(path)


def test_a_target_that_is_a_link_is_refused_not_followed(tmp_path):
    """On main the link was resolved: a save onto a link to another checkpoint replaced that checkpoint."""
    other = one_rank_save(tmp_path / "other", 1)
    os.symlink(other, tmp_path / "c")
    before = tree(tmp_path)
    with pytest.raises(CPInputError, match=r"c: it is a link \(to .*other\), and a save would replace what it points to"):
        check_save(tmp_path / "c", 2, overwrite=True)
    assert tree(tmp_path) == before and read_meta(other).step == 1


def test_a_checkpoint_that_does_not_verify_is_replaced_only_deliberately(tmp_path, capsys):
    """On main an edited (or damaged) checkpoint counted as none at all: a fresh run's save replaced it unasked."""
    path = one_rank_save(tmp_path / "c", 3)
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CPInputError, match=r"holds a checkpoint that does not verify \(.*state.pt \(SHA-256 differs\)\); "
                                           r"a save would replace it"):  # fmt: skip
        check_save(path, 9)
    assert check_save(path, 9, overwrite=True) == path
    argv = ["--model", "llama", "--steps", "2", "--pack-tokens", "64"]
    for flag in ("--save", "--resume"):  # one line each, before training
        assert main([*argv, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "state.pt (SHA-256 differs)" in err, err


def test_a_name_too_long_for_the_filesystem_is_refused_before_training(tmp_path, capsys):
    """On main an OSError traceback: the name fits, the DIR.tmp beside it does not (or the name itself does not)."""
    argv = ["--model", "llama", "--steps", "2", "--pack-tokens", "64"]
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for name, flags in (("a" * (limit - 2), ["--save"]), ("b" * (limit + 1), ["--save", "--resume"])):
        for flag in flags:
            assert main([*argv, flag, str(tmp_path / name)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "File name too long" in err, err
    assert main([*argv, "--resume", str(tmp_path / ("a" * (limit - 2)))]) == 2  # its DIR.tmp cannot exist: not looked for
    assert "no checkpoint to resume from at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ---- the fuzz over directory states -------------------------------------------------------------------------------
KINDS = ["absent", "empty dir", "user file", "user dir", "checkpoint", "checkpoint + user file", "checkpoint + link",
         "truncated checkpoint", "edited state", "edited meta", "save leftover", "edited leftover", "user copy",
         "dangling link", "link to a file", "link to a dir", "link to a checkpoint"]  # fmt: skip
LINKS = {"dangling link": "nowhere", "link to a file": "outside.txt", "link to a dir": "elsewhere",
         "link to a checkpoint": "elsewhere-ckpt"}  # fmt: skip


def make(path: Path, kind: str, mark: str | None, step: int) -> None:
    """Put a directory state of `kind` at `path` (`mark`: the one a save's leftover there carries)."""
    if kind == "absent":
        return
    if kind in LINKS:
        os.symlink(path.parent / LINKS[kind], path)
        return
    if kind == "user file":
        path.write_text("the user's")
        return
    if kind == "empty dir":
        path.mkdir()
        return
    if kind == "user dir":
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "data.bin").write_bytes(b"\1\2")
        return
    scratch = path.parent.parent / f"{path.parent.name}-scratch" / path.name
    one_rank_save(scratch, step)  # written elsewhere and moved in: the state, whatever a save would say of it
    shutil.move(scratch, path)
    if kind == "checkpoint + user file":
        (path / "notes.txt").write_text("the user's")
    elif kind == "checkpoint + link":
        os.symlink(path.parent / "outside.txt", path / "link")
    elif kind == "truncated checkpoint":
        (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:10])
    elif kind in ("edited state", "edited leftover"):  # the same length, other bytes: only its SHA-256 tells
        data = bytearray((path / "state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / "state.pt").write_bytes(bytes(data))
    elif kind == "edited meta":
        (path / "meta.json").write_text("{not json")
    if kind in ("save leftover", "edited leftover") and mark:
        (path / mark).write_text("")


def snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under `root`, links not followed: a file's bytes, None for a directory, `-> target` for a link."""
    out: dict[str, bytes | str | None] = {}
    for here, dirs, names in os.walk(root):
        for name in dirs + names:
            p = Path(here) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def owned(root: Path, state: dict) -> set[str]:
    """Paths of `state` (under `root`) that are cpref's: the files of a checkpoint dir that its meta.json lists."""
    out = set()
    for name in ("c", "c.tmp", "c.old"):
        d = root / name
        if d.is_dir() and not d.is_symlink():
            summed = cf._summed(d)
            if summed is None and not (d / cf.MARK).is_file():
                continue
            for rel in [*(summed or ()), *cf.NOT_SUMMED]:
                out |= {k for k in state if k == f"{name}/{rel}"}
    return out


def outside_state(root: Path) -> None:
    """What lies beside the states, for their links to point at: a file, a folder of the user's, a checkpoint."""
    (root / "outside.txt").write_text("the user's")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "data.bin").write_bytes(b"\3\4")
    make(root / "elsewhere-ckpt", "checkpoint", None, 7)


# the class "concurrent saves": the state of `DIR.lock`, the file a run saving to DIR locks
LOCKS = ["absent", "left by a dead run", "held by another run", "user file", "user dir", "link"]


def make_lock(path: Path, kind: str, stack: contextlib.ExitStack) -> None:
    """Put a `DIR.lock` state of `kind` beside `path` (one held is let go when `stack` closes)."""
    file = cf.lock_file(path)
    if kind == "left by a dead run":  # its content, unlocked: the kernel let go with the process
        file.write_text(f"{cf.LOCK_HEADER}: pid 1 on gone, since then\n")
    elif kind == "held by another run":  # another open file of this process: flock tells them apart as two runs
        held = lk.SaveLock(path)
        held.acquire()
        stack.callback(held.release)
    elif kind == "user file":
        file.write_text("the user's")
    elif kind == "user dir":
        (file / "sub").mkdir(parents=True)
    elif kind == "link":
        os.symlink(path.parent / "outside.txt", file)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(KINDS), tmp=st.sampled_from(KINDS), old=st.sampled_from(KINDS),
       nested=st.booleans(), resume=st.booleans(), overwrite=st.booleans(), lock=st.sampled_from(LOCKS))  # fmt: skip
def test_a_save_changes_nothing_but_cpref_s_own_files_or_is_refused_in_one_line(tmp_path_factory, target, tmp, old,
                                                                                 nested, resume, overwrite, lock):  # fmt: skip
    with contextlib.ExitStack() as stack:
        check_one_state(tmp_path_factory.mktemp("state"), target, tmp, old, nested, resume, overwrite, lock, stack)


def check_one_state(root: Path, target, tmp, old, nested, resume, overwrite, lock, stack) -> None:
    outside_state(root)
    make(root / "c", target, None, 3)
    make(root / "c.tmp", tmp, cf.MARK, 5)
    make(root / "c.old", old, cf.OLD_MARK, 2)
    make_lock(root / "c", lock, stack)
    dest = root / "c" / "inner" if nested else root / "c"
    before = snapshot(root)
    mine = owned(root, before) | ({"c.lock"} if lock == "left by a dead run" and not nested else set())  # cpref's
    if resume:  # what a resume finds there: a checkpoint, or one line naming each candidate
        try:
            find_checkpoint(root / "c")
        except CPInputError as err:
            assert "\n" not in str(err)
        assert snapshot(root) == before
    try:
        check_save(dest, 9, overwrite=overwrite, resumed=root / "c" if resume else None)
    except CPInputError as err:
        assert "\n" not in str(err) and snapshot(root) == before  # refused in one line, nothing changed
        return
    try:
        one_rank_save(dest, 9, overwrite=overwrite, resumed=root / "c" if resume else None)
    except CPInputError as err:  # only another run's lock refuses a save check_save let through
        assert lock == "held by another run" and not nested and "another run is saving there" in str(err), err
        assert "\n" not in str(err) and snapshot(root) == before
        return
    assert lock != "held by another run" or nested, "a save went on while another run held the lock"
    after = snapshot(root)
    for rel, data in before.items():
        if rel not in mine and not (data is None and rel in ("c", "c.tmp", "c.old")):
            assert after.get(rel, "gone") == data, f"{rel} ({target}, {tmp}, {old}) changed"
    assert read_meta(dest).step == 9 and cf.foreign(dest) == []
    for sibling, mark in zip(cf.siblings(dest), (cf.MARK, cf.OLD_MARK)):
        assert not cf.is_ours(sibling, mark)  # no leftover of a save beside it
    assert not os.path.lexists(cf.lock_file(dest))  # nor its lock
