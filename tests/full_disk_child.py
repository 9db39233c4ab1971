"""Full-disk scenarios, run by ``tests/test_full_disk.py`` inside a mount namespace
with a small tmpfs mounted at MOUNT: ``python -m tests.full_disk_child SCENARIO MOUNT``.

Each scenario fills the tmpfs for real, does what a user would, and prints one
JSON line of what happened (error types, exit codes, what reads back); the
parent asserts on it.  Nothing here is mocked: the filesystem is full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.maintenance.mark import MarkSet

RUN = "full"
#: Floats per save: one 4 MiB chunk of incompressible data, so a few saves fill the disk.
SIZE = 1 << 20


def state(step: int) -> np.ndarray:
    return np.random.default_rng(step).random(SIZE).astype(np.float32)


def fill_with_saves(store: chunkstore.Store) -> tuple[list[int], str]:
    """Save until the disk refuses; the saved steps and the type of the refusal."""
    saved = []
    for step in range(1, 1000):
        try:
            with store.new_version(run=RUN, step=step) as version:
                version.put("w", state(step))
        except Exception as exc:
            return saved, type(exc).__name__
        saved.append(step)
    raise AssertionError("the disk never filled")


def fill_rest(mount: Path) -> None:
    """Take every block left (a file of its own, as another program would)."""
    try:
        with open(mount / "filler", "ab") as out:
            while True:
                out.write(b"\0" * 4096)
                out.flush()
    except OSError:
        pass


def free(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def cli(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "chunkstore", *args], capture_output=True,
                          text=True, check=False)
    return {"rc": done.returncode, "traceback": "Traceback" in done.stderr,
            "stderr": done.stderr[-500:]}


def store_full(mount: Path) -> dict[str, Any]:
    """The store's own filesystem fills up: rm and gc must still free it."""
    url = str(mount / "store")
    store = chunkstore.open(url, create=True)
    saved, refusal = fill_with_saves(store)
    store.close()
    fill_rest(mount)
    report: dict[str, Any] = {"saved": saved, "refusal": refusal, "free_full": free(mount)}
    removed = [f"{RUN}@{step}" for step in saved[: len(saved) // 2]]
    report["rm"] = cli("rm", url, *removed)
    report["gc"] = cli("gc", "--grace", "0", url)
    report["free_after"] = free(mount)
    store = chunkstore.open(url)
    kept = saved[len(saved) // 2:]
    report["listed"] = sorted(v.step for v in store.versions())
    report["exact"] = all(
        np.array_equal(store.open_version(f"{RUN}@{step}").get("w"), state(step))
        for step in kept)
    try:
        with store.new_version(run=RUN, step=10_000) as version:
            version.put("w", state(10_000))
        report["save_after"] = "ok"
    except Exception as exc:
        report["save_after"] = type(exc).__name__
    store.close()
    return report


def index_full(mount: Path, elsewhere: Path) -> dict[str, Any]:
    """The index's filesystem (a cache directory beside a remote store) fills up."""
    url = str(elsewhere / "store")
    index_dir = str(mount / "index")
    store = chunkstore.open(url, create=True, index_dir=index_dir)
    with store.new_version(run=RUN, step=1) as version:
        version.put("w", state(1))
    fill_rest(mount)
    report: dict[str, Any] = {}
    try:
        for step in range(2, 200):  # the index grows a page at a time
            with store.new_version(run=RUN, step=step) as version:
                for k in range(50):
                    version.put(f"t{k}", np.full(64, step * 100 + k, dtype=np.int64))
        report["refusal"] = None
    except Exception as exc:
        report["refusal"] = type(exc).__name__
        report["message"] = str(exc)
    report["exact"] = np.array_equal(store.open_version(f"{RUN}@1").get("w"), state(1))
    store.close()
    return report


def mark_set(mount: Path) -> dict[str, Any]:
    """GC's mark set on a full filesystem, and one that fills while marking."""
    from chunkstore.format.digest import Digest

    fill_rest(mount)
    marks = MarkSet(str(mount / "index"))
    report: dict[str, Any] = {"placed_on_mount": marks.path.startswith(str(mount))}
    marks.close()
    os.unlink(mount / "filler")
    # Room for the set to start beside the index, but not for all it will hold.
    with open(mount / "filler", "wb") as out:
        out.write(b"\0" * (free(mount) - (256 << 10)))
    marks = MarkSet(str(mount / "index"))
    report["started_on_mount"] = marks.path.startswith(str(mount))
    digests = [Digest(np.random.default_rng(i).bytes(32)) for i in range(40_000)]
    for start in range(0, len(digests), 1000):
        marks.add_many(b"c", digests[start:start + 1000])
    report["ended_on_mount"] = marks.path.startswith(str(mount))
    report["all_marked"] = all((b"c", d) in marks for d in digests)
    marks.close()
    return report


def main() -> None:
    scenario, mount = sys.argv[1], Path(sys.argv[2])
    if scenario == "store":
        report = store_full(mount)
    elif scenario == "index":
        report = index_full(mount, Path(sys.argv[3]))
    elif scenario == "marks":
        report = mark_set(mount)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
