"""The whole CLI against a store seeded with one bad object of each kind.

Every read-only command exits with its documented code and at most a one-line
error (never a traceback), and the good version stays usable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chunkstore.format.digest import Digest
from chunkstore.format.manifest import NODE_FORMAT_VERSION
from chunkstore.objects.kinds import CHUNKS
from tests.test_hostile import (
    _good_root,
    _node,
    _put,
    _record,
    _tensor,
    _tree,
    store_dir,  # noqa: F401  (the fixture)
)

EXIT_OK, EXIT_PROBLEMS, EXIT_INTEGRITY = 0, 1, 3


def _seed_bad_objects(path: Path) -> dict[str, str]:
    """One bad version per kind of damage; returns their ids by kind."""
    good = _good_root(path)
    bad = {}
    bad["empty-shards"] = _record(path, _tree(path, {"w": _tensor([1024], [], shards=[])}),
                                  step=11)
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    bad["deep-tree"] = _record(path, _node(path, b'{"entries":{"a":' + deep
                                           + b'},"format_version":1,"kind":"tree"}'), step=12)
    child = _tree(path, {"w": good["entries"]["w"]})
    for _ in range(10):
        child = _tree(path, {str(i): {"tree": child.hex} for i in range(10)})
    bad["fan-out"] = _record(path, child, step=13)
    bad["bad-run"] = _record(path, _tree(path, {}), run="../x")
    newer = b'{"entries":{},"format_version":%d,"kind":"tree"}' % (NODE_FORMAT_VERSION + 1)
    bad["newer-node"] = _record(path, _node(path, newer), step=14)
    h_chunk = good["entries"]["h"]["tensor"]["shards"][0]["chunks"][0]
    target = path / CHUNKS.key(Digest.parse(h_chunk))
    data = bytearray(target.read_bytes())
    data[12] ^= 0x80  # the raw length: 2**39 more
    _put(path, CHUNKS.key(Digest.parse(h_chunk)), bytes(data))
    return bad


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chunkstore", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def _one_line_error(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) <= 1, done.stderr


@pytest.mark.slow
def test_read_only_commands_on_a_damaged_store(store_dir: Path) -> None:  # noqa: F811
    bad = _seed_bad_objects(store_dir)
    store = str(store_dir)
    done = _cli("log", store)
    _one_line_error(done)
    assert done.returncode == EXIT_OK and "good" in done.stdout
    done = _cli("verify", store)
    _one_line_error(done)
    assert done.returncode == EXIT_PROBLEMS
    for version_id in bad.values():
        assert version_id[:12] in done.stdout or version_id in done.stdout, done.stdout
    for selector, code in [("good@1", EXIT_OK), (bad["empty-shards"], EXIT_INTEGRITY),
                           (bad["deep-tree"], EXIT_INTEGRITY), (bad["fan-out"], EXIT_INTEGRITY),
                           (bad["newer-node"], EXIT_INTEGRITY)]:
        done = _cli("show", store, selector)
        _one_line_error(done)
        assert done.returncode == code, (selector, done.stdout, done.stderr)
    done = _cli("verify", store, "good@1")
    assert done.returncode == EXIT_PROBLEMS  # its chunk "h" is the damaged one
    assert "corrupt-chunk" in done.stdout or "corrupt" in done.stdout
    done = _cli("report", store)
    _one_line_error(done)
    assert done.returncode == EXIT_OK, done.stderr
    done = _cli("index", "rebuild", store)  # rebuilt; the versions it skipped are reported
    assert "Traceback" not in done.stderr
    assert done.returncode == EXIT_PROBLEMS and "rebuilt" in done.stdout, done.stderr
    assert _cli("show", store, "good@1").returncode == EXIT_OK
