"""What the command-line tools share: one-line errors, defaults in `--help`, torch's dtype names.

* [`Parser`][sim.tools.cli.Parser]: an `argparse.ArgumentParser` whose errors are one line,
  `prog: error: message`, exit status 2 (no usage block, no traceback), and whose `--help`
  shows every option's default;
* [`positive`][sim.tools.cli.positive], [`positives`][sim.tools.cli.positives], [`nonnegative`][sim.tools.cli.nonnegative],
  [`positive_float`][sim.tools.cli.positive_float], [`seconds`][sim.tools.cli.seconds],
  [`device_name`][sim.tools.cli.device_name]: the `type=` of a whole number >= 1 (or a comma list of
  them) or >= 0 (at most `2**63 - 1`, the most torch takes), a finite number > 0, a timeout a
  process group can hold, a torch device this machine has;
* [`dtype_name`][sim.tools.cli.dtype_name]: a dtype by cpref's short name (`fp32`) or torch's
  (`float32`, `torch.float32`), as the tools name them;
* [`fail`][sim.tools.cli.fail]: the same one-line error for what is refused after parsing.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

__all__ = ["Parser", "positive", "positives", "nonnegative", "positive_float", "seconds", "device_name", "dtype_name", "fail",
           "DTYPE_ALIASES"]  # fmt: skip

# torch's names of the dtypes the tools take -> their short names
DTYPE_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
                 "half": "fp16", "bfloat16": "bf16"}  # fmt: skip


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with one-line errors and the defaults in `--help`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print `prog: error: message` on one line to stderr and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


INT64_MAX = 2**63 - 1  # the largest whole number torch takes (sizes, indices, seeds); beyond it, an overflow deep inside


def _whole(value: str, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {lo}, got {value!r}") from None
    if n < lo:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {lo}, got {n}")
    if n > INT64_MAX:
        raise argparse.ArgumentTypeError(f"expected a whole number <= 2**63 - 1 (the most torch takes), got {n}")
    return n


def positive(value: str) -> int:
    """A whole number >= 1 (argparse `type=`), at most `2**63 - 1` as every whole number here."""
    return _whole(value, 1)


def nonnegative(value: str) -> int:
    """A whole number >= 0 (argparse `type=`)."""
    return _whole(value, 0)


def positives(value: str) -> tuple[int, ...]:
    """Comma-separated whole numbers >= 1 (argparse `type=`), e.g. `1000,3000,500`."""
    try:
        return tuple(positive(n) for n in value.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {value!r}") from None


def positive_float(value: str) -> float:
    """A finite number > 0 (argparse `type=`): `inf`, `nan`, 0 and negatives are refused."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value!r}")
    return x


def seconds(value: str) -> float:
    """A process-group timeout in seconds (argparse `type=`): a finite number > 0 and at most
    `sim.tools.launch.MAX_TIMEOUT_S` (about 292 years; `1e300` overflows the process group's clock)."""
    from sim.tools.launch import MAX_TIMEOUT_S

    x = positive_float(value)
    if x > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, {MAX_TIMEOUT_S:.3g}] (longer overflows the process "
                                         f"group's clock), got {value!r}")  # fmt: skip
    return x


def device_name(value: str) -> str:
    """A torch device this machine has (argparse `type=`): `cpu`, `cuda`, `cuda:1`, ..."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda, got {value!r}") from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise argparse.ArgumentTypeError(f"device {value!r}: this machine has {count} {device.type} device(s)")
    return value


def dtype_name(value: str) -> str:
    """`value` as a short dtype name: `fp32` stays, `float32` and `torch.float32` become `fp32`."""
    name = value.strip().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def fail(prog: str, message: str) -> int:
    """Print a one-line error for `prog` and return the exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
