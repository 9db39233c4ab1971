"""A damaged index is never fatal: set aside, rebuilt from the store, with a warning.

Each case runs the CLI in a real subprocess, so a SIGBUS (a mapped file
shorter than LMDB believes) shows as a negative exit code instead of killing
the test run.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.index.indexfile import probe

CLI = [sys.executable, "-m", "chunkstore"]
W = np.arange(50_000, dtype=np.float32)


@pytest.fixture
def saved(store_path: Path) -> Path:
    with chunkstore.open(store_path, chunk_size=4096, create=True) as store:
        for step in (1, 2):
            with store.new_version("r", step) as version:
                version.put("w", W * step)
                version.put_data("trainer", {"step": step})
    return store_path


def cli(*args: object, limit_as: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False, preexec_fn=limit)


def assert_store_works(path: Path) -> None:
    for command in (("log", path), ("verify", path), ("index", "rebuild", path)):
        done = cli(*command)
        assert done.returncode == 0, (command, done.returncode, done.stderr)
    with chunkstore.open(path, create=True) as store:
        np.testing.assert_array_equal(store.open_version("r@2").get("w"), W * 2)
        assert store.verify().ok


def test_a_truncated_index_is_set_aside_not_a_sigbus(saved: Path) -> None:
    data = saved / "index" / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 3)
    assert "truncated" in (probe(str(saved / "index")) or "")
    done = cli("log", saved)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "damaged" in done.stderr and "set aside" in done.stderr
    assert "r@2" in done.stdout
    assert list(saved.glob("index.damaged-*"))
    assert_store_works(saved)


@pytest.mark.parametrize("offset", [16, 4096 + 16, 40])  # magic of each meta page, page size
def test_a_flipped_byte_in_the_meta_pages_is_set_aside(saved: Path, offset: int) -> None:
    data = saved / "index" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0xFF
    data.write_bytes(bytes(raw))
    done = cli("verify", saved)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert_store_works(saved)


def test_garbage_instead_of_an_index_is_set_aside(saved: Path) -> None:
    (saved / "index" / "data.mdb").write_bytes(os.urandom(3 * 4096))
    done = cli("log", saved)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "set aside" in done.stderr
    assert_store_works(saved)


def test_an_address_space_limit_below_the_map_size_maps_a_smaller_index(saved: Path) -> None:
    """The default map is 64 GiB; under `ulimit -v` of 6 GiB the index still opens."""
    done = cli("log", saved, limit_as=6 << 30)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "r@2" in done.stdout


def test_an_address_space_limit_too_small_for_any_map_says_what_to_raise(
        saved: Path) -> None:
    done = cli("log", saved, limit_as=300 << 20)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("chunkstore: error:"), done.stderr
    assert "ulimit" in lines[-1] or "memory" in lines[-1].lower(), done.stderr


def test_a_rebuild_never_shows_other_processes_an_empty_index(saved: Path) -> None:
    """Readers in other processes during `index rebuild` see every version."""
    stop = threading.Event()
    failures: list[str] = []

    def read() -> None:
        while not stop.is_set():
            done = cli("show", saved, "r@1")
            if done.returncode != 0:
                failures.append(done.stderr)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert cli("index", "rebuild", saved).returncode == 0
    finally:
        stop.set()
        reader.join()
    assert failures == []


@pytest.mark.parametrize("shape", ["data.mdb is a directory", "lock.mdb is a directory",
                                   "the index is a file"])
def test_an_index_of_the_wrong_shape_is_set_aside(saved: Path, shape: str) -> None:
    """A bad copy or restore leaves a directory where LMDB's file was, or a file where
    the index directory was: set aside and rebuilt, as any damaged index (open raised
    IsADirectoryError or FileExistsError until a person intervened)."""
    index = saved / "index"
    if shape == "the index is a file":
        for child in index.iterdir():
            child.unlink()
        index.rmdir()
        index.write_bytes(b"not an index")
    else:
        name = shape.split(maxsplit=1)[0]
        (index / name).unlink()
        (index / name).mkdir()
    done = cli("log", saved)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "damaged" in done.stderr and "set aside" in done.stderr
    assert "r@2" in done.stdout
    assert_store_works(saved)


def test_an_index_deleted_while_it_is_opened_is_made_again(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process deletes the index directory between its creation and LMDB's open
    (an index may be deleted at any time): the open makes it again and goes on; a
    directory that stays unopenable for another reason is still an error."""
    import shutil

    import lmdb

    from chunkstore.errors import BackendError
    from chunkstore.index import indexfile

    real_open = lmdb.open
    deletions = []

    def open_after_a_deletion(path: str, **options: object) -> lmdb.Environment:
        if len(deletions) < 2:  # twice: the second open's directory goes too
            deletions.append(path)
            shutil.rmtree(path)  # gone after LMDB made it, before it opened its file:
            return real_open(path, **{**options, "create": False})  # ENOENT, as then
        return real_open(path, **options)

    monkeypatch.setattr(lmdb, "open", open_after_a_deletion)
    with chunkstore.open(saved) as store:
        assert [v.step for v in store.versions("r")] == [1, 2]
        np.testing.assert_array_equal(store.open_version("r@2").get("w"), W * 2)
    assert len(deletions) == 2

    def refused(path: str, **options: object) -> lmdb.Environment:
        raise lmdb.Error(path, os.strerror(13))  # EACCES: not a vanished directory

    monkeypatch.setattr(lmdb, "open", refused)
    with pytest.raises(BackendError, match="cannot open the index"):
        indexfile.open_env(str(saved / "index"), indexfile.MIN_MAP_SIZE)
