"""A tiered Checkpointer: saves publish to a fast local tier, a background replicator
copies each version to a mirror (another directory here; any store URL works), the local
tier keeps a version until it is mirrored, and restore reads the nearest tier that holds
the newest version whole, refilling an empty local tier from the mirror."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import InvalidInputError, MirrorError
from chunkstore.objects.kinds import CHUNKS
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options
from torch_bridge import Checkpointer
from torch_bridge.errors import RestoreFallbackWarning

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

ROOT = Path(__file__).resolve().parent.parent
KILLED_CHILD = """
import sys, torch, chunkstore
from chunkstore.backends.wrappers import KillAfterBackend
from torch_bridge import Checkpointer
local = chunkstore.open(sys.argv[1], create=True)
mirror = chunkstore.open(sys.argv[2], create=True)
mirror.backend = KillAfterBackend(mirror.backend, "chunks/", int(sys.argv[3]), after=True)
ckpt = Checkpointer(local, run="r", mirror=mirror)
for step in range(1, 6):
    torch.manual_seed(step)
    ckpt.save(step, model=torch.nn.Linear(64, 64))
ckpt.wait(mirror=True)
print("all mirrored", flush=True)
"""


def model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Linear(64, 64)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def steps(path: Path) -> list[int]:
    with chunkstore.open(path) as store:
        return [v.step for v in store.versions("r")]


def test_versions_are_mirrored_and_a_fresh_node_restores_from_the_mirror(
        tmp_path: Path) -> None:
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror, keep_last=2, mirror_keep_last=3) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, model=model(step))
        ckpt.wait(mirror=True)
        assert ckpt.mirror_pending == []
    assert steps(local) == [4, 5] and steps(mirror) == [3, 4, 5]
    # Both tiers intact: the local one is nearer.
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        restored = model(0)
        assert ckpt.restore(model=restored) == 5 and same(restored, model(5))
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "local"
    # A fresh node: nothing local. The mirror serves it, and the local tier is refilled.
    fresh = tmp_path / "fresh"
    with Checkpointer(fresh, run="r", mirror=mirror) as ckpt:
        restored = model(0)
        assert ckpt.restore(model=restored) == 5 and same(restored, model(5))
        source = ckpt.last_restore
        assert source is not None and (source.tier, source.reason) == (
            "mirror", "there is no local store")
    assert steps(fresh) == [5]
    with Checkpointer(fresh, run="r", mirror=mirror) as ckpt:
        ckpt.restore(model=model(0))
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "local"


def test_a_damaged_local_copy_is_read_from_the_mirror(tmp_path: Path) -> None:
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=model(step))
        ckpt.wait(mirror=True)
        newest = ckpt.store.versions("r")[-1]
    for chunk in (local / "chunks").rglob("*"):  # damage every object of the local tier
        if chunk.is_file():
            data = chunk.read_bytes()  # the last byte flipped (a zero byte stays damaged)
            chunk.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with Checkpointer(local, run="r", mirror=mirror) as ckpt, \
            pytest.warns(RestoreFallbackWarning, match="local tier") as warned:
        restored = model(0)
        assert ckpt.restore(model=restored) == 2 and same(restored, model(2))
        source = ckpt.last_restore
        assert source is not None and source.tier == "mirror" and source.version == newest.id
        assert source.reason.startswith("its local copy is damaged")
    # The warning points at the caller's line (it pointed at contextlib.py).
    assert {w.filename for w in warned} == {__file__}
    # The restore healed the local tier (it said "already there" and left it damaged):
    # the version verifies there, and the next restore reads it locally.
    with chunkstore.open(local) as store:
        assert store.verify(newest.id).ok
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        restored = model(0)
        assert ckpt.restore(model=restored) == 2 and same(restored, model(2))
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "local"


class Unreachable(ForwardingBackend):
    """A mirror that refuses every write until it is reachable again."""

    reachable = False

    def put(self, key: str, data: bytes | memoryview) -> None:
        if not self.reachable:
            raise ConnectionError("mirror unreachable (test)")
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if not self.reachable:
            raise ConnectionError("mirror unreachable (test)")
        return super().put_if_absent(key, data)


def test_the_local_tier_keeps_what_is_not_mirrored(tmp_path: Path) -> None:
    mirror = chunkstore.open(tmp_path / "mirror", create=True)
    flaky = Unreachable(mirror.backend)
    mirror.backend = flaky
    with Checkpointer(tmp_path / "local", run="r", mirror=mirror, keep_last=1) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, model=model(step))
        with pytest.raises(MirrorError, match="unreachable"):
            ckpt.wait(mirror=True, timeout=30)
        assert ckpt.all_steps() == [1, 2, 3, 4]  # none may go before it is mirrored
        flaky.reachable = True
        ckpt.wait(mirror=True, timeout=60)  # the replicator retries
        assert ckpt.all_steps() == [3, 4]
    assert [v.step for v in mirror.versions("r")] == [1, 2, 3, 4]
    mirror.close()


@pytest.mark.parametrize("writes", [0, 2])
def test_a_replicator_killed_mid_copy_leaves_whole_versions_and_resumes(
        tmp_path: Path, writes: int) -> None:
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(local), str(mirror),
                            str(writes)], cwd=ROOT, capture_output=True, text=True,
                           timeout=180, check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    with chunkstore.open(mirror) as store:
        landed = [v.step for v in store.versions("r")]
        assert len(landed) < 5
        for version in store.versions("r"):
            assert store.verify(version.id).ok
    saved = steps(local)  # the kill also stopped the saves: steps 1..k
    assert set(landed) <= set(saved)
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        ckpt.save(6, model=model(6))
        ckpt.wait(mirror=True, timeout=120)
    # A save killed after claiming its commit slot is rolled forward by the next owner
    # of the run (docs/format.md §11.5): its step may be published now too.
    after = steps(local)
    assert steps(mirror) == after and after[-1] == 6
    assert set(saved) <= set(after) and len(after) <= len(saved) + 2
    with chunkstore.open(mirror) as store:
        assert all(store.verify(v.id).ok for v in store.versions("r"))
        assert sum(1 for _ in store.objects.ids(CHUNKS)) > 0


def test_a_mirror_that_is_the_store_itself_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="own store"):
        Checkpointer(tmp_path / "s", run="r", mirror=os.fspath(tmp_path / "s") + "/")


def test_a_mirror_on_s3(s3_endpoint: str, tmp_path: Path) -> None:
    bucket = create_bucket(s3_endpoint)
    try:
        url = f"s3://{bucket}/ckpts"
        mirror = chunkstore.open(url, create=True, storage_options=storage_options(s3_endpoint),
                                 index_dir=str(tmp_path / "mirror-index"))
        with Checkpointer(tmp_path / "local", run="r", mirror=mirror, keep_last=1) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, model=model(step))
            ckpt.wait(mirror=True, timeout=120)
        assert [v.step for v in mirror.versions("r")] == [1, 2, 3]
        with Checkpointer(tmp_path / "fresh", run="r", mirror=mirror) as ckpt:
            restored = model(0)
            assert ckpt.restore(model=restored) == 3 and same(restored, model(3))
            assert ckpt.last_restore is not None and ckpt.last_restore.tier == "mirror"
        mirror.close()
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_a_restore_says_what_it_read_and_how_long_each_phase_took(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "plain", run="r") as ckpt:
        ckpt.save(1, model=model(1))
        ckpt.save(2, model=model(2))
    with Checkpointer(tmp_path / "plain", run="r") as ckpt:
        ckpt.restore(model=model(0))
        source = ckpt.last_restore
        assert source is not None and (source.step, source.tier) == (2, "local")
        assert set(source.timings) == {"discover", "read", "apply"}
        assert all(0 <= t < 60 for t in source.timings.values())
        assert source.bytes >= 64 * 64 * 4
    with Checkpointer(tmp_path / "fresh", run="r", mirror=tmp_path / "plain") as ckpt:
        ckpt.restore(model=model(0))
        source = ckpt.last_restore
        assert source is not None and source.tier == "mirror"
        assert set(source.timings) == {"discover", "read", "apply", "refill"}


def test_log_says_which_versions_the_mirror_holds(tmp_path: Path) -> None:
    import json as _json

    from click.testing import CliRunner

    from chunkstore.cli import cli

    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        ckpt.save(1, model=model(1))
        ckpt.wait(mirror=True)
    with Checkpointer(local, run="r") as ckpt:  # no mirror: step 2 stays local only
        ckpt.save(2, model=model(2))
    result = CliRunner().invoke(cli, ["log", str(local), "--mirror", str(mirror), "--json"])
    assert result.exit_code == 0, result.output
    assert {v["step"]: v["mirrored"] for v in _json.loads(result.output)["versions"]} == {
        1: True, 2: False}
    text = CliRunner().invoke(cli, ["log", str(local), "--mirror", str(mirror)])
    assert "MIRRORED" in text.output and text.exit_code == 0
    missing = CliRunner().invoke(cli, ["log", str(local), "--mirror", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "no store" in missing.output


def test_an_unreachable_mirror_never_fails_a_save_or_a_restore(tmp_path: Path) -> None:
    """A mirror that cannot be opened (here a path under a regular file) never fails a
    save: every version stays in the local tier, pending (``close`` warns naming them),
    and a restore reads the local tier (tests/test_mirror_tier.py holds the rest)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mirror = blocker / "mirror"
    with pytest.warns(RuntimeWarning, match="3 version.*not mirrored.*cannot be reached"), \
            Checkpointer(tmp_path / "local", run="r", mirror=mirror, keep_last=1) as ckpt:
        for step in (1, 2, 3):
            info = ckpt.save(step, model=model(step))
            assert info is not None and info.step == step  # published, and said so
        assert ckpt.all_steps() == [1, 2, 3]  # none leaves before it is mirrored
        assert len(ckpt.mirror_pending) == 3
        with pytest.raises(MirrorError, match="cannot be reached"):
            ckpt.wait(mirror=True, timeout=10)
    with Checkpointer(tmp_path / "local", run="r", mirror=mirror) as ckpt:
        restored = model(0)
        assert ckpt.restore(model=restored) == 3 and same(restored, model(3))
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "local"


