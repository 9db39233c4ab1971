"""A full disk is a typed error everywhere, and removing versions and running GC on
a full disk frees space (issue: no full disk may stop the store).

The disk is really full: each scenario runs ``tests/full_disk_child.py`` in a
mount namespace of its own (``unshare``) with a small tmpfs mounted for it, fills
it, and reports what happened.  Where this machine cannot make a mount namespace
(no ``unshare``, no user namespaces) the tests are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
MOUNT_SIZE = "64m"


def _namespace_prefix() -> list[str] | None:
    """The ``unshare`` command line that gives a child its own mounts, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    as_root = [] if os.geteuid() == 0 else ["--map-root-user"]
    prefix = [unshare, *as_root, "--mount", "--propagation", "private"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
    return prefix if probe.returncode == 0 else None


PREFIX = _namespace_prefix()
pytestmark = pytest.mark.skipif(PREFIX is None, reason="needs `unshare` to mount a small"
                                " tmpfs in a mount namespace of the test's own")


def run_full(tmp_path: Path, scenario: str, *extra: str) -> dict[str, Any]:
    assert PREFIX is not None
    mount = tmp_path / "disk"
    mount.mkdir()
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CHUNKSTORE_SPACE_RESERVE", None)  # the default reserve, as users have it
    done = subprocess.run(
        [*PREFIX, "sh", "-c", script, "sh", MOUNT_SIZE, str(mount), sys.executable, "-m",
         "tests.full_disk_child", scenario, str(mount), *extra],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rm_and_gc_free_a_store_whose_disk_is_full(tmp_path: Path) -> None:
    report = run_full(tmp_path, "store")
    assert report["refusal"] == "StorageFullError"
    assert report["free_full"] < 64 << 10, "the disk was not full"
    # Removing versions and collecting work on the full disk, without a traceback.
    assert report["rm"] == {**report["rm"], "rc": 0, "traceback": False}, report["rm"]
    assert report["gc"] == {**report["gc"], "rc": 0, "traceback": False}, report["gc"]
    assert report["free_after"] > 4 << 20
    kept = report["saved"][len(report["saved"]) // 2:]
    assert report["listed"] == kept
    assert report["exact"] is True
    assert report["save_after"] == "ok"


def test_a_full_index_filesystem_is_a_typed_error(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = run_full(tmp_path, "index", str(elsewhere))
    assert report["refusal"] == "StorageFullError", report
    assert "index" in report["message"] and "chunkstore gc" in report["message"]
    assert report["exact"] is True


def test_gc_marks_without_room_beside_the_index(tmp_path: Path) -> None:
    report = run_full(tmp_path, "marks")
    assert report["placed_on_mount"] is False  # no room: the set went elsewhere
    assert report["started_on_mount"] is True
    assert report["ended_on_mount"] is False  # filled while marking: moved, kept all
    assert report["all_marked"] is True
