"""Every command-line tool refuses a bad argument in one line, `prog: error: ...`, exit status 2, no traceback.

Each kind of bad argument of each tool: a number out of range, a name not in its choices, a value the mode
cannot take at that CP size (the heads do not split; an a2a group that does not divide), flags that do not
go together. In process (`main(argv)`), so that a traceback would fail the test as an exception; and the
dispatcher once as a real process, with its real exit status and stderr. torch's dtype names are accepted
where a dtype is named.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = {
    "sim verify": [["--nproc", "0"], ["--nproc", "3", "--mode", "a2a"], ["--dtype", "fp8"], ["--mode", "ring"],
                   ["--window", "3,2"], ["--docs", "1,5"], ["--heads", "8,3"], ["--nproc", "4", "--cp", "3"],
                   ["--nproc", "4", "--mode", "a2a+p2p", "--a2a-size", "3"], ["--head-dim", "x"]],
    "sim train": [["--cp", "0"], ["--cp", "3", "--mode", "a2a"], ["--mode", "ring"], ["--dtype", "fp16"],
                  ["--lr", "-1"], ["--save-every", "2"], ["--steps", "many"], ["--cp", "4", "--mode", "a2a+p2p",
                  "--a2a-size", "3"], ["--override", "mode"]],
    "bench layouts": [["--quick", "--frobnicate"]],
    "sim demo": [["--layout", "diagonal"]],
}  # fmt: skip


def _main(tool: str):
    if tool == "sim verify":
        from sim.tools.verify import main
    elif tool == "sim train":
        from sim.tools.train import main
    elif tool == "bench layouts":
        from bench.layouts import main
    else:
        from sim.demo import main
    return main


@pytest.mark.parametrize("tool, argv", [(tool, argv) for tool, cases in BAD.items() for argv in cases])
def test_a_bad_argument_is_one_line_and_status_2(tool, argv, capsys):
    try:
        status = _main(tool)(argv)
    except SystemExit as exit:
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, (argv, err)


def test_the_dispatcher_and_its_unknown_command_as_a_process():
    out = subprocess.run([sys.executable, "-m", "sim", "tarin", "--cp", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["python -m sim: error: unknown command 'tarin'; choose from verify, train "
                                               "(python -m sim --help)"]  # fmt: skip


def test_torch_dtype_names_are_accepted(capsys):
    from sim.tools.train import parse
    from sim.tools.verify import parse_args

    assert parse_args(["--dtype", "float32,torch.bfloat16,float64"]).dtypes == ["fp32", "bf16", "fp64"]
    spec, _ = parse(["--dtype", "bfloat16"])
    assert spec.train.bf16


def test_train_help_shows_defaults_the_data_and_the_model_sizes(capsys):
    from sim.tools.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 512)" in out and "(default: p2p)" in out
    assert "standard-library source files" in out and "llama: hidden_size=" in out
