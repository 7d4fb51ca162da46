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
                   ["--nproc", "4", "--mode", "a2a+p2p", "--a2a-size", "3"], ["--head-dim", "x"],
                   ["--timeout", "1e300", "--nproc", "1", "--mode", "p2p", "--layout", "zigzag"],  # an OverflowError
                   ["--seed", str(2**63 - 1)], ["--seed", str(2**62 + 1)]],  # seed + 1000 d overflowed torch's generator
    "sim train": [["--cp", "0"], ["--cp", "3", "--mode", "a2a"], ["--mode", "ring"], ["--dtype", "fp16"],
                  ["--lr", "-1"], ["--save-every", "2"], ["--steps", "many"], ["--cp", "4", "--mode", "a2a+p2p",
                  "--a2a-size", "3"], ["--override", "mode"], ["--pack-tokens", "1"], ["--lr", "inf"],
                  # round 3, each on main a traceback after the banner (or training cut short, or a value ignored)
                  ["--lr", "1e39"], ["--lr", "1e300"], ["--lr", "1e38"], ["--lr", "1e-50"], ["--pack-tokens", "100000000"],
                  ["--steps", "20", "--pack-tokens", "16384"], ["--dp", "600", "--steps", "1"], ["--micro-batches",
                  "300", "--steps", "2"], ["--steps", "100000000000000000000"], ["--save", ""], ["--resume", ""],
                  ["--a2a-size", "2", "--mode", "p2p"], ["--save", "~no-such-user-of-cpref/ckpt"]],
    "bench layouts": [["--quick", "--frobnicate"]],
    "sim demo": [["--layout", "diagonal"]],
    "bench memory": [["--lengths", "7"], ["--heads", "8", "3", "64", "64"]],  # on main: a CPInputError traceback
    "bench all_gather": [["--cu", "0", "10", "5"], ["--heads", "8", "--kv-heads", "3"]],
}  # fmt: skip
MODULES = {"sim verify": "sim.tools.verify", "sim train": "sim.tools.train", "sim demo": "sim.tools.demo"}


def _main(tool: str):
    import importlib

    return importlib.import_module(MODULES.get(tool, tool.replace(" ", "."))).main


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
    assert out.stderr.strip().splitlines() == ["python -m sim: error: unknown command 'tarin'; choose from verify, train, plan "
                                               "(python -m sim --help)"]  # fmt: skip


def test_torch_dtype_names_are_accepted(capsys):
    from sim.tools.train import parse
    from sim.tools.verify import parse_args

    assert parse_args(["--dtype", "float32,torch.bfloat16,float64"]).dtypes == ["fp32", "bf16", "fp64"]
    spec, _, _ = parse(["--dtype", "bfloat16"])
    assert spec.train.bf16


def test_train_help_shows_defaults_the_data_and_the_model_sizes(capsys):
    from sim.tools.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 512)" in out and "(default: p2p)" in out
    assert "standard-library source files" in out and "llama: hidden_size=" in out
    # issue 56, item 12: each way a run stops has its status (sim.tools.stops), and --timeout its default
    assert "exit status: 0 trained, 1 diverged, 2 refused, 3 failed, 4 timeout, 130 interrupted" in out
    assert "--timeout SECONDS" in out and "(default: 600.0)" in out


# ---- every value of every tool: checked by its type before any work --------------------------------------------------
TOOLS = ["sim.tools.train", "sim.tools.verify", "sim.tools.demo", "sim.tools.npu_check", "bench.all", "bench.all_gather",
         "bench.collectives", "bench.determinism", "bench.kernel", "bench.layouts", "bench.memory", "bench.overhead",
         "bench.scaling", "bench.window"]  # fmt: skip


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(tool: str, monkeypatch):
    """The parser `tool`'s main builds (its parse_args stopped before any work)."""
    import importlib

    from sim.tools.cli import Parser

    def stop(self, *a, **kw):
        raise _Parsed(self)

    monkeypatch.setattr(Parser, "parse_args", stop)
    try:
        importlib.import_module(tool).main([])
    except _Parsed as parsed:
        return parsed.parser
    raise AssertionError(f"{tool}.main parsed nothing")


def test_every_option_of_every_tool_has_a_checked_type(monkeypatch):
    """No bare int or float: `--lr inf`, `--repeats 0`, `--rows -1` ran into the work on main."""
    import sim.tools.cli as cli

    unchecked = []
    for tool in TOOLS:
        for action in parser_of(tool, monkeypatch)._actions:
            if action.type in (int, float) or (action.type is None and isinstance(action.default, (int, float))
                                               and not isinstance(action.default, bool) and action.nargs != 0):  # fmt: skip
                unchecked.append(f"{tool} {action.option_strings}")
    assert unchecked == []
    assert {cli.positive, cli.positive_float, cli.nonnegative, cli.positives} <= {
        a.type for t in TOOLS for a in parser_of(t, monkeypatch)._actions}  # fmt: skip


BAD_VALUES = {"positive": ["0", "-2", "x", str(2**63)], "nonnegative": ["-1", "1.5", "99999999999999999999999"], "positive_float": ["0", "-1", "inf", "nan", "x"],
              "positives": ["0,1", "4,x"], "device_name": ["gpu", "cuda:7"], "seconds": ["0", "inf", "1e300"]}  # fmt: skip


@pytest.mark.parametrize("tool", TOOLS)
def test_a_bad_number_for_any_option_is_one_line_before_any_work(tool, monkeypatch, capsys):
    import importlib

    checked = [(a, a.type.__name__) for a in parser_of(tool, monkeypatch)._actions
               if getattr(a.type, "__name__", None) in BAD_VALUES]  # fmt: skip
    monkeypatch.undo()
    main = importlib.import_module(tool).main
    for action, kind in checked:
        for bad in BAD_VALUES[kind]:
            if kind == "device_name" and bad == "cuda:7":
                import torch

                if torch.cuda.device_count() > 7:
                    continue
            try:
                status = main([action.option_strings[0], bad])
            except SystemExit as exit:
                status = exit.code
            err = capsys.readouterr().err
            assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (tool, action.dest, bad, err)


def test_the_data_check_names_what_the_run_takes_and_the_fix(capsys):
    """On main `--steps 20 --pack-tokens 16384` trained 16 steps, then crashed: the data holds 16 such packs."""
    from sim.tools.train import main

    assert main(["--steps", "20", "--pack-tokens", "16384"]) == 2
    err = capsys.readouterr().err
    assert "take 20 packs of 16384 tokens, but the documents" in err and "fill only 16: train at most 16 steps" in err


def test_the_learning_rate_s_bounds_are_those_adamw_can_step_float32_by():
    import torch

    from cpref.base.errors import CPInputError
    from sim.tools.train import check_lr

    check_lr(3.4e37, torch.float32)  # its first step, 10 x lr, is still finite there
    check_lr(torch.finfo(torch.float32).tiny, torch.float32)
    for bad in (3.5e37, 1e-39):
        with pytest.raises(CPInputError, match="the learning rates AdamW can step torch.float32 parameters by"):
            check_lr(bad, torch.float32)
    check_lr(1e39, torch.float64)  # the dtype's range, not float32's


def test_seconds_is_a_timeout_a_process_group_holds():
    import argparse

    from sim.tools.cli import seconds

    assert seconds("300") == 300.0 and seconds("9e9") == 9e9
    with pytest.raises(argparse.ArgumentTypeError, match="longer overflows the process group's clock"):
        seconds("1e13")
