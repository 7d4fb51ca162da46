"""The quickstart example of the docs runs, and its results are right (it cannot go stale)."""

import re
import runpy


def test_quickstart_runs_and_matches_the_oracle(capsys):
    runpy.run_module("examples.quickstart", run_name="__main__")
    out = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"largest error against the FP64 oracle ([0-9.e+-]+)", out)]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), out  # float32 inputs: the fp32 tolerance
