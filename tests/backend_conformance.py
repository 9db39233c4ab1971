"""Conformance tests every :class:`Backend` must pass, one test per contract clause.

Subclass :class:`BackendConformance` in a ``Test*`` class and override
:meth:`~BackendConformance.make_backend`; the subclass inherits every test,
including a Hypothesis state machine that drives the backend against a plain
dict.  This module holds no ``Test*`` class, so pytest collects nothing here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from chunkstore.backends import fsspec_backend
from chunkstore.backends.base import Backend, ObjectInfo

MIB = 1 << 20

#: Keys whose byte order differs from a naive per-directory walk ('-' < '.' < '/' < '0').
TRICKY_KEYS = [
    "a-b",
    "a.b",
    "a/b",
    "a/c/d",
    "a0",
    "b",
    "chunks/ab/ab12",
    "chunks/ab/ab34",
    "chunks/ab/cd56",
    "chunks/ac/ac78",
    "chunks/ab.x",
]


class BackendConformance:
    """Shared tests; subclasses override :meth:`make_backend`."""

    def make_backend(self) -> Backend:
        """Return a new, empty backend; may be called several times in one test."""
        raise NotImplementedError

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        backend = self.make_backend()
        yield backend
        backend.close()

    # --- put / get -----------------------------------------------------------------------

    def test_put_get_round_trip_bytes(self, backend: Backend) -> None:
        backend.put("chunks/ab/ab01", b"hello")
        assert backend.get("chunks/ab/ab01") == b"hello"
        assert isinstance(backend.get("chunks/ab/ab01"), bytes)

    def test_put_accepts_memoryviews(self, backend: Backend) -> None:
        buffer = bytearray(b"0123456789")
        backend.put("slice", memoryview(buffer)[2:6])
        floats = np.arange(6, dtype=np.float32)
        backend.put("floats", memoryview(floats))
        buffer[:] = b"xxxxxxxxxx"  # the stored object must not alias the caller's buffer
        assert backend.get("slice") == b"2345"
        assert backend.get("floats") == floats.tobytes()

    def test_put_overwrites_with_shorter_data(self, backend: Backend) -> None:
        backend.put("k", b"a long first version")
        backend.put("k", b"short")
        assert backend.get("k") == b"short"
        assert backend.stat("k").size == 5

    def test_put_is_idempotent(self, backend: Backend) -> None:
        backend.put("k", b"same")
        backend.put("k", b"same")
        assert backend.get("k") == b"same"
        assert list(backend.list()) == ["k"]

    def test_empty_object(self, backend: Backend) -> None:
        backend.put("empty", b"")
        assert backend.get("empty") == b""
        assert backend.stat("empty").size == 0
        assert backend.exists("empty")
        assert list(backend.list()) == ["empty"]
        assert backend.get_range("empty", 0, 10) == b""
        assert backend.read_into("empty", 0, memoryview(bytearray(4))) == 0

    def test_empty_object_put_if_absent(self, backend: Backend) -> None:
        assert backend.put_if_absent("empty", b"") is True
        assert backend.put_if_absent("empty", b"") is False
        assert backend.put_if_absent("empty", b"not empty") is False
        assert backend.get("empty") == b""

    def test_large_object(self, backend: Backend) -> None:
        data = os.urandom(5 * MIB)
        backend.put("big", data)
        assert backend.get("big") == data
        assert backend.stat("big").size == len(data)
        assert backend.get_range("big", 4 * MIB, MIB + 10) == data[4 * MIB :]
        out = bytearray(MIB)
        assert backend.read_into("big", 3 * MIB + 1, memoryview(out)) == MIB
        assert out == data[3 * MIB + 1 : 4 * MIB + 1]

    # --- put_if_absent -------------------------------------------------------------------

    def test_put_if_absent_creates_then_refuses(self, backend: Backend) -> None:
        assert backend.put_if_absent("records/v1", b"first") is True
        assert backend.put_if_absent("records/v1", b"second") is False
        assert backend.get("records/v1") == b"first"

    def test_put_if_absent_after_put_refuses(self, backend: Backend) -> None:
        backend.put("k", b"put")
        assert backend.put_if_absent("k", memoryview(b"create")) is False
        assert backend.get("k") == b"put"

    def test_put_if_absent_after_delete_creates(self, backend: Backend) -> None:
        assert backend.put_if_absent("k", b"one") is True
        assert backend.delete("k") is True
        assert backend.put_if_absent("k", b"two") is True
        assert backend.get("k") == b"two"

    @pytest.mark.parametrize("round_", range(3))
    def test_put_if_absent_concurrent_single_winner(self, backend: Backend, round_: int) -> None:
        key = f"records/race{round_}"
        barrier = threading.Barrier(8)
        results: dict[int, bool] = {}

        def create(writer: int) -> None:
            barrier.wait()
            results[writer] = backend.put_if_absent(key, f"writer {writer}".encode())

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        winners = [writer for writer, created in results.items() if created]
        assert len(results) == 8
        assert len(winners) == 1, f"winners: {winners}"
        assert backend.get(key) == f"writer {winners[0]}".encode()

    # --- missing keys --------------------------------------------------------------------

    @pytest.mark.parametrize(
        "read",
        [
            lambda b: b.get("missing"),
            lambda b: b.stat("missing"),
            lambda b: b.get_range("missing", 0, 4),
            lambda b: b.get_range("missing", 0, 0),
            lambda b: b.read_into("missing", 0, memoryview(bytearray(4))),
            lambda b: b.get("dir/missing"),
        ],
        ids=["get", "stat", "get_range", "get_range_empty", "read_into", "nested_get"],
    )
    def test_missing_key_raises_file_not_found(
        self, backend: Backend, read: Callable[[Backend], object]
    ) -> None:
        backend.put("other", b"x")
        with pytest.raises(FileNotFoundError):
            read(backend)
        assert not backend.exists("missing")

    def test_a_prefix_is_not_an_object(self, backend: Backend) -> None:
        backend.put("dir/inner", b"x")
        with pytest.raises(FileNotFoundError):
            backend.get("dir")
        with pytest.raises(FileNotFoundError):
            backend.stat("dir")
        assert not backend.exists("dir")
        assert backend.delete("dir") is False
        for length in (4, 2 * MIB):
            with pytest.raises(FileNotFoundError):
                backend.view_range("dir", 0, length)
        assert backend.get("dir/inner") == b"x"

    # --- delete --------------------------------------------------------------------------

    def test_delete_returns_whether_it_existed(self, backend: Backend) -> None:
        backend.put("chunks/ab/ab01", b"x")
        assert backend.delete("chunks/ab/ab01") is True
        assert backend.delete("chunks/ab/ab01") is False
        assert backend.delete("never/there") is False
        with pytest.raises(FileNotFoundError):
            backend.get("chunks/ab/ab01")
        assert list(backend.list()) == []

    def test_delete_many_removes_each_and_skips_the_missing(self, backend: Backend) -> None:
        for key in ("versions/a", "versions/b", "removed/a", "tags/t"):
            backend.put(key, b"x")
        backend.delete_many(["versions/a", "removed/a", "versions/never", "versions/b"])
        assert list(backend.list()) == ["tags/t"]
        backend.delete_many([])
        backend.delete_many(["versions/a"])  # gone already: nothing to do, no error
        assert list(backend.list()) == ["tags/t"]

    def test_delete_many_past_one_request(self, backend: Backend,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        """More keys than one request takes (made 2 here, not 1,000, to spare the puts)."""
        monkeypatch.setattr(fsspec_backend, "DELETE_BATCH", 2)
        keys = [f"versions/{i:05d}" for i in range(5)]
        for key in keys:
            backend.put(key, b"")
        backend.put("versions/kept", b"k")
        backend.delete_many(keys)
        assert list(backend.list("versions/")) == ["versions/kept"]

    # --- list ----------------------------------------------------------------------------

    def test_list_empty_backend(self, backend: Backend) -> None:
        assert list(backend.list()) == []
        assert list(backend.list("chunks/")) == []

    @pytest.mark.parametrize(
        "prefix",
        ["", "a", "a/", "a.", "chunks/", "chunks/a", "chunks/ab", "chunks/ab/", "chunks/ab/ab",
         "chunks/ab/ab12", "chunks/ab/ab123", "nothing", "b"],
    )  # fmt: skip
    def test_list_sorted_and_prefix_filtered(self, backend: Backend, prefix: str) -> None:
        for key in reversed(TRICKY_KEYS):
            backend.put(key, key.encode())
        expected = sorted(key for key in TRICKY_KEYS if key.startswith(prefix))
        assert list(backend.list(prefix)) == expected

    def test_list_default_prefix_lists_everything_in_byte_order(self, backend: Backend) -> None:
        for key in TRICKY_KEYS:
            backend.put(key, b"")
        listed = list(backend.list())
        assert listed == sorted(TRICKY_KEYS)
        assert [k.encode() for k in listed] == sorted(k.encode() for k in TRICKY_KEYS)

    def test_list_info(self, backend: Backend) -> None:
        before = time.time()
        backend.put("chunks/ab/ab01", b"12345")
        backend.put("chunks/ab/ab02", b"")
        backend.put("records/r1", b"xy")
        infos = list(backend.list_info("chunks/"))
        assert [(i.key, i.size) for i in infos] == [("chunks/ab/ab01", 5), ("chunks/ab/ab02", 0)]
        for info in infos:
            assert isinstance(info, ObjectInfo)
            # Clocks of remote servers drift a little; an hour catches unit/epoch bugs.
            assert abs(info.mtime - before) < 3600

    def test_stat(self, backend: Backend) -> None:
        before = time.time()
        backend.put("k", b"abc")
        info = backend.stat("k")
        assert info == ObjectInfo(key="k", size=3, mtime=info.mtime)
        assert abs(info.mtime - before) < 3600

    # --- ranges --------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("start", "length", "expected"),
        [(0, 4, b"0123"), (3, 4, b"3456"), (6, 4, b"6789"), (8, 10, b"89"), (10, 5, b""),
         (25, 5, b""), (4, 0, b""), (0, 100, b"0123456789")],
    )  # fmt: skip
    def test_get_range(self, backend: Backend, start: int, length: int, expected: bytes) -> None:
        backend.put("k", b"0123456789")
        assert backend.get_range("k", start, length) == expected

    @pytest.mark.parametrize(
        ("start", "length"),
        [(0, 4), (3, 4), (8, 10), (10, 5), (25, 5), (4, 0), (0, 100)],
    )  # fmt: skip
    def test_view_range_is_get_range(self, backend: Backend, start: int, length: int) -> None:
        backend.put("k", b"0123456789")
        assert bytes(backend.view_range("k", start, length)) == b"0123456789"[start:start + length]

    @pytest.mark.parametrize("start", [0, 1, 4096 + 7, 3 * MIB + 1])
    def test_view_range_of_a_large_object(self, backend: Backend, start: int) -> None:
        data = os.urandom(4 * MIB)
        backend.put("big", data)
        for length in (MIB, 4 * MIB):  # the second runs past the end
            view = backend.view_range("big", start, length)
            assert bytes(view) == data[start:start + length]
            if isinstance(view, memoryview):
                assert view.readonly

    def test_view_range_of_a_missing_object(self, backend: Backend) -> None:
        for length in (4, 2 * MIB):
            with pytest.raises(FileNotFoundError):
                backend.view_range("missing", 0, length)

    def test_read_into_full(self, backend: Backend) -> None:
        backend.put("k", b"0123456789")
        out = bytearray(4)
        assert backend.read_into("k", 2, memoryview(out)) == 4
        assert out == b"2345"

    def test_read_into_short_at_end(self, backend: Backend) -> None:
        backend.put("k", b"0123456789")
        out = bytearray(b"________")
        assert backend.read_into("k", 7, memoryview(out)) == 3
        assert out == b"789_____"
        assert backend.read_into("k", 10, memoryview(out)) == 0
        assert backend.read_into("k", 50, memoryview(out)) == 0

    def test_read_into_a_slice_of_a_larger_buffer(self, backend: Backend) -> None:
        backend.put("k", b"abcdef")
        out = np.zeros(10, dtype=np.uint8)
        assert backend.read_into("k", 1, memoryview(out)[3:7]) == 4
        assert out.tobytes() == b"\0\0\0bcde\0\0\0"

    # --- model-based ---------------------------------------------------------------------

    def test_state_machine_matches_dict_model(self) -> None:
        machine = type(
            "Machine", (BackendStateMachine,), {"make_backend": staticmethod(self.make_backend)}
        )
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=30,
                stateful_step_count=20,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                database=None,
            ),
        )


#: A key set where no key is a directory of another (a file system cannot hold both).
MODEL_KEYS = ["a", "ab", "a.b", "b-c", "b/c", "b/d", "e/f/g", "e/f/h", "e/fg"]
MODEL_PREFIXES = ["", "a", "a.", "b", "b/", "e/f", "e/f/", "e/f/g", "z"]


class BackendStateMachine(RuleBasedStateMachine):
    """Drive a fresh backend and a dict with the same operations; they must agree."""

    make_backend: Callable[[], Backend]

    def __init__(self) -> None:
        super().__init__()
        self.backend = self.make_backend()
        self.model: dict[str, bytes] = {}

    keys = st.sampled_from(MODEL_KEYS)
    values = st.binary(max_size=64)

    @rule(key=keys, data=values)
    def put(self, key: str, data: bytes) -> None:
        self.backend.put(key, data)
        self.model[key] = data

    @rule(key=keys, data=values)
    def put_if_absent(self, key: str, data: bytes) -> None:
        created = self.backend.put_if_absent(key, memoryview(data))
        assert created == (key not in self.model)
        self.model.setdefault(key, data)

    @rule(key=keys)
    def delete(self, key: str) -> None:
        assert self.backend.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(key=keys)
    def get(self, key: str) -> None:
        assert self.backend.exists(key) == (key in self.model)
        if key in self.model:
            assert self.backend.get(key) == self.model[key]
            assert self.backend.stat(key).size == len(self.model[key])
        else:
            with pytest.raises(FileNotFoundError):
                self.backend.get(key)

    @rule(key=keys, start=st.integers(0, 70), length=st.integers(0, 70))
    def get_range(self, key: str, start: int, length: int) -> None:
        if key in self.model:
            expected = self.model[key][start : start + length]
            assert self.backend.get_range(key, start, length) == expected

    @rule(prefix=st.sampled_from(MODEL_PREFIXES))
    def list_keys(self, prefix: str) -> None:
        expected = sorted(key for key in self.model if key.startswith(prefix))
        assert list(self.backend.list(prefix)) == expected

    def teardown(self) -> None:
        self.backend.close()
