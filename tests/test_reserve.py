"""The index's space reserve (room for rm and gc on a full disk) follows what they need
on that store, and ``report`` says its size and why (issue 48 item 7: every store kept
8 MiB, so a small LoRA run paid 0.176 of torch.save's bytes instead of 0.152).
tests/test_full_disk.py shows the sized reserve still lets rm and gc free a full disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.index import indexfile
from chunkstore.index.indexfile import (
    RESERVE_ENV_VAR,
    RESERVE_FLOOR,
    RESERVE_NAME,
    TOMBSTONE_BYTES,
    keep_reserve,
    release_reserve_if_low,
    reserve_needed,
)

MIB = 1 << 20


@pytest.fixture(autouse=True)
def default_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reserve as users have it (the suite fixes a small one for its many stores)."""
    monkeypatch.delenv(RESERVE_ENV_VAR, raising=False)


def lora_run(path: Path, versions: int = 10) -> None:
    """A frozen base and a small adapter that changes every step."""
    rng = np.random.default_rng(0)
    base = {f"base.{i}": rng.standard_normal(64 * 1024).astype(np.float32) for i in range(4)}
    with chunkstore.open(path, create=True) as store:
        for step in range(versions):
            with store.new_version("lora", step) as version:
                for name, array in base.items():
                    version.put(name, array)
                version.put("adapter.a", rng.standard_normal(2048).astype(np.float32))
                version.put("adapter.b", rng.standard_normal(2048).astype(np.float32))


def reserve_file(path: Path) -> Path:
    return path / "index" / RESERVE_NAME


def test_a_small_store_keeps_a_small_reserve(tmp_path: Path) -> None:
    """Ten LoRA versions: the reserve was 8 MiB, 8x the store's own bytes here."""
    path = tmp_path / "store"
    lora_run(path)
    held = reserve_file(path).stat().st_size
    assert RESERVE_FLOOR <= held <= MIB, held
    with chunkstore.open(path) as store:
        plan = store.index.reserve_plan()
    assert (plan.held, plan.versions, plan.fixed) == (held, 10, False)
    assert plan.needed == held == reserve_needed(plan.index_bytes, 10)
    assert plan.needed >= 2 * plan.index_bytes + 10 * TOMBSTONE_BYTES


def test_the_reserve_grows_with_the_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    lora_run(path, versions=2)
    small = reserve_file(path).stat().st_size
    with chunkstore.open(path) as store:
        for step in range(2, 150):  # each version wants a tombstone's block on rm
            with store.new_version("lora", step) as version:
                version.put("adapter.a", np.full(16, step, dtype=np.float32))
            # what the save added to the index counted too, not a save behind it
            assert reserve_file(path).stat().st_size == store.index.reserve_plan().needed
        plan = store.index.reserve_plan()
    grown = reserve_file(path).stat().st_size
    assert plan.versions == 150 and grown == plan.needed
    assert grown >= small + 148 * TOMBSTONE_BYTES, (small, grown)


def test_reserve_needed_follows_the_index_within_its_bounds() -> None:
    assert reserve_needed(0, 0) == RESERVE_FLOOR
    assert reserve_needed(4096, 1) == 2 * RESERVE_FLOOR  # rounded up to the step
    one_mib_index = reserve_needed(MIB, 0)
    assert one_mib_index == RESERVE_FLOOR + 2 * MIB
    assert reserve_needed(2 * MIB, 0) > one_mib_index
    assert reserve_needed(100 << 30, 10**6) == indexfile.RESERVE_CAP


def test_the_environment_variable_fixes_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESERVE_ENV_VAR, str(3 * MIB))
    assert reserve_needed(0, 0) == reserve_needed(50 * MIB, 1000) == 3 * MIB
    monkeypatch.setenv(RESERVE_ENV_VAR, "0")
    assert reserve_needed(50 * MIB, 1000) == 0


def test_keep_reserve_grows_shrinks_and_keeps_within_a_factor_of_two(tmp_path: Path) -> None:
    target = tmp_path / RESERVE_NAME
    keep_reserve(str(tmp_path), RESERVE_FLOOR)
    assert target.stat().st_size == RESERVE_FLOOR
    assert target.stat().st_blocks * 512 >= RESERVE_FLOOR  # real blocks, not a sparse file
    keep_reserve(str(tmp_path), 4 * RESERVE_FLOOR)  # the store grew
    assert target.stat().st_size == 4 * RESERVE_FLOOR
    keep_reserve(str(tmp_path), 3 * RESERVE_FLOOR)  # a little smaller: kept as it is
    assert target.stat().st_size == 4 * RESERVE_FLOOR
    keep_reserve(str(tmp_path), RESERVE_FLOOR)  # a GC halved it and more: cut
    assert target.stat().st_size == RESERVE_FLOOR
    keep_reserve(str(tmp_path), 0)  # CHUNKSTORE_SPACE_RESERVE=0: none
    assert not target.exists()


def test_rm_and_gc_give_it_up_when_less_than_they_need_is_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reserve made while the store was small is given up once less than what rm and
    gc need now is free, not only less than its own size."""
    keep_reserve(str(tmp_path), RESERVE_FLOOR)
    monkeypatch.setattr(indexfile, "free_bytes", lambda _path: 2 * RESERVE_FLOOR)
    assert not release_reserve_if_low(str(tmp_path), RESERVE_FLOOR)
    assert release_reserve_if_low(str(tmp_path), 4 * RESERVE_FLOOR)
    assert not (tmp_path / RESERVE_NAME).exists()


def test_report_says_the_reserve_size_and_why(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store"
    lora_run(path)
    held = reserve_file(path).stat().st_size
    text = CliRunner().invoke(cli, ["report", str(path)]).output
    (line,) = [line for line in text.splitlines() if "space reserve" in line]
    assert str(reserve_file(path)) in line and "room for rm and gc on a full disk" in line
    assert "twice the index's" in line and "a tombstone for each of 10 versions" in line
    assert "it grows with the store" in line
    doc = json.loads(CliRunner().invoke(cli, ["report", str(path), "--json"]).output)
    reserve = doc["space_reserve"]
    assert (reserve["held"], reserve["needed"], reserve["versions"], reserve["fixed"]) == (
        held, held, 10, False)
    monkeypatch.setenv(RESERVE_ENV_VAR, str(held))
    text = CliRunner().invoke(cli, ["report", str(path)]).output
    assert f"its size fixed by {RESERVE_ENV_VAR}" in text
