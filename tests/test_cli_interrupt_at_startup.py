"""Ctrl-C while the ``chunkstore`` command starts (about half a second of imports) is
one line, ``chunkstore: error: interrupted``, and exit 130, as it is later: it used to
print a ``KeyboardInterrupt`` traceback from inside an import.

The command runs as a user runs it (the console script, and ``python -m chunkstore``)
in a process with Python's own SIGINT handling.  A ``sitecustomize`` put on
PYTHONPATH sends the process SIGINT as it starts importing a chosen module, so the
interrupt lands inside each phase of start-up every time; a second test sends SIGINT
from outside after a range of delays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import chunkstore

COMMAND = Path(sys.executable).parent / "chunkstore"
LINE = "chunkstore: error: interrupted"

HOOK = '''
import importlib.abc, os, signal, sys

class _InterruptAt(importlib.abc.MetaPathFinder):
    """SIGINT to this process when the module named in $INTERRUPT_AT is imported;
    a byte to $STARTED_FD when chunkstore's first module after its guard is."""

    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("INTERRUPT_AT"):
            os.kill(os.getpid(), signal.SIGINT)
        if name == "chunkstore.errors" and os.environ.get("STARTED_FD"):
            os.write(int(os.environ.pop("STARTED_FD")), b"x")
        return None

sys.meta_path.insert(0, _InterruptAt())
# Ctrl-C as a user's shell leaves it: a test runner started in the background of a
# non-interactive shell passes SIGINT on ignored, and Python then keeps it so.
signal.signal(signal.SIGINT, signal.default_int_handler)
'''

#: Modules the command imports, in the order it imports them: the package's heavy
#: dependencies, its own modules, the CLI's, and (once the command runs, where Ctrl-C
#: is a KeyboardInterrupt again) the local backend its first store access loads.
IMPORT_POINTS = ["numpy", "blake3", "zstandard", "lmdb", "chunkstore.format.records",
                 "chunkstore.store", "click", "chunkstore.cli.common",
                 "chunkstore.maintenance.report", "chunkstore.cli.app",
                 "chunkstore.backends.local"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("interrupt") / "s"
    with chunkstore.open(path, create=True) as opened, opened.new_version("r", 1) as v:
        v.put("w", np.zeros(10, dtype=np.float32))
    return str(path)


def _run(argv: list[str], interrupt_at: str, hook_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INTERRUPT_AT": interrupt_at,
           "PYTHONPATH": os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.skipif(not COMMAND.exists(), reason="the console script is not installed")
@pytest.mark.parametrize("way", ["console script", "python -m"])
def test_ctrl_c_at_any_point_of_start_up_is_one_line_and_exit_130(
        way: str, store: str, tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    argv = ([sys.executable, str(COMMAND)] if way == "console script"
            else [sys.executable, "-m", "chunkstore"]) + ["report", store]
    assert _run(argv, "", tmp_path).returncode == 0  # the hook alone changes nothing
    for module in IMPORT_POINTS:
        result = _run(argv, module, tmp_path)
        assert "Traceback" not in result.stderr, (module, result.stderr)
        assert (result.returncode, result.stderr.strip()) == (130, LINE), module
        assert result.stdout == "", module


@pytest.mark.skipif(not COMMAND.exists(), reason="the console script is not installed")
def test_ctrl_c_from_outside_at_any_delay_never_prints_a_traceback(store: str,
                                                                    tmp_path: Path) -> None:
    """Delays count from the package's first import after its guard
    (chunkstore.interrupts, the first line of ``chunkstore/__init__.py``): before it,
    Python's own start-up (its site module) runs no line of chunkstore, and a Ctrl-C
    there is the interpreter's to report."""
    (tmp_path / "sitecustomize.py").write_text(HOOK)
    outcomes = set()
    for delay in (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6):
        started, tell = os.pipe()
        env = {**os.environ, "STARTED_FD": str(tell), "PYTHONPATH": os.pathsep.join(
            [str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen([str(COMMAND), "log", store], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env,
                                   pass_fds=(tell,))
        os.close(tell)
        try:
            assert os.read(started, 1) == b"x"
        finally:
            os.close(started)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err)
        # 130 and the line; or done before the signal came: exit 0, or, when it came
        # while Python was ending (its handler gone), killed by it after the output
        finished = out.startswith("ID") and err == ""
        assert ((process.returncode, err.strip()) == (130, LINE)
                or (process.returncode in (0, -signal.SIGINT) and finished)), (
            delay, process.returncode, err)
        outcomes.add(process.returncode)
    assert 130 in outcomes
