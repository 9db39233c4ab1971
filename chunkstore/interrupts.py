"""Ctrl-C while the ``chunkstore`` command starts: one line and exit 130, never a traceback.

The command spends about half a second importing (numpy, lmdb, fsspec, click and
the package itself) before :func:`chunkstore.cli.main` can catch anything: a Ctrl-C
then raised ``KeyboardInterrupt`` inside an import and Python printed its traceback.
So the package's first import (``chunkstore/__init__.py`` imports this module before
anything else) installs, in the command's own process only, a SIGINT handler that
prints ``chunkstore: error: interrupted`` and ends the process at once with exit
130: nothing has been written yet, so there is nothing to undo or flush.  Once the
command runs, :func:`command_started` puts Python's own handler back, and a Ctrl-C is
a ``KeyboardInterrupt`` that the CLI turns into the same line (chunkstore.cli.app).

The command's process is recognised by how Python was started: the console script
(``sys.argv[0]`` named ``chunkstore``) or ``python -m chunkstore``.  A program that
imports chunkstore keeps its own SIGINT handling.  What runs before this module
(Python's own start-up and the first lines of the console script) is the
interpreter's: a Ctrl-C there ends the process as Python always does.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
_LINE = b"chunkstore: error: interrupted\n"
_COMMAND_NAMES = ("chunkstore", "chunkstore.exe")
_MODULE_NAMES = ("chunkstore", "chunkstore.__main__")


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    """End the starting command at once, with the line the CLI prints for Ctrl-C."""
    try:
        line = b"\n" + _LINE if os.isatty(2) else _LINE  # on a terminal, after the ^C
        os.write(2, line)
    finally:
        os._exit(EXIT_INTERRUPTED)


def is_command_line() -> bool:
    """Whether this process is the ``chunkstore`` command (console script or
    ``python -m chunkstore``), judged while the package is first imported."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) in _COMMAND_NAMES:
        return True
    # ``python -m chunkstore``: sys.argv[0] is "-m" while runpy imports the package.
    original = list(getattr(sys, "orig_argv", ()))
    if argv0 != "-m" or "-m" not in original:
        return False
    module = original[original.index("-m") + 1:]
    return bool(module) and module[0] in _MODULE_NAMES


def guard_startup() -> None:
    """Make a Ctrl-C before the command runs one line and exit 130 (the command's
    process only, and only where Python's own handler is in place)."""
    if not is_command_line():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread: signals are not ours to handle
        pass


def command_started() -> None:
    """Give Ctrl-C back to Python (``KeyboardInterrupt``) once the command can turn
    it into its one line itself."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass


guard_startup()
