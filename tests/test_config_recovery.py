"""A damaged or missing ``chunkstore.json`` does not brick the store (issue 47 item 6):
the store opens read-only from a config recovered from its commit records and
manifests, with a ConfigRecoveredWarning, every read works and nothing in the store
changes; ``chunkstore init --recover`` writes the config back (docs/format.md §2.1)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
import chunkstore.store
from chunkstore.cli import cli
from chunkstore.errors import (
    ConfigRecoveredWarning,
    FormatVersionError,
    NotAStoreError,
    RecoveredConfigError,
)
from chunkstore.format.records import (
    DEFAULT_DELTA_DEPTH,
    STORE_FORMAT_VERSION,
    STORE_FORMAT_VERSIONS,
)
from tests.conftest import SMALL_CHUNK, tree_snapshot
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

BASE = np.random.default_rng(7).standard_normal(40_000).astype(np.float32)  # 3 chunks


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def base(step: int) -> np.ndarray:
    """A few elements of every chunk change per step: deltas, chains of 2 by step 3."""
    changed = BASE.copy()
    changed[::1000] += step
    return changed


def head(step: int) -> np.ndarray:
    return np.arange(3000, dtype=np.int16) + step


def fill(store: chunkstore.Store) -> None:
    for step in (1, 2, 3):
        with store.new_version("r", step, meta={"lr": 0.1}) as v:
            v.put("model.base", base(step))
            v.put("model.head", head(step))
            v.put_data("trainer", {"step": step})
    store.tag("r@2", "best")


@pytest.fixture
def saved(store_path: Path) -> Path:
    """A store of the default delta depth with three versions of run r and a tag."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        fill(store)
    return store_path


def _damaged_json(config: bytes) -> bytes:
    return config.replace(b'"chunk_size"', b'"chunk_size', 1)


def _wrong_types(config: bytes) -> bytes:
    obj = json.loads(config)
    obj.update(chunk_size=str(obj["chunk_size"]), created="yesterday", delta_depth=None)
    return json.dumps(obj).encode()


