"""DCP's non-tensor values are plain data, never pickle: loading a DCP checkpoint from
chunkstore runs no code unless the user opts in with allow_pickle=True."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import chunkstore  # noqa: E402
from chunkstore.format.manifest import DataEntry, TensorEntry  # noqa: E402
from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "step": 7, "name": "run-a", "none": None, "flag": True, "betas": (0.9, 0.999),
            "blob": b"\x00\xff", "groups": [{"lr": 0.1, "params": [0, 1]}],
            "mixture": {"web": 0.5, "code": 0.3, "books": 0.2}}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(3, 4), "step": 0, "name": "", "none": 1, "flag": False,
            "betas": (0.0, 0.0), "blob": b"", "groups": [{"lr": 0.0, "params": []}],
            "mixture": {"web": 0.0, "code": 0.0, "books": 0.0}}


def test_plain_values_are_stored_as_plain_data_and_load_back(tmp_path: Path) -> None:
    """They were DCP's pickled blobs (BytesIO items), which the reader unpickled."""
    url = str(tmp_path / "s")
    writer = ChunkStoreWriter(url, run="r", step=1)
    dcp.save(_state(), storage_writer=writer)
    with chunkstore.open(url) as store:
        entries = store.open_version("r@1").entries()
    assert not [n for n in entries if n.startswith("_dcp.bytes.")]
    data = {n for n, e in entries.items() if isinstance(e, DataEntry)}
    assert {"_dcp.data.step", "_dcp.data.name", "_dcp.data.mixture.web"} <= data
    assert isinstance(entries["w"], TensorEntry)
    target = _blank()
    dcp.load(target, storage_reader=ChunkStoreReader(url, "r@1"))
    expected = _state()
    assert torch.equal(target.pop("w"), expected.pop("w"))
    assert target == expected
    assert list(target["mixture"]) == ["web", "code", "books"]


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def test_other_values_are_refused_unless_pickle_is_allowed(tmp_path: Path) -> None:
    url = str(tmp_path / "s")
    state = {"w": torch.ones(2), "when": dt.date(2024, 1, 2), "obj": Opaque(3)}
    with pytest.raises(CheckpointException, match=r"(?s)PickleRefusedError: when is a date,"
                       r" not plain data.*allow_pickle=True"):
        dcp.save(state, storage_writer=ChunkStoreWriter(url, run="r", step=1))
    with chunkstore.open(url, create=True) as store:
        assert store.versions() == []  # nothing published
    dcp.save(state, storage_writer=ChunkStoreWriter(url, run="r", step=1, allow_pickle=True))
    target = {"w": torch.zeros(2), "when": None, "obj": None}
    with pytest.raises(CheckpointException, match=r"(?s)PickleRefusedError: (when|obj) was"
                       r" stored pickled.*allow_pickle=True"):
        dcp.load(target, storage_reader=ChunkStoreReader(url, "r@1"))
    assert target["when"] is None and target["obj"] is None and not target["w"].any()
    dcp.load(target, storage_reader=ChunkStoreReader(url, "r@1", allow_pickle=True))
    assert target["when"] == dt.date(2024, 1, 2) and target["obj"].value == 3
    assert torch.equal(target["w"], torch.ones(2))