def test_a_restarted_replicator_does_not_copy_what_the_mirror_pruned(tmp_path: Path) -> None:
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror, mirror_keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, model=model(step))
        ckpt.wait(mirror=True)
    assert steps(mirror) == [4, 5]
    with Checkpointer(local, run="r", mirror=mirror, mirror_keep_last=2) as ckpt:
        ckpt.save(6, model=model(6))
        ckpt.wait(mirror=True)
    assert steps(mirror) == [5, 6]
    with chunkstore.open(mirror) as store:  # steps 1-3 were never published there again
        assert not [v for v in store.versions("r") if v.step < 4]


def test_a_mirror_that_fails_at_restore_leaves_the_local_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror whose server does not answer (BackendUnavailableError when it is opened)
    warns, and the restore reads the local tier, which holds the run."""
    from chunkstore.errors import BackendUnavailableError

    with Checkpointer(tmp_path / "local", run="r", mirror=tmp_path / "mirror") as ckpt:
        ckpt.save(1, model=model(1))
        ckpt.wait(mirror=True)
    with Checkpointer(tmp_path / "local", run="r", mirror=tmp_path / "mirror") as ckpt:
        def down(*, create: bool) -> None:
            raise BackendUnavailableError("s3://bucket", "versions/", "connection refused")
        assert ckpt._tier is not None
        monkeypatch.setattr(ckpt._tier, "open", down)
        with pytest.warns(RuntimeWarning, match="restoring from the local tier alone"):
            assert ckpt.restore(model=model(0)) == 1
        assert ckpt.last_restore is not None and ckpt.last_restore.tier == "local"
