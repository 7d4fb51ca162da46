"""Issue 56, item 13: a script on gloo processes that follows "Your model" exits 0, without `os._exit`.

It ended in SIGABRT, "terminate called without an active exception", in about 5 of 42 runs after correct results
(torchrun reported the job FAILED), and the examples left with `os._exit` to avoid it. The cause (a core dump's
stacks): gloo runs its own collectives on worker threads of its own; a worker lets go of a finished all-reduce a
moment after it has woken the caller, and letting go of a tensor that Python also holds takes Python's lock; a
rank that leaves at once reaches the interpreter's shutdown first, the worker then asks for the lock, which ends
the thread inside a C++ destructor, and the C++ runtime aborts. `TorchComm` on gloo now exchanges pairwise for
every call, `all_reduce` included (sends and receives, which gloo's workers never run), so no worker of gloo's
holds a tensor of cpref's when a rank leaves (`cpref.comm.torch_dist`, "Leaving the process").

Two tests: the cause, on every call (deterministic), and the symptom, a torchrun script of that shape run again
and again. (`examples/own_module.py` itself, now without `os._exit`, runs under torchrun in `tests/test_quickstart.py`.)
"""

from __future__ import annotations

import os

import pytest

from sim.tools.launch import launch
from tests.backends import launch_cases

pytestmark = pytest.mark.full  # processes


def test_no_call_of_torch_comm_runs_on_gloo_s_worker_threads():
    """The example's training and every protocol call, on the world and on a split, with gloo's default exchange:
    no `torch.distributed` collective that gloo runs on its workers is called (on main: `all_reduce`, each step)."""
    called = launch(launch_cases.what_torch_comm_hands_gloo_s_workers, 2, timeout=60.0, check_calls=False)
    assert called == [[], []]


# 24 torchrun jobs, 4 at a time: about 110 s here (2 cores); see SCRIPT. CPREF_EXIT_RUNS=200 runs the count
# (about 15 minutes here): 0 of 200 failed on 2026-12-07
RUNS, AT_ONCE = int(os.environ.get("CPREF_EXIT_RUNS", "24")), 4

# A user's script as "Your model" shows it: the example's model and training over torchrun, rank 0 then checks
# itself against one device, and every rank leaves by returning (no destroy_process_group, no os._exit). On main it
# ended in SIGABRT in 3 of 24 such runs here (4 at a time), and in 4 of 47 one or three at a time.
SCRIPT = """
import sys

import torch

import cpref
from cpref.comm import TorchComm
from examples.own_module import train


def main():
    torch.distributed.init_process_group("gloo")
    comm = TorchComm()
    losses = train(comm)
    if comm.rank == 0:
        alone = train(cpref.SingleRank())
        print("largest relative difference", max(abs(a - b) / abs(b) for a, b in zip(losses, alone)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


def test_a_torchrun_script_that_follows_your_model_exits_0_run_after_run(tmp_path):
    """`SCRIPT` under `torchrun --standalone --nproc-per-node 2`, RUNS times, AT_ONCE at a time: every job exits 0,
    and no process prints "terminate called". At main's rate here (3 in 24), 0 in 24 happens 5 times in 100; the
    test above holds the cause itself on every call."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", str(script)]
    bad, started, running = [], 0, []
    while started < RUNS or running:
        while started < RUNS and len(running) < AT_ONCE:
            running.append(subprocess.Popen(torchrun, cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE))  # fmt: skip
            started += 1
        time.sleep(0.2)
        for job in [job for job in running if job.poll() is not None]:
            running.remove(job)
            out, err = job.communicate()
            if job.returncode != 0 or "terminate called" in err or "largest relative difference" not in out:
                bad.append((job.returncode, err[-800:]))
    assert bad == [], f"{len(bad)} of {RUNS} runs failed: {bad[:2]}"
