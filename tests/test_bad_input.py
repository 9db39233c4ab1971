"""Bad input (invariant 5): a clear, typed error that names the problem, and
the store left exactly as it was (same files, same versions, same tags).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chunkstore
from chunkstore.errors import (
    AmbiguousSelectorError,
    ChunkStoreError,
    DuplicateEntryError,
    EntryNotFoundError,
    InvalidInputError,
    InvalidNameError,
    InvalidSettingError,
    NotAStoreError,
    NotSerializableError,
    SelectorError,
    ShapeMismatchError,
    UnsupportedDtypeError,
    VersionClosedError,
)
from chunkstore.format import names
from tests.conftest import SMALL_CHUNK, tree_snapshot

WEIGHTS = np.arange(20, dtype=np.float32).reshape(4, 5)
TRAINER = {"epoch": 1}


@pytest.fixture
def populated(store: chunkstore.Store) -> chunkstore.Store:
    """The store with version r@1 (a tensor and plain data), tagged ``best``."""
    with store.new_version(run="r", step=1) as version:
        version.put("model.w", WEIGHTS)
        version.put_data("trainer", TRAINER)
    store.tag("r@1", "best")
    return store


@contextlib.contextmanager
def unchanged(store: chunkstore.Store, store_path: Path) -> Iterator[None]:
    """Assert that the block changes no file, version or tag of the store."""
    files = tree_snapshot(store_path)
    versions = [v.id for v in store.versions()]
    tags = store.tags()
    yield
    assert tree_snapshot(store_path) == files  # commit records and tag files included
    assert [v.id for v in store.versions()] == versions
    assert sorted(store.stored_version_ids()) == sorted(versions)
    assert store.tags() == tags


# --- entry names ----------------------------------------------------------------------------

BAD_ENTRY_NAMES = [
    ("..", "contains '..'"),
    ("model..w", "contains '..'"),
    ("../etc/passwd", "contains '..'"),
    ("model/../../x", "contains '..'"),
    ("/etc/passwd", "path separator"),
    ("model/w", "path separator"),
    ("model\\w", "path separator"),
    ("C:\\Windows\\x", "path separator"),
    ("model\x00w", "NUL byte"),
    ("model\nw", "control character"),
    ("", "is empty"),
    (".model", "empty component"),
    ("model.", "empty component"),
    ("." , "empty component"),
    ("x" * 1025, "longer than 1024"),
]


@pytest.mark.parametrize("method", ["put", "put_data"])
@pytest.mark.parametrize(("name", "reason"), BAD_ENTRY_NAMES,
                         ids=[repr(n)[:20] for n, _ in BAD_ENTRY_NAMES])
def test_bad_entry_name(populated: chunkstore.Store, store_path: Path, method: str, name: str,
                        reason: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidNameError, match=reason) as raised:
            with populated.new_version(run="r", step=2) as version:
                if method == "put":
                    version.put(name, WEIGHTS)
                else:
                    version.put_data(name, TRAINER)
        assert raised.value.name == name
        assert "invalid name" in str(raised.value)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from([*"aZ09_.-/\\\x00\n\x7fé", "\ud800"]), max_size=10))
def test_entry_names_are_judged_alike_on_the_fast_path_and_in_full(name: str) -> None:
    """The common names (ASCII letters, digits and underscores between dots) skip the
    full checks: never one the full checks refuse."""
    def judged(check: Callable[[object], str]) -> str:
        try:
            return check(name)
        except InvalidNameError as exc:
            return f"refused: {exc}"

    assert judged(names.check_entry_name) == judged(names._checked_entry_name)


def test_a_plain_entry_name_is_refused_for_its_length_alone() -> None:
    assert names.check_entry_name("a." * 511 + "bc") == "a." * 511 + "bc"  # 1024 characters
    with pytest.raises(InvalidNameError, match="longer than 1024"):
        names.check_entry_name("a." * 512 + "b")


@pytest.mark.parametrize("name", [5, None, b"model.w", ("model", "w")])
def test_entry_name_that_is_not_a_string(populated: chunkstore.Store, store_path: Path,
                                         name: object) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidNameError, match="must be a str"):
            with populated.new_version(run="r", step=2) as version:
                version.put(name, WEIGHTS)  # type: ignore[arg-type]


def test_a_refused_entry_leaves_the_version_usable(populated: chunkstore.Store) -> None:
    with populated.new_version(run="r", step=2) as version:
        with pytest.raises(InvalidNameError):
            version.put("../escape", WEIGHTS)
        with pytest.raises(DuplicateEntryError, match="already added"):
            version.put("model.w", WEIGHTS)
            version.put("model.w", WEIGHTS)
    reader = populated.open_version("r@2")
    assert reader.names() == ["model.w"]
    assert reader.get("model.w").tobytes() == WEIGHTS.tobytes()
    with pytest.raises(VersionClosedError):
        version.put("late", WEIGHTS)
    with pytest.raises(VersionClosedError):
        version.commit()


# --- run names, steps, tags -----------------------------------------------------------------

BAD_LABELS = ["", "a/b", "../x", "a@b", "latest", "-lead", "a b", "a\x00b", "a..b", "x" * 129,
              "ünïcode", "tab\t"]


@pytest.mark.parametrize("run", [*BAD_LABELS, 5, None])
def test_bad_run_name(populated: chunkstore.Store, store_path: Path, run: object) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidNameError, match="invalid name"):
            populated.new_version(run=run, step=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [-1, True, 1.5, "3", None])
def test_bad_step(populated: chunkstore.Store, store_path: Path, step: object) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidInputError, match="step must be a non-negative int"):
            populated.new_version(run="r", step=step)  # type: ignore[arg-type]


@pytest.mark.parametrize("tag", BAD_LABELS)
def test_bad_tag_name(populated: chunkstore.Store, store_path: Path, tag: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidNameError, match="invalid name"):
            populated.tag("r@1", tag)
        with pytest.raises(InvalidNameError, match="invalid name"):
            populated.untag(tag)


@pytest.mark.parametrize("tag", ["abcd", "0123456789", "deadbeef" * 8])
def test_tag_that_looks_like_a_version_id(populated: chunkstore.Store, store_path: Path,
                                          tag: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidInputError, match="looks like a version id"):
            populated.tag("r@1", tag)


# --- selectors ------------------------------------------------------------------------------

BAD_SELECTORS = [
    ("", "empty selector"),
    ("nope", "not a tag, RUN@STEP"),
    ("best2", "not a tag, RUN@STEP"),
    ("r@abc", "integer step"),
    ("r@-1", "integer step"),
    ("r@99", "no version at step 99"),
    ("ghost@1", "no versions of run 'ghost'"),
    ("ghost@latest", "no versions of run 'ghost'"),
    ("abc", "at least 4 characters"),
    ("ffff", "no version id starts with it"),
    ("f" * 64, "no version id starts with it"),
]


def _selector_operations(store: chunkstore.Store, selector: str) -> list[object]:
    return [
        lambda: store.resolve(selector),
        lambda: store.open_version(selector),
        lambda: store.tag(selector, "other"),
        lambda: store.delete(selector),
        lambda: store.verify(selector),
    ]


@pytest.mark.parametrize(("selector", "reason"), BAD_SELECTORS,
                         ids=[s or "empty" for s, _ in BAD_SELECTORS])
def test_unknown_selector(populated: chunkstore.Store, store_path: Path, selector: str,
                          reason: str) -> None:
    with unchanged(populated, store_path):
        for operation in _selector_operations(populated, selector):
            with pytest.raises(SelectorError, match=reason) as raised:
                operation()  # type: ignore[operator]
            assert raised.value.selector == selector


def _ids_sharing_a_prefix(record: dict[str, object]) -> list[tuple[str, bytes]]:
    """Two commit records (of the same tree) whose ids share their first 4 hex digits."""
    seen: dict[str, tuple[str, bytes]] = {}
    for i in range(100_000):
        body = dict(record, created=float(i), step=100 + i)
        data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        version_id = blake3.blake3(data).hexdigest()
        if version_id[:4] in seen:
            return [seen[version_id[:4]], (version_id, data)]
        seen[version_id[:4]] = (version_id, data)
    raise AssertionError("no shared prefix found")


def test_ambiguous_id_prefix(populated: chunkstore.Store, store_path: Path) -> None:
    first = populated.versions()[0].id
    record = json.loads((store_path / "versions" / first).read_bytes())
    twins = _ids_sharing_a_prefix(record)
    for version_id, data in twins:
        (store_path / "versions" / version_id).write_bytes(data)
    populated.reconcile()  # as another process's commits would be seen
    (a, _), (b, _) = twins
    assert a[:4] == b[:4] and a != b
    with unchanged(populated, store_path):
        for operation in _selector_operations(populated, a[:4]):
            with pytest.raises(AmbiguousSelectorError, match="matches 2 versions") as raised:
                operation()  # type: ignore[operator]
            assert isinstance(raised.value, SelectorError)
    differ = next(i for i in range(64) if a[i] != b[i])  # one more digit tells them apart
    assert populated.resolve(a[: differ + 1]).id == a
    assert populated.resolve(b[: differ + 1]).id == b


def test_good_selectors_still_resolve(populated: chunkstore.Store) -> None:
    version_id = populated.versions()[0].id
    for selector in ["latest", "best", "r@1", "r@latest", version_id, version_id[:4],
                     version_id[:8].upper()]:
        assert populated.resolve(selector).id == version_id


# --- plain data -----------------------------------------------------------------------------

NOT_SERIALISABLE = [
    (object(), "$", "object"),
    (lambda: 0, "$", "function"),
    ({"a": {1, 2}}, "$.a", "set"),
    ({"opt": [1, {"state": np.zeros(3)}]}, "$.opt[1].state", "ndarray"),
    ({"t": (1, frozenset())}, "$.t[1]", "frozenset"),
    ({1: print}, "$[1]", "builtin_function_or_method"),
    ({object(): 1}, "$<key", "object"),
    ({"c": 1 + 2j}, "$.c", "complex"),
    ({"r": range(3)}, "$.r", "range"),
]


@pytest.mark.parametrize(("value", "path", "type_name"), NOT_SERIALISABLE,
                         ids=[t for _, _, t in NOT_SERIALISABLE])
def test_non_serialisable_plain_data(populated: chunkstore.Store, store_path: Path,
                                     value: object, path: str, type_name: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(NotSerializableError, match=f"of type {type_name}") as raised:
            with populated.new_version(run="r", step=2) as version:
                version.put_data("trainer", value)
        assert raised.value.path.startswith(path)
        assert raised.value.type_name == type_name
        with pytest.raises(NotSerializableError, match=f"of type {type_name}"):
            populated.new_version(run="r", step=2, meta={"env": value})


def test_too_deeply_nested_plain_data(populated: chunkstore.Store, store_path: Path) -> None:
    value: list[object] = []
    for _ in range(300):
        value = [value]
    with unchanged(populated, store_path):
        with pytest.raises(NotSerializableError, match="nested deeper than"):
            with populated.new_version(run="r", step=2) as version:
                version.put_data("deep", value)


def test_tensor_written_after_a_refused_put_data_is_not_published(
        populated: chunkstore.Store, store_path: Path) -> None:
    """Chunks may have been written, but no version appears and the old one is intact."""
    with pytest.raises(NotSerializableError):
        with populated.new_version(run="r", step=2) as version:
            version.put("model.w", WEIGHTS + 1)
            version.put_data("trainer", {"bad": object()})
    assert [v.step for v in populated.versions()] == [1]
    assert len(list((store_path / "versions").iterdir())) == 1
    assert populated.verify().ok


# --- arrays ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("array", "dtype", "error", "reason"),
    [
        (np.array([object(), 1]), None, UnsupportedDtypeError, "unsupported dtype 'object'"),
        (np.zeros(3, dtype=[("a", "<i4")]), None, UnsupportedDtypeError, "unsupported dtype"),
        (np.zeros(3, dtype="datetime64[s]"), None, UnsupportedDtypeError, "unsupported dtype"),
        (np.array(["a", "b"]), None, UnsupportedDtypeError, "unsupported dtype"),
        (np.zeros(3, dtype=np.float32), "bfloat16", UnsupportedDtypeError,
         "elements are 4 bytes, bfloat16 needs 2"),
        (np.zeros(3, dtype=np.uint16), "float128", UnsupportedDtypeError,
         "unsupported dtype 'float128'"),
        ([1.0, 2.0], None, InvalidInputError, "takes a numpy array, got list"),
        (3.5, None, InvalidInputError, "takes a numpy array, got float"),
    ],
    ids=["object", "structured", "datetime", "unicode", "override-size", "override-unknown",
         "list", "float"],
)  # fmt: skip
def test_unsupported_array(populated: chunkstore.Store, store_path: Path, array: object,
                           dtype: str | None, error: type[ChunkStoreError], reason: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(error, match=reason):
            with populated.new_version(run="r", step=2) as version:
                version.put("model.x", array, dtype=dtype)  # type: ignore[arg-type]


def _sentinel(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    return np.full(shape, 7, dtype=dtype)  # type: ignore[call-overload,no-any-return]


@pytest.mark.parametrize(
    ("out", "dtype", "reason"),
    [
        (_sentinel((4, 5), np.float64), None, r"is float32\[4, 5\], but the buffer is float64"),
        (_sentinel((4, 5), np.int32), None, r"but the buffer is int32\[4, 5\]"),
        (_sentinel((4, 5), ml_dtypes.bfloat16), None, r"but the buffer is bfloat16\[4, 5\]"),
        (_sentinel((5, 4), np.float32), None, r"but the buffer is float32\[5, 4\]"),
        (_sentinel((20,), np.float32), None, r"but the buffer is float32\[20\]"),
        (_sentinel((4, 5, 1), np.float32), None, r"but the buffer is float32\[4, 5, 1\]"),
        (_sentinel((4, 5), np.int32), "int32", r"but the buffer is int32\[4, 5\]"),
        (_sentinel((4, 5), np.int16), "float32", r"but the buffer is int16"),
        (_sentinel((4, 10), np.float32)[:, ::2], None, "not a writeable C-contiguous"),
        (_sentinel((5, 4), np.float32).T, None, "not a writeable C-contiguous"),
        (_sentinel((4, 5), ">f4"), None, "not a writeable C-contiguous little-endian"),
        (_sentinel((4, 5), np.object_), None, r"but the buffer is object\[4, 5\]"),
    ],
    ids=["float64", "int32", "bfloat16", "transposed-shape", "flat", "extra-dim",
         "same-size-override", "wrong-size-override", "strided", "fortran", "big-endian",
         "object"],
)  # fmt: skip
def test_get_into_a_wrong_buffer(populated: chunkstore.Store, store_path: Path,
                                 out: np.ndarray, dtype: str | None, reason: str) -> None:
    before = out.copy()
    with unchanged(populated, store_path):
        reader = populated.open_version("best")
        with pytest.raises(ShapeMismatchError, match=reason) as raised:
            reader.get_into("model.w", out, dtype=dtype)
        assert raised.value.name == "model.w"
        assert raised.value.expected == "float32[4, 5]"
    assert np.array_equal(out, before)  # refused before anything was read into it


def test_get_into_a_read_only_buffer(populated: chunkstore.Store) -> None:
    out = np.zeros((4, 5), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ShapeMismatchError, match="not a writeable"):
        populated.open_version("best").get_into("model.w", out)
    with pytest.raises(ShapeMismatchError, match="but the buffer is list"):
        populated.open_version("best").get_into("model.w", [0.0] * 20)  # type: ignore[arg-type]


def test_wrong_kind_of_entry(populated: chunkstore.Store, store_path: Path) -> None:
    with unchanged(populated, store_path):
        reader = populated.open_version("best")
        with pytest.raises(InvalidInputError, match="is plain data; use get_data"):
            reader.get("trainer")
        with pytest.raises(InvalidInputError, match="is plain data"):
            reader.get_into("trainer", np.zeros(1))
        with pytest.raises(InvalidInputError, match="is a tensor; use get"):
            reader.get_data("model.w")
        with pytest.raises(EntryNotFoundError, match=r"has no entry 'model\.b'") as raised:
            reader.get("model.b")
        assert isinstance(raised.value, KeyError)
        with pytest.raises(EntryNotFoundError):
            reader.get_data("model")  # a subtree, not an entry


# --- stores and settings --------------------------------------------------------------------


def test_missing_path_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "absent"
    with pytest.raises(NotAStoreError, match="the directory does not exist") as raised:
        chunkstore.open(path, create=False)
    assert raised.value.url == str(path)
    assert not path.exists()


def test_empty_directory_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(NotAStoreError, match=r"no store at .*: nothing is stored there"):
        chunkstore.open(tmp_path, create=False)
    assert list(tmp_path.iterdir()) == []


def test_plain_file_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a store")
    with pytest.raises(NotAStoreError):
        chunkstore.open(path, create=False)
    assert path.read_bytes() == b"not a store"


@pytest.mark.parametrize("create", [True, False])
def test_directory_with_other_files_is_not_a_store(tmp_path: Path, create: bool) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("a,b\n")
    (tmp_path / "notes.txt").write_text("hello")
    before = tree_snapshot(tmp_path)
    with pytest.raises(NotAStoreError):
        chunkstore.open(tmp_path, create=create)
    assert tree_snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]  # no index


@pytest.mark.parametrize(
    ("config", "reason"),
    [(b"{not json", "not valid JSON"), (b'{"format": "zarr"}', "names another format"),
     (b"[1, 2]", "not valid JSON")],
)  # fmt: skip
def test_foreign_config_is_not_a_store(tmp_path: Path, config: bytes, reason: str) -> None:
    (tmp_path / "chunkstore.json").write_bytes(config)
    for create in (False, True):
        with pytest.raises(NotAStoreError, match=reason):
            chunkstore.open(tmp_path, create=create)
    assert [p.name for p in tmp_path.iterdir()] == ["chunkstore.json"]


@pytest.mark.parametrize(
    ("settings", "reason"),
    [({"chunk_size": 1000}, "chunk size 1000"), ({"chunk_size": 4097}, "multiple of 64"),
     ({"chunk_size": 1 << 40}, "between"), ({"compression": "lz4"}, "unknown compression 'lz4'"),
     ({"chunk_size": SMALL_CHUNK * 2}, "cannot change")],
)  # fmt: skip
def test_bad_settings(populated: chunkstore.Store, store_path: Path,
                      settings: dict[str, object], reason: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidSettingError, match=reason):
            chunkstore.open(store_path, **settings, create=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "reason"),
    [({"threads": -3}, "threads -3 must be an integer in"), ({"threads": 2.5}, "threads 2.5"),
     ({"pack_size": True}, "pack size True"), ({"chunk_size": "4096"}, "chunk size '4096'"),
     ({"delta_depth": np.float32(1)}, "delta depth")],
)  # fmt: skip
def test_settings_that_are_not_whole_numbers_are_typed_errors(
        populated: chunkstore.Store, store_path: Path, settings: dict[str, object],
        reason: str) -> None:
    with unchanged(populated, store_path):
        with pytest.raises(InvalidSettingError, match=reason):
            chunkstore.open(store_path, **settings, create=True)  # type: ignore[arg-type]


def test_numpy_integers_are_settings_like_ints(tmp_path: Path) -> None:
    """A chunk size from a numpy computation (np.int64) makes a store (it raised
    TypeError: not JSON serializable, from inside the config's encoding)."""
    with chunkstore.open(tmp_path / "s", chunk_size=np.int64(65536), threads=np.int32(4),
                         pack_size=np.int64(1 << 20), create=True) as store:  # type: ignore[arg-type]
        assert store.chunk_size == 65536 and type(store.chunk_size) is int
        assert store.threads == 4


@pytest.mark.parametrize("location", ["a\0b", "", "/proc/chunkstore-no-such-dir/s",
                                      "/proc/self/status", "/dev/null/s", 42])
def test_a_location_that_cannot_hold_a_store_is_a_typed_error(location: object) -> None:
    with pytest.raises(InvalidInputError):
        chunkstore.open(location, create=True)  # type: ignore[arg-type]


def test_a_duration_past_any_float_is_a_typed_error(populated: chunkstore.Store,
                                                    store_path: Path) -> None:
    with unchanged(populated, store_path):
        for grace in (10**400, "9" * 400 + "d"):
            with pytest.raises(InvalidSettingError, match="must be finite"):
                populated.gc(grace=grace)


@pytest.mark.parametrize(("offsets", "sizes"), [(["0"], [4]), ([0], [4.0]), (0, [4]),
                                                ([True], [4])])
def test_a_box_of_other_than_integers_is_a_typed_error(
        populated: chunkstore.Store, offsets: object, sizes: object) -> None:
    reader = populated.open_version("latest")
    out = np.empty(4, dtype=WEIGHTS.dtype)
    with pytest.raises(InvalidInputError, match="integers"):
        reader.get_box("model.w", 0, offsets, sizes, out)  # type: ignore[arg-type]


def test_a_location_without_a_store_says_what_is_there(tmp_path: Path) -> None:
    """A typo'd path said "no chunkstore.json"; it says the directory does not exist (and
    reading it creates nothing)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for name, says in (("nothere", "the directory does not exist"),
                       ("empty", "nothing is stored there"), ("other", "no chunkstore.json")):
        with pytest.raises(NotAStoreError, match=says):
            chunkstore.open(tmp_path / name, create=False)
    assert not (tmp_path / "nothere").exists()
    assert [p.name for p in (tmp_path / "empty").iterdir()] == []
