"""What the command-line tools share: one-line errors, defaults in `--help`, torch's dtype names.

* [`Parser`][sim.tools.cli.Parser]: an `argparse.ArgumentParser` whose errors are one line,
  `prog: error: message`, exit status 2 (no usage block, no traceback), and whose `--help`
  shows every option's default;
* [`positive`][sim.tools.cli.positive]: the `type=` of a whole number >= 1;
* [`dtype_name`][sim.tools.cli.dtype_name]: a dtype by cpref's short name (`fp32`) or torch's
  (`float32`, `torch.float32`), as the tools name them;
* [`fail`][sim.tools.cli.fail]: the same one-line error for what is refused after parsing.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["Parser", "positive", "dtype_name", "fail", "DTYPE_ALIASES"]

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


def positive(value: str) -> int:
    """A whole number >= 1 (argparse `type=`)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def dtype_name(value: str) -> str:
    """`value` as a short dtype name: `fp32` stays, `float32` and `torch.float32` become `fp32`."""
    name = value.strip().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def fail(prog: str, message: str) -> int:
    """Print a one-line error for `prog` and return the exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
