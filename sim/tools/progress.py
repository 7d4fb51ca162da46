"""A one-line progress bar on stderr, for sweeps (`python -m sim verify`).

Hand-written (a dozen lines) rather than a dependency: it redraws one line with a carriage
return, and draws nothing when the stream is not a terminal (logs and test captures stay
clean) unless asked to.

Example:
    >>> import io
    >>> stream = io.StringIO()
    >>> bar = Progress(4, "cases", stream=stream, enabled=True)
    >>> for _ in range(4):
    ...     bar.step()
    >>> bar.close()
    >>> stream.getvalue().splitlines()[-1].strip()
    'cases [########################] 4/4'
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """`label [#####-------] done/total`, redrawn in place on `stream`.

    Args:
        total: the number of steps.
        label: what is counted.
        stream: where to draw (default: stderr).
        enabled: draw or not; default: only if `stream` is a terminal.
        width: the bar's width in characters.
    """

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 24) -> None:  # fmt: skip
        self.total, self.label, self.width, self.done = max(int(total), 1), label, width, 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) if enabled is None else enabled
        self._draw()

    def step(self, note: str = "") -> None:
        """Count one step done; `note` (e.g. the case) is shown after the count."""
        self.done = min(self.done + 1, self.total)
        self._draw(note)

    def close(self) -> None:
        """End the line (the bar stays visible above what is printed next)."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {note[:60]:<60}")
        self.stream.flush()
