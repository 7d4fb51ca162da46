"""How `python -m sim verify` shows that it is working: a bar on a terminal, one line per case in a log.

A sweep runs for minutes. On a terminal, stderr shows [`Progress`][sim.tools.progress.Progress]'s bar,
redrawn in place; where stderr is not a terminal (a CI log, `nohup`, `2> file`), a bar redrawn with
carriage returns would be one unreadable line written at the end, so each finished case is a line of
its own instead, written as it finishes. `--progress` asks for the bar, `--no-progress` for neither.

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> m = meter(2, "ground truth", None, stream=log)  # a StringIO is not a terminal: lines
    >>> m.step("p2p/zigzag/fp32/cp2"); m.step("a2a/zigzag/fp32/cp2"); m.close()
    >>> print(log.getvalue(), end="")
    ground truth: 1/2 p2p/zigzag/fp32/cp2
    ground truth: 2/2 a2a/zigzag/fp32/cp2
"""

from __future__ import annotations

import sys
from typing import TextIO

from sim.tools.progress import Progress

__all__ = ["Lines", "meter"]


class Lines:
    """`label: done/total note`, one line per step on `stream`, flushed as it is written."""

    def __init__(self, total: int, label: str, stream: TextIO) -> None:
        self.total, self.label, self.stream, self.done = total, label, stream, 0

    def step(self, note: str = "") -> None:
        """Count one step done and write its line."""
        self.done += 1
        self.stream.write(f"{self.label}: {self.done}/{self.total} {note}".rstrip() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Nothing to end: every line is whole."""


def meter(total: int, label: str, progress: bool | None, stream: TextIO | None = None) -> Progress | Lines:
    """`progress` True: the bar; False: nothing; None: the bar if `stream` (default stderr) is a terminal, else
    `Lines`."""
    stream = sys.stderr if stream is None else stream
    if progress is None and not getattr(stream, "isatty", lambda: False)():
        return Lines(total, label, stream)
    return Progress(total, label, stream=stream, enabled=bool(progress) or progress is None)
