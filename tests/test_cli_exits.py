"""How a ``chunkstore`` process ends, in real subprocesses: one-line errors (usage
errors and missing torch included), a reader that closes the pipe early, Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.objects.kinds import CHUNKS
from tests.conftest import SMALL_CHUNK

CLI = [sys.executable, "-m", "chunkstore"]


def run_cli(*argv: str, prefix: list[str] = CLI) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *argv], check=False, capture_output=True, text=True,
                          timeout=120)


def assert_one_error_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("chunkstore: error: ")
    return lines[0]


@pytest.fixture
def filled(store_path: Path) -> Path:
    """Two versions of run r, with enough entries that `show` prints ~90 lines."""
    rng = np.random.default_rng(3)
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        for step in (1, 2):
            with store.new_version("r", step, meta={"loss": 1.0 / step}) as v:
                for i in range(80):
                    v.put(f"model.layer{i}.w", rng.standard_normal(300).astype(np.float32))
                v.put("model.big", rng.standard_normal(40_000).astype(np.float32))
        store.tag("r@1", "first")
    return store_path


# --- usage errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "words"), [
    (["verify", "{store}", "--frobnicate"], "--frobnicate"),
    (["--frobnicate"], "--frobnicate"),
    (["frobnicate"], "frobnicate"),
    (["log"], "Missing argument 'STORE'"),
    (["index", "rebuild"], "Missing argument 'STORE'"),
    (["prune", "{store}", "--keep-last", "0"], "--keep-last"),
    (["init", "{store}-new", "--chunk-size", "12 parsecs"], "not a size"),
    # click's suggestion keeps its question mark, then the help (it read "...?); see")
    (["log", "{store}", "--rn", "r"],
     "No such option '--rn'. Did you mean one of: '--json', '--run'? See `chunkstore log"),
])
def test_usage_errors_are_one_line_that_names_the_help(filled: Path, args: list[str],
                                                       words: str) -> None:
    proc = run_cli(*(a.format(store=filled) for a in args))
    line = assert_one_error_line(proc, 2)
    assert words in line
    assert "--help" in line


def test_no_arguments_still_prints_the_help(filled: Path) -> None:
    proc = run_cli()
    assert "Usage: chunkstore" in proc.stdout + proc.stderr
    assert "Exit codes" in proc.stdout + proc.stderr


# --- missing torch --------------------------------------------------------------------------

def without(*packages: str) -> list[str]:
    """The CLI in a process where ``packages`` cannot be imported, as after a plain
    ``pip install .`` (no extra) that did not bring them."""
    return [sys.executable, "-c", f"""
import sys
from importlib.abc import MetaPathFinder

