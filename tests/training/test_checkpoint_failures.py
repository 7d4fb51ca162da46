"""A save that fails says so in one line on every rank, frees what it wrote, and keeps the last checkpoint (issue 56,
item 10).

Was: a full disk during a save gave a 58-line traceback ending in `inline_container.cc ... unexpected pos` (the
simulated cluster) or 102 lines summarised `CheckpointException ranks:dict_keys([0, 1])` (gloo), no word of disk
space, and the partial `DIR.tmp` stayed, so the disk stayed full. Now: one line naming the cause, the file, the
bytes the save needs and those free when it began; no `DIR.tmp`; `DIR` as it was. In-process with a file that
fills up, then (the slow tier) the command on a small tmpfs, or under a file-size limit where none can be mounted,
on the simulated cluster and on gloo processes (`torch.distributed.checkpoint`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import cpref.train.checkpoint as ck
from cpref.base.errors import CPInputError
from cpref.train.checkpoint import CheckpointMeta, TorchPayload, read_meta, save_checkpoint
from cpref.train.checkpoint_errors import CheckpointWriteError, agree, explain
from sim import SimCluster
from sim.tools.train import run_sim
from tests.training.test_checkpoint_safety import spec, tiny_presets, tree  # noqa: F401 (the fixture)
from tests.training.test_checkpoint_targets import one_rank_save

ROOT = Path(__file__).resolve().parents[2]
NEEDS = r"the save needs about \d+\.\d MiB \(\d+ bytes\), and \d+\.\d MiB \(\d+ bytes\) were free when it began"


class FillsUp(io.RawIOBase):
    """A file on a device that is full after `room` bytes: the write that crosses it fails as a full disk does."""

    def __init__(self, name: str, room: int) -> None:
        self.name, self.room, self.size = name, room, 0
        self.real = open(name, "wb")  # noqa: SIM115 -- closed with this file

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.size + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device", self.name)
        self.size += len(data)
        return self.real.write(data)

    def close(self) -> None:
        self.real.close()
        super().close()


def test_a_full_disk_is_one_line_on_every_rank_the_partial_tmp_is_deleted_and_the_checkpoint_kept(tmp_path, monkeypatch):
    c = tmp_path / "c"
    run_sim(spec(2, save=str(c)))
    before = tree(tmp_path)
    monkeypatch.setattr(ck, "open", lambda name, mode: FillsUp(name, 4096), raising=False)  # torch.save's file
    with pytest.raises(CPInputError, match=rf"^could not write the checkpoint of step 3 to {c}.tmp: no space left on the "
                                           rf"device \(ENOSPC, {c}.tmp/state.pt\); {NEEDS}; {c} is as it was; "
                                           "free space there, or save elsewhere$") as err:  # fmt: skip
        run_sim(spec(3, resume=str(c), save=str(c), cp=4))
    assert type(err.value) is CheckpointWriteError  # every rank raised it alike (else a ClusterFailure)
    assert "\n" not in str(err.value) and "unexpected pos" not in str(err.value)
    assert tree(tmp_path) == before  # no c.tmp: the disk is freed; c byte for byte


class RankOneFails(TorchPayload):
    """A payload every rank writes a part of, whose rank 1 finds no room."""

    def save(self, directory, model, optimizer, world):
        (directory / f"part{world.rank}.pt").write_bytes(b"\0" * 10)
        if world.rank == 1:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(directory / "part1.pt"))


def test_a_failure_on_one_rank_alone_raises_the_same_error_on_every_rank(tmp_path):
    """Was: the rank that failed raised, and the others waited at the save's next barrier (a hang on gloo)."""
    model = torch.nn.Linear(3, 2)
    meta = CheckpointMeta(1, 1, 1, "p2p", "zigzag", 1, {"family": "linear"}, {"lr": 1e-3})
    with pytest.raises(CheckpointWriteError, match=r"the disk quota is exceeded \(EDQUOT, .*c.tmp/part1.pt\)"):
        SimCluster(3).run(lambda world: save_checkpoint(tmp_path / "c", model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                                        meta, world, RankOneFails()))  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # the partial c.tmp deleted, the lock let go


class RankTwoIsSlow(TorchPayload):
    """A payload every rank writes a part of, rank 2 last."""

    def save(self, directory, model, optimizer, world):
        if world.rank == 2:
            time.sleep(0.3)
        (directory / f"part{world.rank}.pt").write_bytes(bytes([world.rank]) * 10)


def test_meta_json_is_written_once_every_ranks_files_are_there(tmp_path):
    """meta.json sums the files in DIR.tmp: written before a slower rank's part, the checkpoint would not verify."""
    model = torch.nn.Linear(3, 2)
    meta = CheckpointMeta(1, 1, 1, "p2p", "zigzag", 1, {"family": "linear"}, {"lr": 1e-3})
    SimCluster(3).run(lambda world: save_checkpoint(tmp_path / "c", model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                                    meta, world, RankTwoIsSlow()))  # fmt: skip
    assert read_meta(tmp_path / "c").step == 1 and (tmp_path / "c" / "part2.pt").read_bytes() == b"\2" * 10


class MinMaxOnly:
    """A world without a host exchange or an all-gather (as some HCCL groups): ranks agree through min and max."""

    unsupported_ops = ("all_gather",)

    def __init__(self, world):
        self.world, self.rank, self.size = world, world.rank, world.size

    def all_reduce(self, x, op="sum"):
        return self.world.all_reduce(x, op)


