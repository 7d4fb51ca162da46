"""The quickstart example of the docs runs, and its results are right (it cannot go stale)."""

import re
import runpy

import pytest


def test_quickstart_runs_and_matches_the_oracle(capsys):
    runpy.run_module("examples.quickstart", run_name="__main__")
    out = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"largest error against the FP64 oracle ([0-9.e+-]+)", out)]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), out  # float32 inputs: the fp32 tolerance


@pytest.mark.full
def test_the_own_module_example_trains_over_torchrun_as_on_one_device():
    """`examples/own_module.py` under torchrun on 2 gloo processes: exit 0 (its losses within 1e-5 relative of
    the run without CP), one line per step and the difference printed."""
    from tests.helpers import run_torchrun

    out = run_torchrun("examples/own_module.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("step")] == ["0", "1", "2", "3", "4"]
    assert "CP 2: largest relative difference" in out.stdout
