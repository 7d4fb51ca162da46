"""A save never destroys or corrupts what is not its own, and every target problem is one line before training.

The cases of issue 41, each failing on the main it was filed against: a save over a checkpoint into which the
user put a folder and a notes file (it replaced them), a target inside the checkpoint being resumed (the outer
one no longer loaded), a target under a regular file (a raw `NotADirectoryError` after training), a fresh run
saving over another run's checkpoint. Then a fuzz over directory states (user files and folders, links,
siblings that are a save's leftovers or the user's copies, nested targets, truncated and edited files): a save
either writes a complete checkpoint and changes nothing but cpref's own files, or is refused in one line
before anything changes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpref.checkpoint_files as cf
from cpref.checkpoint import CheckpointMeta, check_save, read_meta, save_checkpoint
from cpref.comm import SingleRank
from cpref.errors import CPInputError
from sim.tools.train import main
from tests.training.test_checkpoint_safety import Steps, spec, tiny_presets, tree  # noqa: F401 (the fixture)
from sim.tools.train import run_sim


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


# ---- the fuzz over directory states -------------------------------------------------------------------------------
KINDS = ["absent", "empty dir", "user file", "user dir", "checkpoint", "checkpoint + user file", "checkpoint + link",
         "truncated checkpoint", "edited meta", "save leftover", "user copy"]  # fmt: skip


def make(path: Path, kind: str, mark: str | None, step: int) -> None:
    """Put a directory state of `kind` at `path` (`mark`: the one a save's leftover there carries)."""
    if kind == "absent":
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
    elif kind == "edited meta":
        (path / "meta.json").write_text("{not json")
    elif kind == "save leftover" and mark:
        (path / mark).write_text("")


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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(KINDS), tmp=st.sampled_from(KINDS), old=st.sampled_from(KINDS),
       nested=st.booleans(), resume=st.booleans(), overwrite=st.booleans())  # fmt: skip
def test_a_save_changes_nothing_but_cpref_s_own_files_or_is_refused_in_one_line(tmp_path_factory, target, tmp, old,
                                                                                 nested, resume, overwrite):  # fmt: skip
    root = tmp_path_factory.mktemp("state")
    (root / "outside.txt").write_text("the user's")
    make(root / "c", target, None, 3)
    make(root / "c.tmp", tmp, cf.MARK, 5)
    make(root / "c.old", old, cf.OLD_MARK, 2)
    dest = root / "c" / "inner" if nested else root / "c"
    before, mine = tree(root), owned(root, tree(root))  # mine: what cpref may replace or delete
    try:
        check_save(dest, 9, overwrite=overwrite, resumed=root / "c" if resume else None)
    except CPInputError as err:
        assert "\n" not in str(err) and tree(root) == before  # refused in one line, nothing changed
        return
    one_rank_save(dest, 9, overwrite=overwrite, resumed=root / "c" if resume else None)
    after = tree(root)
    for rel, data in before.items():
        if rel not in mine and not (data is None and rel in ("c", "c.tmp", "c.old")):
            assert after.get(rel, "gone") == data, f"{rel} ({target}, {tmp}, {old}) changed"
    assert read_meta(dest).step == 9 and cf.foreign(dest) == []
    for sibling, mark in zip(cf.siblings(dest), (cf.MARK, cf.OLD_MARK)):
        assert not cf.is_ours(sibling, mark)  # no leftover of a save beside it