#: Each way of damaging chunkstore.json: its new bytes (None: the file is deleted).
DAMAGE: dict[str, Callable[[bytes], bytes | None]] = {
    "damaged-json": _damaged_json,
    "truncated": lambda config: config[: len(config) // 2],
    "wrong-types": _wrong_types,
    "missing": lambda config: None,
}


def damage(store: Path, how: str) -> bytes:
    """Damage ``store``'s config the way ``how`` names; return the original bytes."""
    path = store / "chunkstore.json"
    original = path.read_bytes()
    damaged = DAMAGE[how](original)
    if damaged is None:
        path.unlink()
    else:
        path.write_bytes(damaged)
    return original


def recovering(how: str = "") -> Any:
    return pytest.warns(ConfigRecoveredWarning, match=r"init --recover")


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_every_read_works_and_nothing_changes(saved: Path, how: str, tmp_path: Path) -> None:
    damage(saved, how)
    before = tree_snapshot(saved)
    with recovering():
        listed = run("log", str(saved), "--json")
    assert listed.exit_code == 0, listed.output
    assert [(v["run"], v["step"], v["tags"]) for v in json.loads(listed.stdout)["versions"]] == [
        ("r", 3, []), ("r", 2, ["best"]), ("r", 1, [])]
    with recovering():
        shown = run("show", str(saved), "best", "--json")
    assert shown.exit_code == 0, shown.output
    with recovering():
        verified = run("verify", str(saved), "--json")
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["ok"] is True
    with recovering():
        reported = run("report", str(saved), "--json")
    assert reported.exit_code == 0, reported.output
    with recovering() as caught, chunkstore.open(saved) as store:
        assert store.recovered_config is not None
        assert store.chunk_size == SMALL_CHUNK
        version = store.open_version("r@3")
        assert version.get("model.base").tobytes() == base(3).tobytes()
        assert version.get("model.head").tobytes() == head(3).tobytes()
        assert version.get_data("trainer") == {"step": 3}
    assert "chunk size 65536 (from the manifests)" in str(caught[0].message)
    assert tree_snapshot(saved) == before


def test_export_works(saved: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    damage(saved, "truncated")
    before = tree_snapshot(saved)
    with recovering():
        exported = run("export", str(saved), "r@3", str(tmp_path / "w.safetensors"))
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "w.safetensors").stat().st_size > BASE.nbytes
    assert tree_snapshot(saved) == before


@pytest.mark.parametrize("how", ["damaged-json", "missing"])
def test_changes_are_refused_with_the_fix_named_and_change_nothing(saved: Path,
                                                                   how: str) -> None:
    damage(saved, how)
    before = tree_snapshot(saved)
    with recovering(), chunkstore.open(saved, create=True) as store:
        attempts: list[Callable[[], object]] = [
            lambda: store.new_version("r", 4).__enter__(),
            lambda: store.delete("r@1"),
            lambda: store.tag("r@1", "other"),
            lambda: store.untag("best"),
            lambda: store.gc(grace=0),
            lambda: store.prune(keep_last=1),
        ]
        for attempt in attempts:
            with pytest.raises(RecoveredConfigError, match=r"chunkstore init --recover"):
                attempt()
        # Below the facade, the backend refuses every write too.
        with pytest.raises(RecoveredConfigError):
            store.objects.replace_config(b"{}")
        assert store.gc(grace=0, dry_run=True).dry_run
    for args in (["rm", str(saved), "r@1"], ["gc", str(saved), "--grace", "0"],
                 ["tag", str(saved), "r@1", "x"]):
        with recovering():
            refused = run(*args)
        assert refused.exit_code == 4, refused.output
        assert f"chunkstore init --recover {saved}" in refused.output
    assert tree_snapshot(saved) == before


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_init_recover_writes_the_original_config_back(saved: Path, how: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    original = damage(saved, how)
    plain = run("init", str(saved))  # says it, no warning
    assert plain.exit_code == 2 and "init --recover" in plain.output
    written = run("init", "--recover", str(saved))
    assert written.exit_code == 0, written.output
    assert "(from the manifests)" in written.output and "(from the index)" in written.output
    assert json.loads((saved / "chunkstore.json").read_bytes()) == json.loads(original)

    def no_rebuild(store: object) -> None:
        raise AssertionError("the index was rebuilt")
    monkeypatch.setattr(chunkstore.store, "rebuild", no_rebuild)
    # Back to normal: no warning (warnings are errors here), writable, the index kept.
    with chunkstore.open(saved) as store:
        assert store.recovered_config is None
        with store.new_version("r", 4) as v:
            v.put("model.head", head(4))
        assert [v.step for v in store.versions()] == [1, 2, 3, 4]
    again = run("init", "--recover", str(saved))
    assert again.exit_code == 2 and "is valid" in again.output


def test_without_an_index_created_is_the_oldest_version(saved: Path) -> None:
    """No index recorded the store's identity: the oldest commit record's time is the
    nearest the store says; the index then rebuilt from the store records it."""
    damage(saved, "missing")
    shutil.rmtree(saved / "index")
    with recovering() as caught, chunkstore.open(saved) as store:
        oldest = min(v.created for v in store.versions())
        assert store.config.created == oldest
        assert store.verify().ok
    assert "from the oldest version" in str(caught[0].message)
    assert run("init", "--recover", str(saved)).exit_code == 0
    config = json.loads((saved / "chunkstore.json").read_bytes())
    assert (config["created"], config["chunk_size"]) == (oldest, SMALL_CHUNK)
    assert config["delta_depth"] == DEFAULT_DELTA_DEPTH
    assert config["format_version"] == STORE_FORMAT_VERSION
    with chunkstore.open(saved) as store:
        assert store.recovered_config is None and len(store.versions()) == 3


def test_a_store_created_with_another_delta_depth_takes_it_given(store_path: Path) -> None:
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, delta_depth=2,
                         create=True) as store:
        fill(store)
    original = damage(store_path, "truncated")
    low = run("init", "--recover", str(store_path), "--delta-depth", "0")
    assert low.exit_code == 2 and "delta chains" in low.output, low.output
    wrong = run("init", "--recover", str(store_path), "--chunk-size", "128KiB")
    assert wrong.exit_code == 2 and "65536" in wrong.output, wrong.output
    assert (store_path / "chunkstore.json").read_bytes() != original
    written = run("init", "--recover", str(store_path), "--delta-depth", "2")
    assert written.exit_code == 0, written.output
    assert json.loads((store_path / "chunkstore.json").read_bytes()) == json.loads(original)


def test_an_unknown_chunk_size_reads_but_must_be_given_to_write_back(store_path: Path) -> None:
    """Plain data only: no manifest fixes the chunk size."""
    with chunkstore.open(store_path, chunk_size=SMALL_CHUNK, create=True) as store:
        with store.new_version("r", 1) as v:
            v.put_data("trainer", {"epoch": 1})
    original = damage(store_path, "missing")
    with recovering() as caught, chunkstore.open(store_path) as store:
        assert store.open_version("r@1").get_data("trainer") == {"epoch": 1}
        assert store.recovered_config is not None
        assert not store.recovered_config.chunk_size_known
    assert "chunk size unknown" in str(caught[0].message)
    refused = run("init", "--recover", str(store_path))
    assert refused.exit_code == 2 and "--chunk-size N" in refused.output, refused.output
    assert not (store_path / "chunkstore.json").exists()
    given = run("init", "--recover", str(store_path), "--chunk-size", "64KiB")
    assert given.exit_code == 0, given.output
    assert json.loads((store_path / "chunkstore.json").read_bytes()) == json.loads(original)


def test_what_holds_no_store_is_still_no_store(tmp_path: Path) -> None:
    """A damaged config without a commit record, and a newer store, are refused as
    before; init --recover refuses a location that holds nothing."""
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "chunkstore.json").write_bytes(b"{")
    with pytest.raises(NotAStoreError, match="not valid JSON"):
        chunkstore.open(tmp_path / "lone")
    nothing = run("init", "--recover", str(tmp_path / "nothing"))
    assert nothing.exit_code == 2 and "no store" in nothing.output
    assert not (tmp_path / "nothing").exists()


