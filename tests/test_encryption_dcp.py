"""torch.distributed.checkpoint into an encrypted store: four gloo ranks save twice
(each rank a real process, the password from the environment), then the version loads
at world sizes 2 and 1, bit-exact, and verifies."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import chunkstore
from chunkstore.objects.keys import TEST_KDF_ENV
from chunkstore.objects.sealed import SealedObjects
from tests.dcp_child import RUN
from tests.test_dcp import CHUNK, _all_ok, _load_here, _spawn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
PASSWORD = "dcp password"


def test_dcp_save_at_4_ranks_then_resharded_loads_of_an_encrypted_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KDF_ENV, "1")
    url = str(tmp_path / "store")
    chunkstore.open(url, chunk_size=CHUNK, create=True, encrypt=True, password=PASSWORD).close()
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)  # what every rank's process opens with
    reports = _all_ok(_spawn("save_twice_then_load", 4, url, tmp_path / "w4")[0])
    assert reports[0]["infos"][1] is not None
    _all_ok(_spawn("load_latest", 2, url, tmp_path / "w2", {"step": 2})[0])
    _load_here(url, f"{RUN}@latest", 2)
    _load_here(url, f"{RUN}@1", 1)
    with chunkstore.open(url) as store:
        assert isinstance(store.objects, SealedObjects)
        assert store.verify().ok