@pytest.mark.parametrize("exchange", ["every row", "min and max"])
def test_every_rank_raises_the_lowest_failing_ranks_message(exchange):
    failing = {1: CheckpointWriteError("rank 1's words"), 3: CPInputError("rank 3's")}

    def rank(world):
        agree(world if exchange == "every row" else MinMaxOnly(world), failing.get(world.rank))

    with pytest.raises(CheckpointWriteError, match="^rank 1's words$"):
        SimCluster(4).run(rank)  # re-raised as it is: the same type and words on every rank
    SimCluster(4).run(lambda world: agree(world, None))  # none failed: every rank goes on


def test_what_torch_distributed_checkpoint_wraps_is_named():
    """DCP raises a `CheckpointException` holding each rank's failure: the disk space is found in it."""

    class CheckpointException(Exception):  # the shape of torch's: failures {rank: (exception, traceback)}
        def __init__(self, failures):
            super().__init__(f"CheckpointException ranks:{failures.keys()}")
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt.tmp/dcp/__1_0.distcp")
    wrapped = CheckpointException({0: (RuntimeError("rank 0 saw a peer fail"), None), 1: (full, None)})
    error = explain(wrapped, "could not write X", "Y is as it was", need=3 << 20, free=1 << 20)
    assert str(error) == ("could not write X: no space left on the device (ENOSPC, /ckpt.tmp/dcp/__1_0.distcp); "
                          "the save needs about 3.0 MiB (3145728 bytes), and 1.0 MiB (1048576 bytes) were free when it "
                          "began; Y is as it was; free space there, or save elsewhere")  # fmt: skip
    other = explain(ValueError("a\nb"), "could not write X", "Y is as it was")
    assert str(other) == "could not write X: ValueError: a b; Y is as it was"
    limit = explain(OSError(errno.EFBIG, "File too large", "/f"), "could not write X", "Y is as it was", need=1, free=2)
    assert str(limit).endswith("its file-size limit, ulimit -f) (EFBIG, /f); Y is as it was; raise that limit, "
                               "or save elsewhere")  # fmt: skip


def test_a_save_that_fails_to_begin_is_one_line_too(tmp_path, monkeypatch):
    """The first step (finishing an interrupted save, claiming DIR.tmp) runs on rank 0 alone: its failure too."""
    one_rank_save(tmp_path / "c", 1)

    real = Path.mkdir

    def no_room(self, *a, **kw):
        if self.name != "c.tmp":
            return real(self, *a, **kw)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "mkdir", no_room)
    with pytest.raises(CheckpointWriteError, match=rf"could not begin the save of step 2 beside {tmp_path / 'c'}: no space "
                                                   rf"left on the device \(ENOSPC, {tmp_path / 'c.tmp'}\); "
                                                   rf"{tmp_path / 'c'} is as it was"):  # fmt: skip
        one_rank_save(tmp_path / "c", 2, resumed=tmp_path / "c")
    monkeypatch.undo()
    assert read_meta(tmp_path / "c").step == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ---- the command on a full filesystem (the slow tier) -------------------------------------------------------------
# Inside the small filesystem: a first run saves (it fits), a second resumes and saves (it does not fit).
DRIVER = textwrap.dedent("""
    import json, os, resource, shutil, signal, subprocess, sys
    d, backend, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run = [sys.executable, "-m", "sim", "train", "--model", "llama", "--cp", "2", "--pack-tokens", "64", "--backend", backend]
    first = subprocess.run(run + ["--steps", "2", "--save", d + "/c"], capture_output=True, text=True)
    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), the process lives
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    second = subprocess.run(run + ["--steps", "4", "--resume", d + "/c", "--save", d + "/c"], capture_output=True,
                            text=True, preexec_fn=limited if limit else None)
    from cpref.train.checkpoint import read_meta
    print(json.dumps({"first": [first.returncode, first.stderr[-2000:]], "rc": second.returncode, "err": second.stderr,
                      "listing": sorted(os.listdir(d)), "step": read_meta(d + "/c").step}))
""")


def small_filesystem(tmp_path: Path) -> tuple[list[str], int, str]:
    """How to run the driver where the disk fills up: a 3 MiB tmpfs in a mount namespace of its own where it can be
    made (`unshare`), else a file-size limit of 256 KiB on the second run. Returns (command prefix, limit, the cause)."""
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
                           capture_output=True) if shutil.which("unshare") else None  # fmt: skip
    if probe is not None and probe.returncode == 0:
        mount = f"mount -t tmpfs -o size=3m tmpfs {tmp_path} && exec \"$0\" \"$@\""
        return ["unshare", "-Urm", "sh", "-c", mount], 0, r"no space left on the device \(ENOSPC"
    return [], 1 << 18, r"a file would be larger than this process may write \(its file-size limit, ulimit -f\) \(EFBIG"


@pytest.mark.full
@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_the_command_on_a_full_disk_says_so_in_one_line_frees_the_tmp_and_keeps_the_checkpoint(tmp_path, backend):
    prefix, limit, cause = small_filesystem(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}/src:{ROOT}"}
    out = subprocess.run([*prefix, sys.executable, "-c", DRIVER, str(tmp_path), backend, str(limit)], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["first"][0] == 0, got["first"]
    assert got["rc"] != 0 and got["listing"] == ["c"] and got["step"] == 2, got  # no c.tmp; c as it was
    c = f"{tmp_path}/c"
    lines = [line for line in got["err"].splitlines() if "could not write the checkpoint of step 4" in line]
    assert lines, got["err"][-3000:]
    import re

    assert re.search(rf"could not write the checkpoint of step 4 to {c}.tmp: {cause}.*; {c} is as it was; ", lines[0]), lines
    assert "unexpected pos" not in lines[0] and "CheckpointException" not in lines[0]