class Without(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in {packages!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
        return None

sys.meta_path.insert(0, Without())
from chunkstore.cli import main
main(sys.argv[1:])
"""]


WITHOUT_TORCH = without("torch", "safetensors")
#: What the hints say to run: commands that work wherever chunkstore came from (a clone, a
#: wheel), as README.md's "As a library" gives them; never the distribution's name, which
#: no package index serves.
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_export_without_torch_says_what_to_install(filled: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", str(filled), "latest", str(out), prefix=WITHOUT_TORCH)
    line = assert_one_error_line(proc, 2)
    assert "`chunkstore export` needs PyTorch" in line
    assert CPU_TORCH in line and "[export] extra" in line
    assert "chunkstore-ckpt" not in line
    assert not out.exists()


def test_export_without_safetensors_says_what_to_install(filled: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", str(filled), "latest", str(out), prefix=without("safetensors"))
    line = assert_one_error_line(proc, 2)
    assert "`chunkstore export` needs safetensors" in line
    assert line.endswith("install it with: pip install safetensors")
    assert not out.exists()


def test_demo_without_torch_says_what_to_install(tmp_path: Path) -> None:
    where = tmp_path / "demo"
    line = assert_one_error_line(run_cli("demo", str(where), prefix=WITHOUT_TORCH), 2)
    assert CPU_TORCH in line and "[torch] extra" in line
    assert "chunkstore-ckpt" not in line
    assert not where.exists()


def test_an_s3_store_without_s3fs_is_exit_2_as_export_without_safetensors() -> None:
    """A package a command needs, not installed, is exit 2 (bad usage: `--help`'s table)
    for a location's package as for a torch command's; `init s3://...` exited 4."""
    for args in (["init", "s3://bucket/ckpts"], ["log", "s3://bucket/ckpts"],
                 ["sync", "s3://bucket/ckpts", "s3://bucket/copy"]):
        line = assert_one_error_line(run_cli(*args, prefix=without("s3fs")), 2)
        assert "s3:// locations need a package that is not installed" in line
        assert line.endswith("pip install s3fs (what the [s3] extra installs)")


def test_plan_and_the_core_commands_need_no_torch(filled: Path) -> None:
    planned = run_cli("plan", "--save-seconds", "2", "--mtbf", "6", prefix=WITHOUT_TORCH)
    assert planned.returncode == 0, planned.stderr
    assert "save every" in planned.stdout
    assert run_cli("log", str(filled), prefix=WITHOUT_TORCH).returncode == 0


# --- a reader that stops early --------------------------------------------------------------


#: One invocation of every command that writes to stdout (help and version too).
EVERY_COMMAND = [
    ["log", "{store}"], ["show", "{store}", "r@2"], ["diff", "{store}", "r@1", "r@2", "--all"],
    ["report", "{store}"], ["verify", "{store}"], ["tag", "{store}"],
    ["rm", "{store}", "r@2", "--dry-run"], ["gc", "{store}", "--dry-run"],
    ["prune", "{store}", "--keep-last", "1", "--dry-run"], ["index", "rebuild", "{store}"],
    ["init", "{store}-new"], ["plan", "--save-seconds", "2", "--mtbf", "6", "--json"],
    ["--help"], ["show", "--help"], ["--version"],
]


def test_a_closed_pipe_ends_every_command_quietly(filled: Path) -> None:
    """The reader is gone before the first line is written, so every write fails.
    The commands run side by side; each must exit 0 and print nothing."""
    procs = []
    for args in EVERY_COMMAND:
        proc = subprocess.Popen([*CLI, *(a.format(store=filled) for a in args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.close()  # before the interpreter has even started
        procs.append(proc)
    outcomes = {}
    for args, proc in zip(EVERY_COMMAND, procs, strict=True):
        with proc:
            assert proc.stderr is not None
            stderr = proc.stderr.read()
            outcomes[" ".join(args[:2])] = (proc.wait(timeout=120), stderr)
    assert {cmd: out for cmd, out in outcomes.items() if out != (0, "")} == {}


def test_head_reading_a_few_lines_of_a_long_listing(store_path: Path) -> None:
    """Like `chunkstore show ... | head -3`: far more output than the pipe holds, so
    the command is still writing when the reader leaves."""
    with chunkstore.open(store_path, create=True) as store, store.new_version("wide", 1) as v:
        for i in range(1500):
            v.put_data(f"entry{i:04d}", i)
    with subprocess.Popen([*CLI, "show", str(store_path), "wide@1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()
        stderr = proc.stderr.read()
        assert proc.wait(timeout=120) == 0
    assert head[0].startswith("id ")
    assert stderr == ""


# --- Ctrl-C ---------------------------------------------------------------------------------


def _stall_one_chunk(store_path: Path) -> Path:
    """Replace one chunk object (or the pack holding the chunk) by a named pipe that
    nothing writes: opening it blocks, so the command is certainly in the middle of
    its work at SIGINT."""
    with chunkstore.open(store_path, create=False) as store:
        shard = store.open_version("r@2").entry("model.big").shards[0]
    location = shard.location(0)  # in a store with delta chains the chunk lies in a pack
    path = store_path / CHUNKS.key(shard.chunks[0] if location is None else location.pack)
    path.unlink()
    os.mkfifo(path)
    return path


def _wait_until_blocked_opening(pid: int, timeout: float = 60.0) -> None:
    """Wait until a thread of ``pid`` is blocked opening the pipe (no writer ever opens
    it, so every read of that chunk, whole or by range, stays blocked in open(2))."""
    deadline = time.monotonic() + timeout
    while True:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                if (task / "wchan").read_text() == "wait_for_partner":
                    return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} never opened the stalled chunk")
        time.sleep(0.02)


def _can_see_blocked_opens(tmp_path: Path) -> bool:
    """Whether /proc shows where a thread sleeps (Linux with kernel symbols)."""
    fifo = tmp_path / "probe"
    os.mkfifo(fifo)
    opener = threading.Thread(target=lambda: open(fifo, "rb").close(), daemon=True)
    opener.start()
    try:
        _wait_until_blocked_opening(os.getpid(), timeout=5.0)
        return True
    except AssertionError:
        return False
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the opener go
        opener.join(timeout=5.0)


# `chunkstore ARGS` with Ctrl-C handled as an interactive shell leaves it: a job started
# in the background of a non-interactive shell (a CI script's `&`) inherits SIGINT
# ignored, and Python keeps it so.
_CLI_WITH_CTRL_C = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from chunkstore.cli import main
sys.argv = ["chunkstore", *sys.argv[1:]]
main()
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_exits_130_with_one_line(filled: Path, tmp_path: Path, as_json: bool) -> None:
    if not _can_see_blocked_opens(tmp_path):
        pytest.skip("needs /proc/PID/task/TID/wchan")
    _stall_one_chunk(filled)
    args = ["verify", str(filled), *(["--json"] if as_json else [])]
    with subprocess.Popen([sys.executable, "-c", _CLI_WITH_CTRL_C, *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _wait_until_blocked_opening(proc.pid)
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            # The command ends at once, while the open it started still hangs (it does
            # not wait for its worker threads): nothing here depends on timing.
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (proc.returncode, stderr, stdout) == (130, "chunkstore: error: interrupted\n", "")


_INTERRUPTED_IN_A_POOL_LOCK = """
import sys, threading
import chunkstore
from chunkstore.cli import main

def verify(self, *args, **kwargs):
    done = threading.Event()
    self.executor.submit(done.wait)  # a worker, busy until done
    # What a Ctrl-C that strikes inside the pool's submit can leave behind: the lock of
    # the pool's idle semaphore held, so the worker blocks once its job ends.
    self.executor._idle_semaphore._cond.acquire()
    done.set()
    raise KeyboardInterrupt

chunkstore.Store.verify = verify
sys.argv = ["chunkstore", "verify", sys.argv[1]]
main()
"""


def test_ctrl_c_never_waits_for_the_worker_threads(filled: Path) -> None:
    """Ctrl-C may leave a lock of the worker pool held; the command still exits at once."""
    result = subprocess.run([sys.executable, "-c", _INTERRUPTED_IN_A_POOL_LOCK, str(filled)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "chunkstore: error: interrupted\n"


def test_a_bad_duration_names_examples_a_shell_user_can_type(filled: Path) -> None:
    """The examples named "a timedelta", which no command line can pass."""
    line = assert_one_error_line(run_cli("gc", str(filled), "--grace", "5q"), 2)
    assert "'5q' is not a duration (examples: 90 (seconds), 30m, 1h, 2d, 1w)" in line
    assert "timedelta" not in line


# --- the examples of --help -----------------------------------------------------------------


def test_verify_helps_sampled_example_runs_on_every_day_of_the_year() -> None:
    """`date +%j` is zero-padded, and bash reads 008, 009, 018, 019 ... 078, 079 and
    080-099 as malformed octal: the example's arithmetic failed on 36 days a year.  It runs here
    under bash with each day of a leap year put in for `$(date +%j)`."""
    from click.testing import CliRunner

    from chunkstore.cli import cli

    text = CliRunner().invoke(cli, ["verify", "--help"]).output
    example = next(line for line in text.splitlines() if "--read-data-subset \"$((" in line)
    arithmetic = example.split('--read-data-subset "', 1)[1].rsplit('"', 1)[0]
    assert "$(date +%j)" in arithmetic, example
    days = range(1, 367)
    script = "\n".join(
        f"echo {arithmetic.replace('$(date +%j)', f'{day:03d}')}" for day in days)
    done = subprocess.run(["bash", "-c", "set -e\n" + script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"{day % 7 + 1}/7" for day in days]


# --- storage options a filesystem refuses ---------------------------------------------------


@pytest.mark.parametrize("option", ["secret_key=hunter2", "client_kwargs=3",
                                    "endpoint_url=notaurl"])
def test_a_storage_option_s3fs_refuses_is_bad_input(filled: Path, option: str) -> None:
    """An unknown option or a value of the wrong type gave sync (and every command on an
    s3:// store) a TypeError, AttributeError or ValueError traceback from inside s3fs: one
    line, exit 2, naming the options but not their values (they may be credentials)."""
    pytest.importorskip("s3fs")
    proc = run_cli("--storage-option", option, "--storage-option", "anon=true",
                   "sync", str(filled), "s3://bucket/copy")
    line = assert_one_error_line(proc, 2)
    assert "s3://bucket/copy: its filesystem refused the storage options" in line
    assert f"({', '.join(sorted(['anon', option.partition('=')[0]]))})" in line
    assert "hunter2" not in line


def test_storage_options_that_are_no_dict_are_a_typed_error(filled: Path,
                                                          tmp_path: Path) -> None:
    """sync(dst_options='x') raised TypeError from a `**` deep inside."""
    from chunkstore.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="storage options are a dict"):
        chunkstore.open("memory://somewhere", storage_options="x")  # type: ignore[arg-type]
    for options in ({"dst_options": "x"}, {"src_options": ["x"]}, {"dst_options": {1: 2}}):
        with pytest.raises(InvalidInputError, match="storage options are a dict"):
            chunkstore.sync(filled, tmp_path / "copy", **options)  # type: ignore[arg-type]
        assert not (tmp_path / "copy").exists()


# --- sync's locations -----------------------------------------------------------------------


def test_a_dry_run_into_a_file_fails_as_the_sync_does(filled: Path, tmp_path: Path) -> None:
    """`sync --dry-run SRC FILE` said it would create a store there and exited 0; the
    sync itself exits 2.  A path under a file is no place for a store either."""
    afile = tmp_path / "notes.txt"
    afile.write_text("not a store")
    for dst in (afile, afile / "sub"):
        real = assert_one_error_line(run_cli("sync", str(filled), str(dst)), 2)
        dry = assert_one_error_line(run_cli("sync", "--dry-run", str(filled), str(dst)), 2)
        assert dry == real == f"chunkstore: error: cannot create a store at {dst}: Not a directory"
    assert afile.read_text() == "not a store"
    dry = run_cli("sync", "--dry-run", str(filled), str(tmp_path / "new" / "store"))
    assert dry.returncode == 0, dry.stderr  # a directory to come: a dry run says so
    assert not (tmp_path / "new").exists()


def test_sync_locations_that_name_no_store_are_a_typed_error(filled: Path,
                                                             tmp_path: Path) -> None:
    """sync(src=123) raised TypeError from os.fspath, deep inside."""
    from chunkstore.errors import InvalidInputError, StoreLocationError

    for src, dst in ((123, tmp_path / "copy"), (filled, 123), (None, tmp_path / "copy")):
        with pytest.raises(InvalidInputError, match="a store is named by a path or URL"):
            chunkstore.sync(src, dst)  # type: ignore[arg-type]
    afile = tmp_path / "notes.txt"
    afile.write_text("not a store")
    with pytest.raises(StoreLocationError, match="Not a directory"):
        chunkstore.sync(filled, afile, dry_run=True)
    assert not (tmp_path / "copy").exists()
