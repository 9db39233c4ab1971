"""Progress reporting for long operations, as an optional collaborator.

Code that loops takes a :class:`Progress` and calls ``start``/``advance``/
``finish``; it never checks whether anyone is watching.  :class:`NullProgress`
does nothing; :class:`TerminalProgress` shows click's progress bar (bar,
percentage, count, time left) on stderr when stderr is a terminal and stays
silent when it is piped or redirected, so scripts and logs never see
carriage-return noise.
"""

from __future__ import annotations

import itertools
import sys
import time
from types import TracebackType
from typing import Any, Protocol, TextIO

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
    """Click's progress bar on a stream, only if the stream is a terminal.

    Units are handed to the bar at most every :data:`MIN_REDRAW_S` seconds (and
    on the last unit), so a fast loop of many small steps costs almost nothing.
    Use it as a context manager where an operation can be interrupted: leaving
    the block ends a bar the operation did not finish, so the terminal gets its
    cursor and a fresh line back before any error is printed.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = _isatty(self._stream)
        self._bar: Any = None  # click's ProgressBar while an operation runs
        self._total = 0
        self._pending = 0
        self._last_draw = 0.0

    @property
    def enabled(self) -> bool:
        """Whether this progress draws anything (its stream is a terminal)."""
        return self._enabled

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finish()

    def start(self, total: int, label: str) -> None:
        """Begin a new bar; an unfinished previous one is closed first."""
        self.finish()
        if not self._enabled:
            return
        self._total, self._pending = max(total, 0), 0
        # click is imported here, when a bar is drawn: a training job that imports
        # chunkstore to save and restore never draws one (and need not load click).
        import click

        # An endless iterable gives click an unknown length (a bar without an end).
        units = None if self._total else itertools.repeat(None)
        self._bar = click.progressbar(units, length=self._total or None, label=label,
                                      file=self._stream, show_pos=True, show_percent=True,
                                      empty_char=".", width=24)
        self._bar.__enter__()
        self._last_draw = time.monotonic()

    def advance(self, n: int = 1) -> None:
        """Move the bar ``n`` units on."""
        if self._bar is None:
            return
        self._pending += n
        now = time.monotonic()
        last_unit = self._total > 0 and self._bar.pos + self._pending >= self._total
        if last_unit or now - self._last_draw >= MIN_REDRAW_S:
            self._bar.update(self._pending)
            self._pending, self._last_draw = 0, now

    def finish(self) -> None:
        """Draw the final state and end the line."""
        bar, self._bar = self._bar, None
        if bar is not None:
            if self._pending:
                bar.update(self._pending)
            bar.__exit__(None, None, None)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