def test_a_newer_store_is_not_recovered(saved: Path) -> None:
    config = json.loads((saved / "chunkstore.json").read_bytes())
    config["format_version"] = max(STORE_FORMAT_VERSIONS) + 1
    (saved / "chunkstore.json").write_text(json.dumps(config))
    before = tree_snapshot(saved)
    with pytest.raises(FormatVersionError):
        chunkstore.open(saved)
    assert run("init", "--recover", str(saved)).exit_code == 3
    assert tree_snapshot(saved) == before


# --- an S3 store --------------------------------------------------------------------------


@pytest.fixture
def s3_store(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[tuple[str, dict[str, Any]]]:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))  # its index
    bucket = create_bucket(s3_endpoint)
    try:
        yield f"s3://{bucket}/ckpts", storage_options(s3_endpoint)
    finally:
        remove_bucket(s3_endpoint, bucket)


def _objects(url: str, options: dict[str, Any]) -> dict[str, bytes]:
    import fsspec
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {key: fs.cat_file(key) for key in sorted(fs.find(root))}


@pytest.mark.s3
def test_an_s3_store_reads_refuses_writes_and_is_written_back(
        s3_store: tuple[str, dict[str, Any]]) -> None:
    import fsspec
    url, options = s3_store
    with chunkstore.open(url, chunk_size=SMALL_CHUNK, storage_options=options,
                         create=True) as store:
        fill(store)
    fs = fsspec.filesystem("s3", **options)
    key = url.removeprefix("s3://") + "/chunkstore.json"
    original = fs.cat_file(key)
    fs.pipe_file(key, original[:25])
    before = _objects(url, options)
    with recovering(), chunkstore.open(url, storage_options=options) as store:
        assert store.open_version("best").get("model.base").tobytes() == base(2).tobytes()
        assert store.verify().ok
        with pytest.raises(RecoveredConfigError, match="init --recover"):
            store.delete("r@1")
        assert _objects(url, options) == before
        store.write_back_config()
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(key)) == json.loads(original)
    with chunkstore.open(url, storage_options=options) as store:  # no warning
        assert store.recovered_config is None
        assert len(store.versions()) == 3
