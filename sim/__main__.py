"""`python -m sim <command> [options]`: the command-line tools of the simulated cluster.

Each command is a module with `main(argv, prog) -> exit status`, imported only when it is
run; `python -m sim <command> --help` lists its options. Also runs under
`torchrun --nproc-per-node N -m sim <command> ...`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# command -> (module with main(argv, prog), one line of help)
COMMANDS = {
    "verify": ("sim.tools.verify", "rank-by-rank verification of CP attention on real process groups"),
    "train": ("sim.tools.train", "train a GPT-2, LLaMA or Qwen3 style model with CP on packed documents"),
    "plan": ("sim.tools.plan", "which CP mode, layout and options: each one's step predicted from its own plan"),
}


def usage() -> str:
    lines = ["usage: python -m sim <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines + ["", "python -m sim <command> --help shows a command's options"])


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the command's `main`; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"python -m sim: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)} "
              "(python -m sim --help)", file=sys.stderr)  # fmt: skip
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:], prog=f"python -m sim {argv[0]}")


if __name__ == "__main__":
    raise SystemExit(main())
