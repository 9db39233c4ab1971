"""Progress reporting for long operations, as an optional collaborator.

Code that loops takes a :class:`Progress` and calls ``start``/``advance``/
``finish``; it never checks whether anyone is watching.  :class:`NullProgress`
does nothing; :class:`TerminalProgress` draws a one-line bar on stderr when
stderr is a terminal and stays silent when it is piped or redirected, so
scripts and logs never see carriage-return noise.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

BAR_WIDTH = 24
MIN_REDRAW_S = 0.1


class Progress(Protocol):
    """Receives the progress of one operation at a time."""

    def start(self, total: int, label: str) -> None:
        """Begin an operation of ``total`` units (0 when unknown) described by ``label``."""

    def advance(self, n: int = 1) -> None:
        """Record that ``n`` more units are done."""

    def finish(self) -> None:
        """End the operation (also after an error); the next ``start`` begins afresh."""


class NullProgress:
    """A progress sink that ignores everything (the default collaborator)."""

    def start(self, total: int, label: str) -> None:
        """Ignore the start."""

    def advance(self, n: int = 1) -> None:
        """Ignore the advance."""

    def finish(self) -> None:
        """Ignore the finish."""


class TerminalProgress:
    """Draws ``label [#####.....] done/total`` on a stream, only if it is a TTY.

    Redraws at most every :data:`MIN_REDRAW_S` seconds (and on the last unit),
    so a fast loop of many small steps costs almost nothing.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _isatty(self._stream)
        self._total = 0
        self._done = 0
        self._label = ""
        self._last_draw = 0.0
        self._drawn = False

    @property
    def enabled(self) -> bool:
        """Whether this progress draws anything (its stream is a terminal)."""
        return self._enabled

    def start(self, total: int, label: str) -> None:
        """Begin a new bar; an unfinished previous one is closed first."""
        if self._drawn:
            self.finish()
        self._total, self._done, self._label = max(total, 0), 0, label
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        """Move the bar ``n`` units on."""
        self._done += n
        self._draw(force=self._total > 0 and self._done >= self._total)

    def finish(self) -> None:
        """Draw the final state and end the line."""
        if self._drawn:
            self._draw(force=True)
            self._stream.write("\n")
            self._stream.flush()
        self._drawn = False

    def _draw(self, *, force: bool) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < MIN_REDRAW_S:
            return
        self._last_draw = now
        self._stream.write("\r" + render_line(self._label, self._done, self._total))
        self._stream.flush()
        self._drawn = True


def render_line(label: str, done: int, total: int) -> str:
    """The text of one progress line (without the carriage return)."""
    if total <= 0:
        return f"{label} {done}"
    filled = min(BAR_WIDTH, BAR_WIDTH * done // total)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return f"{label} [{bar}] {done}/{total}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
