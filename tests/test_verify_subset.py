"""Sampled verification (``verify --read-data-subset``): slices N/M read every stored
object exactly once over M runs, a damaged chunk is found by its slice's run only, a
percentage reads about that share, and a malformed subset is a typed error (exit 2)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends import Backend
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.cli import cli
from chunkstore.errors import InvalidInputError, SubsetError
from chunkstore.maintenance.verify import DataSubset, VerifyResult
from tests.conftest import SMALL_CHUNK

CHUNKS_PER_TENSOR = 8


class ReadKeys(ForwardingBackend):
    """Records the chunk objects read in full or in part (not stat / exists)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.keys: set[str] = set()
        self._lock = threading.Lock()

    def _saw(self, key: str) -> None:
        if key.startswith("chunks/"):
            with self._lock:
                self.keys.add(key)

    def get(self, key: str) -> bytes:
        self._saw(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._saw(key)
        return super().get_range(key, start, length)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        self._saw(key)
        return super().read_into(key, start, buffer)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("subset") / "store"
    rng = np.random.default_rng(5)
    with chunkstore.open(path, create=True, chunk_size=SMALL_CHUNK, compression="none") as store:
        for step in (1, 2):
            with store.new_version("exp", step) as v:  # random data: no deltas, no packs
                for name in ("a", "b", "c"):
                    count = CHUNKS_PER_TENSOR * SMALL_CHUNK // 4
                    v.put(f"{name}{step}", rng.standard_normal(count).astype(np.float32))
            with store.new_version("exp", step + 10) as v:  # small: packed
                v.put("small", np.arange(step * 100, dtype=np.int32))
    return path


def _read_keys(path: Path, subset: str | None) -> tuple[set[str], VerifyResult]:
    with chunkstore.open(path) as store:
        store.backend = counter = ReadKeys(store.backend)
        result = store.verify(read_data_subset=subset)
    return counter.keys, result


def test_m_runs_of_n_over_m_read_every_object_exactly_once(store_path: Path) -> None:
    everything, full = _read_keys(store_path, None)
    assert full.ok and full.objects_read == full.objects_total == len(everything) > 40
    seen: list[str] = []
    for n in (1, 2, 3):
        keys, result = _read_keys(store_path, f"{n}/3")
        assert result.ok and result.subset == f"{n}/3"
        assert result.objects_read == len(keys) and result.objects_total == full.objects_total
        assert 0 < len(keys) < len(everything)
        assert result.chunks_checked == full.chunks_checked  # the structure check: all
        seen.extend(keys)
    assert sorted(seen) == sorted(everything)  # each object in exactly one run


def _corrupt_one_chunk(path: Path) -> str:
    chunk = max((p for p in (path / "chunks").rglob("*") if p.is_file()),
                key=lambda p: (p.stat().st_size, p.name))
    data = bytearray(chunk.read_bytes())
    data[-10] ^= 0xFF
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    return chunk.name


def test_a_corrupt_chunk_is_found_by_its_slice_only(store_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(store_path, path)
    damaged = _corrupt_one_chunk(path)
    found = []
    for n in range(1, 5):
        _, result = _read_keys(path, f"{n}/4")
        if not result.ok:
            assert {p.kind for p in result.problems} == {"corrupt-chunk"}
            assert {p.digest for p in result.problems} == {damaged}
            found.append(n)
    expected = int(damaged[:16], 16) % 4 + 1
    assert found == [expected]


def test_a_percentage_reads_about_that_share(store_path: Path) -> None:
    keys, result = _read_keys(store_path, "25%")
    assert result.ok and result.subset == "25%"
    assert result.objects_read == len(keys) == round(result.objects_total * 0.25)
    full = _read_keys(store_path, None)[1]
    assert 0.1 < result.bytes_checked / full.bytes_checked < 0.45
    assert result.seconds > 0 and result.bytes_checked > 0


@pytest.mark.parametrize("text", ["0/3", "4/3", "150%", "abc", "0%", "1/0", ""])
def test_a_malformed_subset_is_a_typed_error(store_path: Path, text: str) -> None:
    with pytest.raises(SubsetError, match="invalid data subset") as caught:
        DataSubset.parse(text)
    assert isinstance(caught.value, InvalidInputError) and caught.value.subset == text
    with chunkstore.open(store_path) as store, pytest.raises(SubsetError):
        store.verify(read_data_subset=text)
    outcome = CliRunner().invoke(cli, ["verify", str(store_path), "--read-data-subset", text])
    assert outcome.exit_code == 2, outcome.output
    assert "invalid data subset" in outcome.output


def test_cli_reports_bytes_read_and_time(store_path: Path) -> None:
    outcome = CliRunner().invoke(cli, ["verify", str(store_path), "--read-data-subset", "2/3"])
    assert outcome.exit_code == 0, outcome.output
    assert "data subset 2/3:" in outcome.output and " s" in outcome.output
    outcome = CliRunner().invoke(cli, ["verify", str(store_path), "--read-data-subset", "1/3",
                                       "--json"])
    doc = json.loads(outcome.output)
    assert doc["subset"] == "1/3" and 0 < doc["objects_read"] < doc["objects_total"]
    assert doc["bytes_read"] == doc["bytes_checked"] > 0 and doc["seconds"] >= 0
    outcome = CliRunner().invoke(cli, ["verify", str(store_path), "--quick",
                                       "--read-data-subset", "1/3"])
    assert outcome.exit_code == 2 and "one or the other" in outcome.output
