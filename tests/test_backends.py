"""Every backend against the shared conformance suite, plus backend-specific contracts."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from chunkstore.backends import open_backend, wrappers
from chunkstore.backends.base import Backend
from chunkstore.backends.fsspec_backend import FsspecBackend
from chunkstore.backends.local import LocalBackend
from chunkstore.backends.wrappers import (
    FAULT_ENV_VAR,
    ForwardingBackend,
    KillAfterBackend,
    ReadOnlyBackend,
    RequestHook,
    wrap_from_env,
)
from chunkstore.errors import (
    BackendError,
    BackendUnavailableError,
    InvalidInputError,
    MissingDependencyError,
)
from tests.backend_conformance import BackendConformance
from tests.s3server import (
    create_bucket,
    remove_bucket,
    s3_endpoint,
    storage_options,
    unreachable_backend,
)

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO_ROOT = Path(__file__).resolve().parent.parent


# --- local ---------------------------------------------------------------------------------


class TestLocalBackend(BackendConformance):
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp = tmp_path

    def make_backend(self) -> Backend:
        return LocalBackend(str(self.tmp / uuid.uuid4().hex))

    def test_root_is_absolute_and_created_on_first_write(self) -> None:
        root = self.tmp / "store"
        backend = LocalBackend(os.path.relpath(root))
        assert backend.local_path() == str(root)
        assert list(backend.list()) == []
        assert not root.exists()
        backend.put("a/b", b"x")
        assert (root / "a" / "b").read_bytes() == b"x"

    def test_a_large_view_maps_the_file_and_outlives_its_deletion_and_replacement(
            self, backend: Backend) -> None:
        """A view of at least MAP_MIN_BYTES is the file mapped (read-only: a write is
        refused, not a fault), and stays the bytes it was when the object is deleted or
        replaced, as a store's GC and writers do (unlink, rename over)."""
        from chunkstore.backends import local
        data = os.urandom(2 * local.MAP_MIN_BYTES)
        backend.put("a", data)
        backend.put("b", data)
        views = [backend.view_range(key, 5, len(data)) for key in ("a", "b")]
        assert all(isinstance(view, memoryview) and view.readonly for view in views)
        with pytest.raises(TypeError):
            views[0][0] = 1  # type: ignore[index]
        assert backend.delete("a")
        backend.put("b", os.urandom(len(data)))  # a new file renamed over the old
        assert [bytes(view) for view in views] == [data[5:]] * 2
        small = backend.view_range("b", 0, local.MAP_MIN_BYTES - 1)
        assert isinstance(small, bytes)  # a copy below the threshold

    @pytest.mark.skipif(sys.platform != "linux", reason="reads are mapped on Linux only")
    def test_a_range_mapped_unpopulated_reads_right_after_its_pages_are_released(
            self, backend: Backend) -> None:
        """A run mapped with ``populate=False``, populated and released part by part (a
        restore's members): every part, and the whole, reads back the file's bytes
        after its pages were dropped (the page cache keeps them); bytes that are not a
        mapping are left alone."""
        from chunkstore.backends import local
        data = os.urandom(2 * local.MAP_MIN_BYTES + 123)
        backend.put("a", data)
        view = backend.view_range("a", 100, len(data), populate=False)
        assert isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap)
        spans = [(i, i + 3 * mmap.PAGESIZE + 7) for i in range(0, len(view), 50_000)]
        parts = [view[begin:end] for begin, end in spans]
        for part in parts:
            local.populate_mapped(part)
            local.release_mapped(part)
        local.release_mapped(view)
        assert [bytes(part) for part in parts] == [data[100 + begin : 100 + end]
                                                   for begin, end in spans]
        assert bytes(view) == data[100:]
        copied = memoryview(bytearray(data))
        local.populate_mapped(copied)
        local.release_mapped(copied)
        local.release_mapped(b"abc")
        assert bytes(copied) == data

    def test_an_object_written_in_pieces_is_their_bytes_end_to_end(self, backend: Backend
                                                                    ) -> None:
        """A pack written from its pieces (writev, more pieces than one call takes, empty
        ones among them) holds their bytes laid end to end, created once."""
        from chunkstore.backends import local
        pieces: list[bytes | memoryview] = [os.urandom(i % 7) for i in range(local._IOV_MAX + 300)]
        pieces.insert(5, memoryview(os.urandom(3 * local.EAGER_SYNC_BYTES)))
        assert backend.put_pieces_if_absent_deferred("p", pieces) is True
        assert backend.put_pieces_if_absent_deferred("p", [b"other"]) is False
        backend.flush()
        assert backend.get("p") == b"".join(pieces)

    def test_a_small_object_is_copied_whatever_length_is_asked(self, backend: Backend) -> None:
        """The threshold applies to what the file holds in the range: a read bounded by
        an object's largest possible size (a chunk's) gets a small object copied."""
        from chunkstore.backends import local
        backend.put("small", b"0123456789")
        view = backend.view_range("small", 2, 4 * local.MAP_MIN_BYTES)
        assert isinstance(view, bytes) and view == b"23456789"

    @pytest.mark.skipif(sys.platform != "linux", reason="reads are mapped on Linux only")
    def test_what_cannot_be_mapped_is_none(self, tmp_path: Path) -> None:
        """A descriptor mmap refuses (a pipe here; a filesystem without mmap, a process
        out of maps) gives None, and view_range reads the range instead."""
        from chunkstore.backends import local
        assert local._POPULATE_READ is not None
        read_end, write_end = os.pipe()
        try:
            assert local._mapped(read_end, 0, local.MAP_MIN_BYTES,
                                 local._POPULATE_READ) is None
        finally:
            os.close(read_end)
            os.close(write_end)

    def test_a_kernel_that_cannot_populate_a_map_gets_copies(
            self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        """madvise refusing the populate advice (EINVAL: a kernel before 5.14; here an
        advice no kernel knows) turns mapping off: the same bytes, copied."""
        from chunkstore.backends import local
        monkeypatch.setattr(local, "_POPULATE_READ", 9999)
        monkeypatch.setattr(LocalBackend, "map_reads", True)
        data = os.urandom(2 * local.MAP_MIN_BYTES)
        backend.put("a", data)
        for _ in range(2):
            view = backend.view_range("a", 1, len(data))
            assert isinstance(view, bytes) and view == data[1:]
            assert LocalBackend.map_reads is False

    def test_temp_files_are_never_listed_or_left_behind(self, backend: Backend) -> None:
        backend.put("chunks/ab/ab01", b"x")
        assert backend.put_if_absent("chunks/ab/ab01", b"y") is False
        assert backend.put_if_absent("chunks/ab/ab02", b"y") is True
        chunk_dir = Path(str(backend.local_path())) / "chunks" / "ab"
        assert sorted(p.name for p in chunk_dir.iterdir()) == ["ab01", "ab02"]
        (chunk_dir / ".tmp-leftover-from-a-crash").write_bytes(b"partial")
        assert list(backend.list()) == ["chunks/ab/ab01", "chunks/ab/ab02"]
        assert list(backend.list("chunks/ab/.tmp")) == []

    def test_index_directory_at_the_root_is_ignored(self, backend: Backend) -> None:
        root = Path(str(backend.local_path()))
        (root / "index").mkdir(parents=True)
        (root / "index" / "data.mdb").write_bytes(b"lmdb")
        backend.put("runs/index/x", b"not the index")
        backend.put("indexes", b"not the index either")
        assert frozenset({"index"}) == LocalBackend.IGNORED_TOP_LEVEL
        assert list(backend.list()) == ["indexes", "runs/index/x"]
        assert list(backend.list("index")) == ["indexes"]
        assert list(backend.list("index/")) == []

    @pytest.mark.parametrize(
        "key", ["../escape", "/etc/passwd", "a/../../b", "a//b", "", "a/", "./a", "index/x",
                "a/.tmp-x", "a\\b"],
    )  # fmt: skip
    def test_path_like_keys_are_rejected(self, backend: Backend, key: str) -> None:
        with pytest.raises(ValueError, match="key"):
            backend.put(key, b"x")
        with pytest.raises(ValueError, match="key"):
            backend.get(key)
        assert not (self.tmp / "escape").exists()

    def test_stat_matches_os_stat(self, backend: Backend) -> None:
        backend.put("k", b"abc")
        st = os.stat(os.path.join(str(backend.local_path()), "k"))
        assert backend.stat("k").mtime == st.st_mtime

    @pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fds")
    def test_writes_fsync_file_then_every_directory_they_change(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        synced = _record_fsyncs(monkeypatch)
        root = self.tmp / "store"
        backend = LocalBackend(str(root))
        backend.put("chunks/ab/ab01", b"data")
        chunk_dir = str(root / "chunks" / "ab")
        temp_file = next(p for p in synced if os.path.basename(p).startswith(".tmp-"))
        assert os.path.dirname(temp_file) == chunk_dir
        # Each new directory's parent, then the target's directory after the rename.
        new_dirs = [str(self.tmp), str(root), str(root / "chunks")]
        assert synced == [*new_dirs, temp_file, chunk_dir]

        for operation in (
            lambda: backend.put("chunks/ab/ab01", b"again"),
            lambda: backend.put_if_absent("chunks/ab/ab01", b"lost"),
            lambda: backend.delete("chunks/ab/ab01"),
        ):
            synced.clear()
            operation()
            assert synced[-1] == chunk_dir


    @pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fds")
    def test_put_if_absent_syncs_an_unnamed_file_before_naming_it(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        root = self.tmp / "store"
        backend = LocalBackend(str(root))
        backend.put("chunks/ab/ab01", b"data")
        if not backend._unnamed:
            pytest.skip("this filesystem has no O_TMPFILE")
        synced = _record_fsyncs(monkeypatch)
        assert backend.put_if_absent("chunks/ab/ab02", b"more") is True
        chunk_dir = str(root / "chunks" / "ab")
        # The file while it has no name (its data durable first), then the directory.
        assert len(synced) == 2 and synced[1] == chunk_dir, synced
        assert synced[0].startswith(chunk_dir + "/#") and synced[0].endswith("(deleted)")
        assert sorted(os.listdir(chunk_dir)) == ["ab01", "ab02"]
        assert backend.get("chunks/ab/ab02") == b"more"


class TestLocalBackendNamedTemps(TestLocalBackend):
    """The same, where the filesystem has no O_TMPFILE: named temp files, renamed or linked."""

    def make_backend(self) -> Backend:
        backend = LocalBackend(str(self.tmp / uuid.uuid4().hex))
        backend._unnamed = False
        return backend


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch ``os.fsync`` to record the path of each fd it syncs, in order."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return synced


# --- memory:// -----------------------------------------------------------------------------


class TestMemoryBackend(BackendConformance):
    @pytest.fixture(autouse=True)
    def _cleanup(self) -> Iterator[None]:
        self.urls: list[str] = []
        yield
        fs = fsspec.filesystem("memory")
        for url in self.urls:
            root = fs._strip_protocol(url)
            if fs.exists(root):
                fs.rm(root, recursive=True)

    def make_backend(self) -> Backend:
        url = f"memory://chunkstore-test-{uuid.uuid4().hex}"
        self.urls.append(url)
        return FsspecBackend(url)

    def test_create_is_atomic_only_within_the_process(self, backend: Backend) -> None:
        assert isinstance(backend, FsspecBackend)
        assert backend.atomic_create is False


def test_a_store_without_a_conditional_create_says_to_save_from_one_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A protocol with no conditional create this release knows (here fsspec's own
    ``file://``, reached through the fsspec backend) is announced when opened; S3 and
    memory:// (one process) are not."""
    with caplog.at_level(logging.WARNING, logger="chunkstore.backends.fsspec_backend"):
        FsspecBackend(f"memory://chunkstore-test-{uuid.uuid4().hex}")
        assert not caplog.records
        backend = FsspecBackend(f"file://{tmp_path}")
    assert backend.atomic_create is False
    (record,) = caplog.records
    assert "one process at a time" in record.getMessage()


# --- S3 (a real moto server, or the one CI names) ------------------------------------------


@pytest.fixture(scope="class")
def s3_bucket(s3_endpoint: str) -> Iterator[str]:
    """One bucket for the class: each test's backend has a fresh prefix of its own."""
    bucket = create_bucket(s3_endpoint)
    yield bucket
    remove_bucket(s3_endpoint, bucket)


@pytest.mark.s3
class TestS3Backend(BackendConformance):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_endpoint: str, s3_bucket: str) -> None:
        self.endpoint = s3_endpoint
        self.bucket = s3_bucket

    def make_backend(self) -> Backend:
        url = f"s3://{self.bucket}/{uuid.uuid4().hex[:8]}"
        backend = FsspecBackend(url, **storage_options(self.endpoint))
        # Pages of 2 keys (S3 sends 1,000): every listing of the shared suite, its
        # state machine's included, crosses page boundaries.
        backend.list_page_keys = 2
        return backend

    def test_put_if_absent_sends_if_none_match(self, backend: Backend) -> None:
        assert isinstance(backend, FsspecBackend)
        assert backend.atomic_create is True
        seen: list[str | None] = []

        def record_headers(request: Any, **_: Any) -> None:
            value = request.headers.get("If-None-Match")
            seen.append(value.decode() if isinstance(value, bytes) else value)

        backend.put("warm-up", b"")  # connects, so the client below exists
        client = backend.fs.s3  # type: ignore[attr-defined]
        client.meta.events.register("before-send.s3.PutObject", record_headers)
        assert backend.put_if_absent("k", b"one") is True
        assert backend.put_if_absent("k", b"two") is False  # the server said 412
        backend.put("k", b"three")
        assert seen == ["*", "*", None]
        assert backend.get("k") == b"three"

    def test_list_info_takes_sizes_and_times_from_the_listing(self, backend: Backend) -> None:
        """One ListObjectsV2 request, no HEAD per key (a GC's sweep lists every object
        of the store through it), and each key's size and time as a HEAD gives them."""
        assert isinstance(backend, FsspecBackend)
        for key, data in (("chunks/a/1", b"12345"), ("chunks/b/2", b""), ("nodes/3", b"x")):
            backend.put(key, data)
        sent: list[str] = []
        client = backend.fs.s3  # type: ignore[attr-defined]
        client.meta.events.register("before-send.s3", lambda event_name, **_: sent.append(
            event_name.rsplit(".", 1)[-1]))
        infos = list(backend.list_info("chunks/"))
        assert sent == ["ListObjectsV2"]
        assert [(info.key, info.size) for info in infos] == [("chunks/a/1", 5), ("chunks/b/2", 0)]
        for info in infos:
            assert abs(info.mtime - backend.stat(info.key).mtime) < 1.0

    # --- listings page by page (a GC's sweep lists every object of the store) ----------

    @staticmethod
    def _lists_sent(backend: FsspecBackend) -> list[dict[str, Any]]:
        """The parameters of each ListObjectsV2 request ``backend`` sends from now on."""
        sent: list[dict[str, Any]] = []
        client = backend.fs.s3  # type: ignore[attr-defined]
        client.meta.events.register("before-parameter-build.s3.ListObjectsV2",
                                    lambda params, **_: sent.append(dict(params)))
        return sent

    def test_a_listing_sends_each_page_once_the_one_before_is_used_up(
            self, backend: Backend) -> None:
        """A listing holds one page, never the whole prefix: the request for the next
        page goes out when the listing reaches it, not before."""
        assert isinstance(backend, FsspecBackend)
        backend.list_page_keys = 3
        keys = [f"chunks/{i:02d}" for i in range(7)]
        for key in keys:
            backend.put(key, key.encode())
        sent = self._lists_sent(backend)
        for listing in (backend.list("chunks/"), (i.key for i in backend.list_info("chunks/"))):
            seen = len(sent)
            reached = [(next(listing), len(sent) - seen) for _ in keys]
            assert next(listing, None) is None
            assert reached == [(key, 1 + i // 3) for i, key in enumerate(keys)]
            assert len(sent) - seen == 3
        assert {params["MaxKeys"] for params in sent} == {3}

    def test_listings_across_page_boundaries_with_prefixes(self, backend: Backend) -> None:
        """Every prefix lists exactly its keys, in byte order, in max(1, ceil(n / page))
        requests, whether n fills its last page or not; sizes come with the keys."""
        assert isinstance(backend, FsspecBackend)
        backend.list_page_keys = 3
        stored = {f"chunks/{a}/{a}{i}": i for a in ("ab", "ac") for i in range(6)}
        stored |= {"chunks/ab.x": 9, "chunksx": 1, "nodes/n": 2, "a": 0}
        for key, size in stored.items():
            backend.put(key, bytes(size))
        sent = self._lists_sent(backend)
        for prefix in ("", "chunks/", "chunks/ab", "chunks/ab/", "chunks/ab/ab5", "nodes/",
                       "none/"):
            expected = sorted(key for key in stored if key.startswith(prefix))
            seen = len(sent)
            assert list(backend.list(prefix)) == expected, prefix
            assert len(sent) - seen == max(1, -(-len(expected) // 3)), prefix
            infos = list(backend.list_info(prefix))
            assert [(i.key, i.size) for i in infos] == [(k, stored[k]) for k in expected]

    def test_keys_added_and_removed_mid_listing(self, backend: Backend) -> None:
        """A key stored throughout a listing comes exactly once and in order whatever
        is added or removed meanwhile; the listing goes on from where it is (as S3
        does), so a key added ahead of it comes and one removed ahead does not."""
        assert isinstance(backend, FsspecBackend)
        backend.list_page_keys = 2
        keys = [f"chunks/{i:02d}" for i in range(10)]
        for key in keys:
            backend.put(key, b"x")
        listing = backend.list("chunks/")
        listed = [next(listing), next(listing)]  # the first page, read to its end
        backend.delete("chunks/00")  # listed already
        backend.delete("chunks/05")  # ahead
        backend.put("chunks/00a", b"x")  # behind
        backend.put("chunks/07a", b"x")  # ahead
        listed += list(listing)
        assert listed == sorted(set(listed))  # ascending, no key twice
        assert set(keys) - {"chunks/00", "chunks/05"} <= set(listed)
        assert "chunks/07a" in listed
        assert "chunks/05" not in listed and "chunks/00a" not in listed

    def test_the_request_hook_sees_every_list_request(self, backend: Backend) -> None:
        """A counting hook's listings and the keys they return account for every
        ListObjectsV2 sent: one per listing and page (``list_page_keys`` keys each),
        a listing left after its first key one request."""
        assert isinstance(backend, FsspecBackend)
        backend.list_page_keys = 2

        class Pages(RequestHook):
            listings = pages = 0

            def request(self, operation: str, key: str) -> None:
                self.listings += operation == "list"

            def listed(self, prefix: str, count: int) -> None:
                self.pages += max(1, -(-count // backend.list_page_keys)) - 1

        for i in range(5):
            backend.put(f"chunks/{i}", b"")
            backend.put(f"nodes/{i}", b"")
        hook = Pages(backend)
        sent = self._lists_sent(backend)
        for prefix in ("", "chunks/", "nodes/3", "none/"):
            assert len(list(hook.list(prefix))) == len(list(hook.list_info(prefix)))
        next(hook.list("chunks/"))
        assert len(sent) == hook.listings + hook.pages == 2 * (5 + 3 + 1 + 1) + 1

    def test_open_backend_passes_storage_options(self) -> None:
        backend = open_backend(f"s3://{self.bucket}/via-registry", **storage_options(self.endpoint))
        assert isinstance(backend, FsspecBackend)
        backend.put("k", b"v")
        assert list(backend.list()) == ["k"]


def test_a_listing_whose_s3_server_is_down_is_a_typed_error_naming_its_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each page's request is a storage request like any other: where nothing listens
    (a closed loopback port) the listing raises :class:`BackendUnavailableError` with
    the listing's prefix, not botocore's own exception."""
    backend = unreachable_backend(monkeypatch)
    backend.fs.retries = 1  # type: ignore[attr-defined]  # s3fs's own, besides botocore's
    for listing in (backend.list, backend.list_info):
        with pytest.raises(BackendUnavailableError, match="chunks/"):
            next(iter(listing("chunks/")))


# --- registry ------------------------------------------------------------------------------


class TestOpenBackend:
    def test_plain_and_file_urls_are_local_and_absolute(self, tmp_path: Path) -> None:
        for location in (str(tmp_path), f"file://{tmp_path}", os.path.relpath(tmp_path)):
            backend = open_backend(location)
            assert isinstance(backend, LocalBackend)
            assert backend.local_path() == str(tmp_path)

    def test_other_schemes_go_through_fsspec(self) -> None:
        backend = open_backend(f"memory://registry-{uuid.uuid4().hex}")
        assert isinstance(backend, FsspecBackend)

    def test_missing_package_names_what_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(sys.modules, "s3fs", None)  # makes `import s3fs` fail
        with pytest.raises(MissingDependencyError,
                           match=r"pip install s3fs \(what the \[s3\] extra installs\)"):
            open_backend("s3://bucket/store")

    def test_unknown_scheme_is_invalid_input(self) -> None:
        with pytest.raises(InvalidInputError, match="nosuchscheme"):
            open_backend("nosuchscheme://x")

    def test_local_paths_take_no_storage_options(self, tmp_path: Path) -> None:
        with pytest.raises(InvalidInputError, match="storage options"):
            open_backend(str(tmp_path), anon=True)


# --- wrappers ------------------------------------------------------------------------------


class TestReadOnlyBackend:
    def test_reads_pass_through_and_writes_are_refused(self, tmp_path: Path) -> None:
        inner = LocalBackend(str(tmp_path))
        inner.put("k", b"value")
        backend = ReadOnlyBackend(inner)
        assert backend.get("k") == b"value"
        assert backend.get_range("k", 1, 2) == b"al"
        assert list(backend.list()) == ["k"]
        assert backend.local_path() == str(tmp_path)
        for write in (
            lambda: backend.put("k", b"x"),
            lambda: backend.put_if_absent("new", b"x"),
            lambda: backend.delete("k"),
            lambda: backend.delete_many(["k"]),
        ):
            with pytest.raises(BackendError, match="read-only"):
                write()
        assert inner.get("k") == b"value"
        assert list(inner.list()) == ["k"]


class TestDeleteManyThroughWrappers:
    """A wrapper that intercepts ``delete`` sees each key of a ``delete_many``; one that
    does not forwards the bulk call (S3 keeps its batches); a counting hook counts a
    request per batch."""

    def test_a_wrapper_that_intercepts_delete_sees_every_key(self, tmp_path: Path) -> None:
        inner = LocalBackend(str(tmp_path))
        for key in ("versions/a", "versions/b", "tags/t"):
            inner.put(key, b"x")
        seen: list[str] = []

        class Watching(ForwardingBackend):
            def delete(self, key: str) -> bool:
                seen.append(key)
                return super().delete(key)

        Watching(inner).delete_many(["versions/a", "versions/b"])
        assert seen == ["versions/a", "versions/b"]
        assert list(inner.list()) == ["tags/t"]

    def test_a_plain_forwarder_and_a_hook_forward_the_bulk_call(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[list[str]] = []
        inner = LocalBackend(str(tmp_path))
        real = inner.delete_many
        monkeypatch.setattr(inner, "delete_many", lambda keys: (calls.append(list(keys)),
                                                                 real(keys))[1])
        requests: list[tuple[str, str]] = []

        class Hook(RequestHook):
            def request(self, operation: str, key: str) -> None:
                requests.append((operation, key))

        monkeypatch.setattr(wrappers, "DELETE_BATCH", 2)
        keys = [f"versions/{i}" for i in range(5)]
        for key in keys:
            inner.put(key, b"")
        Hook(ForwardingBackend(inner)).delete_many(keys)
        assert calls == [keys[0:2], keys[2:4], keys[4:5]]
        assert requests == [("delete_many", "versions/0"), ("delete_many", "versions/2"),
                            ("delete_many", "versions/4")]
        assert list(inner.list()) == []

    def test_kill_at_a_delete_of_a_bulk_delete(self, tmp_path: Path) -> None:
        script = ("import sys\n"
                  "from chunkstore.backends import open_backend\n"
                  "from chunkstore.backends.wrappers import wrap_from_env\n"
                  "wrap_from_env(open_backend(sys.argv[1])).delete_many("
                  "[f'versions/{i}' for i in range(4)])\n")
        backend = LocalBackend(str(tmp_path))
        for i in range(4):
            backend.put(f"versions/{i}", b"")
        env = {**os.environ, FAULT_ENV_VAR: "kill-before-delete:versions/:2"}
        result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                                cwd=REPO_ROOT, capture_output=True, timeout=60, check=False)
        assert result.returncode == -signal.SIGKILL, result.stderr.decode()
        assert list(backend.list()) == ["versions/2", "versions/3"]


KILL_SCRIPT = """
import sys
from chunkstore.backends import open_backend
from chunkstore.backends.wrappers import wrap_from_env
backend = wrap_from_env(open_backend(sys.argv[1]))
backend.put("records/r0", b"not counted: other prefix")
for i in range(3):
    backend.put(f"chunks/c{i}", b"x")
"""


class TestFaultInjection:
    @pytest.mark.parametrize("count", [0, 1, 2, 3])
    def test_kill_before_put_in_a_real_process(self, tmp_path: Path, count: int) -> None:
        env = {**os.environ, FAULT_ENV_VAR: f"kill-before-put:chunks/:{count}"}
        result = subprocess.run(
            [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
        expected_rc = 0 if count >= 3 else -signal.SIGKILL
        assert result.returncode == expected_rc, result.stderr.decode()
        written = [f"chunks/c{i}" for i in range(min(count, 3))]
        assert list(LocalBackend(str(tmp_path)).list()) == [*written, "records/r0"]

    def test_unset_fault_returns_the_backend_unchanged(self, tmp_path: Path) -> None:
        backend = LocalBackend(str(tmp_path))
        assert wrap_from_env(backend, {}) is backend
        assert wrap_from_env(backend, {FAULT_ENV_VAR: ""}) is backend

    def test_fault_spec_is_parsed(self, tmp_path: Path) -> None:
        wrapped = wrap_from_env(
            LocalBackend(str(tmp_path)), {FAULT_ENV_VAR: "kill-before-put:chunks/ab:5"}
        )
        assert isinstance(wrapped, KillAfterBackend)
        assert (wrapped.prefix, wrapped.count) == ("chunks/ab", 5)

    @pytest.mark.parametrize(
        "spec",
        ["kill-before-put", "kill-before-put:chunks/", "kill-before-put:chunks/:-1",
         "kill-before-put:chunks/:two", "explode:chunks/:1", "kill-before-put:chunks/:1.5"],
    )  # fmt: skip
    def test_unparsable_fault_spec_raises(self, tmp_path: Path, spec: str) -> None:
        with pytest.raises(ValueError, match=FAULT_ENV_VAR):
            wrap_from_env(LocalBackend(str(tmp_path)), {FAULT_ENV_VAR: spec})

    def test_non_matching_writes_pass_through(self, tmp_path: Path) -> None:
        backend = KillAfterBackend(LocalBackend(str(tmp_path)), "chunks/", 0)
        backend.put("records/r1", b"x")
        assert backend.put_if_absent("records/r2", b"y") is True
        assert list(backend.list()) == ["records/r1", "records/r2"]


@pytest.mark.parametrize("batch_sync", [True, False])
def test_deferred_puts_behave_like_put_if_absent_and_flush_makes_them_durable(
        tmp_path: Path, batch_sync: bool) -> None:
    backend = LocalBackend(str(tmp_path / "s"), batch_sync=batch_sync)
    assert backend.put_if_absent_deferred("chunks/ab/ab01", b"one") is True
    assert backend.put_if_absent_deferred("chunks/ab/ab01", b"two") is False
    backend.flush()
    assert backend.get("chunks/ab/ab01") == b"one"
    assert not [p for p in (tmp_path / "s").rglob(".tmp-*")]
    assert list(backend.list()) == ["chunks/ab/ab01"]


def test_flush_of_a_store_not_yet_written_is_harmless(tmp_path: Path) -> None:
    LocalBackend(str(tmp_path / "nothing-yet")).flush()
    assert not (tmp_path / "nothing-yet").exists()


def test_the_base_cache_keeps_copies_of_stored_bytes_not_views() -> None:
    """A read-only view (of a mapped file, or of a pack run read whole) is copied when
    cached, so the cache holds the chunk's bytes alone and keeps no file mapped; a
    buffer a decode made is kept as it is."""
    import mmap

    from chunkstore.format.digest import Digest
    from chunkstore.handle.caches import BaseCache
    cache = BaseCache(1 << 20)
    mapped = mmap.mmap(-1, 8192)
    mapped.write(b"x" * 8192)
    stored = memoryview(mapped).toreadonly()[100:4196]
    decoded = memoryview(bytearray(b"y" * 4096))
    cache.put(Digest.of(b"a"), stored)
    cache.put(Digest.of(b"b"), decoded)
    kept = cache.get(Digest.of(b"a"))
    assert isinstance(kept, bytes) and kept == b"x" * 4096
    assert cache.get(Digest.of(b"b")) is decoded
    del stored, kept
    mapped.close()  # BufferError if the cache still exported the mapping


def test_closing_a_store_empties_its_base_cache(tmp_path: Path) -> None:
    import chunkstore
    from chunkstore.format.digest import Digest
    store = chunkstore.open(tmp_path / "s", create=True)
    store.base_cache.put(Digest.of(b"a"), b"a" * 10)
    assert store.base_cache.get(Digest.of(b"a")) is not None
    store.close()
    assert store.base_cache.get(Digest.of(b"a")) is None


def _other_filesystem(path: Path) -> Path | None:
    """A fresh folder on a file system other than ``path``'s, or None: the tmpfs /dev/shm,
    or where ``path`` is on it (./dev test puts tmp_path there) /var/tmp's disk."""
    for place in (Path("/dev/shm"), Path("/var/tmp")):
        if (place.is_dir() and os.access(place, os.W_OK)
                and os.stat(place).st_dev != os.stat(path).st_dev):
            folder = place / f"chunkstore-test-{uuid.uuid4().hex}"
            folder.mkdir()
            return folder
    return None


def test_a_save_syncs_every_file_system_its_objects_went_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46 item 11: a store whose chunks/ is a symlink to another device (here a
    tmpfs, a real second file system): the save's flush syncfs's both file systems,
    the chunks' too, before its commit record; the version reads back, verify and GC
    (which list chunks/ through the link) agree."""
    import numpy as np

    import chunkstore
    from chunkstore.backends import local

    other = _other_filesystem(tmp_path)
    if other is None or local._SYNCFS is None:
        pytest.skip("no second file system (/dev/shm, /var/tmp) or no syncfs(2) here")
    try:
        root = tmp_path / "s"
        chunkstore.open(root, create=True, chunk_size=65536).close()
        with contextlib.suppress(FileNotFoundError):
            (root / "chunks").rmdir()
        (root / "chunks").symlink_to(other)
        synced: list[int] = []
        real_syncfs = local._SYNCFS

        def recording_syncfs(fd: int) -> int:
            synced.append(os.fstat(fd).st_dev)
            return real_syncfs(fd)

        monkeypatch.setattr(local, "_SYNCFS", recording_syncfs)
        w = np.arange(100_000, dtype=np.float32)
        with chunkstore.open(root) as store:
            if not store.objects.backend.batch_sync:  # type: ignore[attr-defined]
                pytest.skip("syncfs does not report write-back errors on this kernel")
            with store.new_version("r", 1) as version:
                version.put("w", w)
                version.put("b", np.arange(10, dtype=np.float32))
            assert set(synced) == {os.stat(root).st_dev, os.stat(other).st_dev}, synced
            assert store.verify().ok and store.gc(grace=0).chunks_deleted == 0
        assert any(other.rglob("*")), "the chunks went through the link"
        with chunkstore.open(root) as store:
            assert np.array_equal(store.open_version("r@1").get("w"), w)
    finally:
        shutil.rmtree(other, ignore_errors=True)
