"""The mirror tier under failure (issue 46, items 4-7): a mirror unreachable from the
first save is pending, not done; a version whose local copy is damaged is reported and
does not hold back the versions after it; a version the local index missed is copied
(never taken for removed) and retention never deletes the last whole copy; and a mirror
that refuses connections or never answers costs the training loop nothing."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend, RequestHook
from chunkstore.errors import BackendUnavailableError, MirrorError
from chunkstore.maintenance.autocollect import Collector
from chunkstore.maintenance.mirror import Replicator
from chunkstore.objects.kinds import CHUNKS, VERSIONS
from torch_bridge import Checkpointer
from torch_bridge.tiers.mirror import S3_MIRROR_OPTIONS, MirrorTier, storage_options


def model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Linear(64, 64)


def steps(path: Path | chunkstore.Store, run: str = "r") -> list[int]:
    if isinstance(path, chunkstore.Store):
        return [v.step for v in path.versions(run)]
    with chunkstore.open(path) as store:
        return [v.step for v in store.versions(run)]


class Switchable(ForwardingBackend):
    """A mirror whose writes fail until ``reachable`` is set."""

    reachable = False

    def put(self, key: str, data: bytes | memoryview) -> None:
        if not self.reachable:
            raise ConnectionError("mirror unreachable (test)")
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if not self.reachable:
            raise ConnectionError("mirror unreachable (test)")
        return super().put_if_absent(key, data)


# --- item 6: a mirror unreachable at the first save is pending, not done ---------------------

def test_a_mirror_unreachable_from_the_first_save_is_pending_until_it_is_reached(
        tmp_path: Path) -> None:
    blocker = tmp_path / "file"  # a path under a regular file cannot be made a store
    blocker.write_text("not a directory")
    mirror = blocker / "mirror"
    ckpt = Checkpointer(tmp_path / "local", run="r", mirror=mirror, keep_last=1)
    try:
        infos = [ckpt.save(step, model=model(step)) for step in (1, 2, 3)]
        ids = [info.id for info in infos if info is not None]
        assert ckpt.mirror_pending == ids  # nothing is mirrored: nothing is done
        with pytest.raises(MirrorError) as caught:
            ckpt.wait(mirror=True, timeout=10)
        assert caught.value.pending == ids
        assert ckpt.all_steps() == [1, 2, 3]  # none leaves the local tier unmirrored
        blocker.unlink()  # the mirror can be made now: the replicator reaches it
        ckpt.wait(mirror=True, timeout=60)
        assert ckpt.mirror_pending == [] and ckpt.all_steps() == [2, 3]
    finally:
        ckpt.close()
    assert steps(mirror) == [1, 2, 3]


def test_close_warns_naming_what_an_unreachable_mirror_left(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ckpt = Checkpointer(tmp_path / "local", run="r", mirror=blocker / "mirror")
    info = ckpt.save(1, model=model(1))
    assert info is not None
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match=f"not mirrored.*{info.id[:12]}"):
        ckpt.close(timeout=5)
    assert time.monotonic() - started < 20


# --- the local tier's collection repacks a pack under a copy --------------------------------


class CollectBeforeRead(RequestHook):
    """The local tier, where the collection that follows retention runs right before the
    first read of ``key``'s bytes once armed (``collector``), the read waiting for it: the
    collector's thread may run between any two requests of the replicator's."""

    def __init__(self, inner: Any, key: str) -> None:
        super().__init__(inner)
        self.key = key
        self.collector: Collector | None = None
        self._lock = threading.Lock()

    def request(self, operation: str, key: str) -> None:
        with self._lock:
            collector = self.collector if operation == "get" and key == self.key else None
            if collector is not None:
                self.collector = None  # the collection's own reads pass
        if collector is not None:
            collector.trigger()
            assert collector.wait_idle(timeout=60)


def test_a_pack_the_local_collection_repacks_under_a_copy_is_read_where_it_moved(
        tmp_path: Path) -> None:
    """The mirror-tier failure of closing-8 (the local file of a pack missing under a
    copy).  After each copy, retention removes the version before it locally, and the
    collection that follows (grace 0) repacks that version's pack, whose unchanged
    members the next version lists (a Checkpointer's RNG states), deleting it once its
    moved record is stored.  The copy of that next version finds the pack in the mirror
    and checks its members in the local tier: the collection runs right before that
    read, and the copy reads them where the moved record puts them (break-checked:
    looking for the pack first and reading it after finds the file missing; the copy
    fails and ``wait`` raises)."""
    local = chunkstore.open(tmp_path / "local", create=True)
    mirror = chunkstore.open(tmp_path / "mirror", create=True)
    rng = np.random.default_rng(11)
    shared = rng.standard_normal(64).astype(np.float32)
    ids = []
    for step in (1, 2):
        with local.new_version("r", step) as version:
            version.put("shared", shared)
            version.put("w", rng.standard_normal(256).astype(np.float32))
        ids.append(version.info.id)
    (pack,) = set(local.index.version_refs(ids[0])) & set(local.index.version_refs(ids[1]))
    hooked = CollectBeforeRead(local.backend, CHUNKS.key(pack))
    local.backend = hooked
    replicator = Replicator(local, mirror)
    try:
        replicator.start([ids[0]])
        replicator.wait(timeout=60)
        local.delete(ids[0])  # retention, once the mirror holds it
        collector = hooked.collector = Collector(local)
        replicator.enqueue(ids[1])
        replicator.wait(timeout=60)
    finally:
        replicator.close(timeout=10)
    assert hooked.collector is None and collector.last_error is None
    assert collector.last_result is not None and collector.last_result.packs_repacked == 1
    assert not local.objects.exists(CHUNKS, pack)
    assert steps(mirror) == [1, 2] and mirror.verify().ok
    collector.close(timeout=10)
    local.close()
    mirror.close()


# --- item 5: one damaged local version does not stop the mirror ------------------------------

def test_a_damaged_local_version_is_reported_and_later_versions_are_mirrored(
        tmp_path: Path) -> None:
    local = chunkstore.open(tmp_path / "local", create=True, delta_depth=0)
    mirror = chunkstore.open(tmp_path / "mirror", create=True)
    switch = Switchable(mirror.backend)
    mirror.backend = switch
    chunks = tmp_path / "local" / "chunks"

    def objects() -> set[Path]:
        return {p for p in chunks.rglob("*") if p.is_file()}

    with Checkpointer(local, run="r", mirror=mirror, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, model=model(step))
        before = objects()
        damaged = ckpt.save(4, model=model(4))
        assert damaged is not None
        for path in objects() - before:  # what only step 4 wrote is lost locally
            path.unlink()
        for step in range(5, 11):
            ckpt.save(step, model=model(step))
        switch.reachable = True
        with pytest.raises(MirrorError, match="damaged") as caught:
            ckpt.wait(mirror=True, timeout=60)
        assert caught.value.pending == [damaged.id]
        assert ckpt.mirror_pending == [damaged.id]
        assert "damaged" in ckpt.mirror_pending_reasons[damaged.id]
        assert steps(mirror) == [1, 2, 3, 5, 6, 7, 8, 9, 10]
        assert ckpt.all_steps() == [4, 9, 10]  # mirrored ones left; step 4 stays
        with pytest.warns(RuntimeWarning, match=damaged.id[:12]):
            ckpt.close()
    local.close()
    mirror.close()


def test_a_transient_failure_still_holds_later_versions_in_order(tmp_path: Path) -> None:
    """A mirror that is down is no damage: the versions wait, in order, and go when it is
    back (the order the mirror receives them is the order of publication)."""
    mirror = chunkstore.open(tmp_path / "mirror", create=True)
    switch = Switchable(mirror.backend)
    mirror.backend = switch
    with Checkpointer(tmp_path / "local", run="r", mirror=mirror) as ckpt:
        ids = []
        for step in (1, 2, 3):
            info = ckpt.save(step, model=model(step))
            assert info is not None
            ids.append(info.id)
        with pytest.raises(MirrorError, match="unreachable"):
            ckpt.wait(mirror=True, timeout=30)
        assert ckpt.mirror_pending == ids
        assert all("unreachable" in ckpt.mirror_pending_reasons[i] for i in ids)
        switch.reachable = True
        ckpt.wait(mirror=True, timeout=60)
    created = [v.created for v in mirror.versions("r")]
    assert steps(mirror) == [1, 2, 3] and created == sorted(created)
    mirror.close()


# --- item 4: a version the local index missed is never taken for removed ---------------------

def test_a_version_the_index_missed_is_mirrored_not_lost(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    local = chunkstore.open(tmp_path / "local", create=True)
    index = local.index
    real_add = index.add_version
    failures = iter([True])

    def add_version(*args: Any, **kwargs: Any) -> Any:
        if next(failures, False):
            raise OSError("index write failed (test)")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(index, "add_version", add_version)
    mirror = tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror, keep_last=1) as ckpt:
        missed = ckpt.save(1, model=model(1))  # published; the index never heard
        assert missed is not None and local.index.version(missed.id) is None
        ckpt.save(2, model=model(2))
        ckpt.wait(mirror=True, timeout=60)
        local.reconcile()  # any process may count it in now
        ckpt.save(3, model=model(3))
        ckpt.wait(mirror=True, timeout=60)
    held = set(steps(mirror)) | set(steps(local))
    assert 1 in held, "step 1 was lost from both tiers"
    assert steps(mirror) == [1, 2, 3]
    local.close()


def test_s3_mirror_options_bound_every_request_under_the_caller_s() -> None:
    options = storage_options("s3://bucket/ckpts", {"config_kwargs": {"read_timeout": 3},
                                                    "anon": False})
    assert options["anon"] is False
    assert options["config_kwargs"] == {**S3_MIRROR_OPTIONS["config_kwargs"],
                                        "read_timeout": 3}
    assert storage_options("/some/dir", {"x": 1}) == {"x": 1}


def test_retention_never_deletes_a_version_the_mirror_lost(tmp_path: Path) -> None:
    """The mirror's copy of step 1 vanished (its commit record gone, no tombstone: not a
    removal anyone made): the local tier keeps the last whole copy."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, run="r", mirror=mirror, keep_last=1) as ckpt:
        first = ckpt.save(1, model=model(1))
        assert first is not None
        ckpt.save(2, model=model(2))
        ckpt.wait(mirror=True, timeout=60)
        (mirror / VERSIONS.key(first.id)).unlink()
        ckpt.save(3, model=model(3))
        ckpt.wait(mirror=True, timeout=60)
        assert 1 in ckpt.all_steps()


# --- item 7: the training loop never waits for the mirror ------------------------------------

@contextlib.contextmanager
def blackhole() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them from the backlog) and
    never answers: a blackholed S3 endpoint."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def refused_port() -> int:
    """A port with nothing listening on it (connections are refused)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


@pytest.fixture
def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)


def _saves_do_not_wait(tmp_path: Path, endpoint: str, limit_s: float) -> None:
    """Three async saves with the mirror at ``endpoint`` down, each within ``limit_s``
    (less than what one try of a mirror request would hold a save that waited for it)."""
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    ckpt = Checkpointer(tmp_path / "local", run="r", async_save=True,
                        mirror="s3://bucket/ckpts", mirror_options=options, mirror_timeout=1)
    try:
        pauses = []
        for step in (1, 2, 3):
            started = time.monotonic()
            ckpt.save(step, model=model(step))
            ckpt.wait()  # the save itself, published locally
            pauses.append(time.monotonic() - started)
        assert max(pauses) < limit_s, pauses
        assert len(ckpt.mirror_pending) == 3
        started = time.monotonic()
        with pytest.raises(MirrorError):
            ckpt.wait(mirror=True, timeout=1)
        assert time.monotonic() - started < 5
        started = time.monotonic()
        restored = model(0)
        assert ckpt.restore(model=restored) == 3  # the local tier holds it
        assert time.monotonic() - started < 8
    finally:
        started = time.monotonic()
        with pytest.warns(RuntimeWarning, match="not mirrored"):
            ckpt.close(timeout=1)
        assert time.monotonic() - started < 8


@pytest.mark.timeout(120)
def test_a_mirror_refusing_connections_costs_the_training_loop_nothing(
        tmp_path: Path, fake_credentials: None) -> None:
    with pytest.warns(RuntimeWarning, match="cannot be reached"):  # at the restore
        # A refused connection fails at once: a save that waited for the mirror's tries
        # (two, with botocore's back-off between them) would take about 2 s or more.
        _saves_do_not_wait(tmp_path, f"http://127.0.0.1:{refused_port()}", limit_s=2.0)


def test_each_request_to_an_s3_mirror_is_bounded(fake_credentials: None) -> None:
    """The replicator's tries end soon on a mirror that refuses connections (botocore's
    and s3fs's own retries took 11 s for one open here), so ``wait`` and ``close``
    report it soon too."""
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{refused_port()}"}}
    tier = MirrorTier("s3://bucket/ckpts", run="r", keep_last=None, options=options,
                      timeout=1, local=lambda: pytest.fail("no local store needed"))
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        tier.open(create=False)
    assert time.monotonic() - started < 4


@pytest.mark.timeout(120)
def test_a_mirror_that_never_answers_costs_the_training_loop_nothing(
        tmp_path: Path, fake_credentials: None) -> None:
    with blackhole() as port, pytest.warns(RuntimeWarning, match="cannot be reached"):
        # A request that is never answered holds its try for the read timeout (10 s): a
        # save that waited for it would take that long.  The bound leaves room for a
        # loaded machine (the replicator's first open imports s3fs and botocore, about a
        # second of CPU under the GIL, while the second save runs: 2.14 s under load 8).
        _saves_do_not_wait(tmp_path, f"http://127.0.0.1:{port}", limit_s=5.0)


def test_rot_in_the_mirror_is_found_by_the_read_back_and_healed(tmp_path: Path) -> None:
    """An object of a frozen tensor every version shares rots in the mirror.  Later
    copies never read it (the mirror "has" it), but the replicator reads the mirror back
    after each copy: with the default budget this small mirror is read whole at every
    save, so the next save's copy finds the rot and rewrites the object from the local
    tier; every mirrored version verifies on the mirror afterwards."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    torch.manual_seed(0)
    frozen = torch.nn.Linear(256, 256)
    with Checkpointer(local, run="r", mirror=mirror) as ckpt:
        ckpt.save(1, model=frozen, head=torch.nn.Linear(8, 8))
        ckpt.wait(mirror=True)
        with chunkstore.open(mirror) as store:
            version = store.latest("r")
            assert version is not None
            entry = store.open_version(version.id).entry("model.weight")
            shard = entry.shards[0]  # type: ignore[union-attr]
            at = shard.location(0)
            victim = at.pack if at is not None else shard.chunks[0]
            good = store.objects.get(CHUNKS, victim)
            store.objects.put(CHUNKS, victim, good[:-1] + bytes([good[-1] ^ 0x01]))
            assert not store.verify().ok
        for step in (2, 3):
            ckpt.save(step, model=frozen, head=torch.nn.Linear(8, 8))
        ckpt.wait(mirror=True)
        replicator = ckpt._tier.replicator  # type: ignore[attr-defined]
        assert replicator is not None and replicator.read_back_stats["healed"] >= 1
    with chunkstore.open(mirror) as store:
        assert store.objects.get(CHUNKS, victim) == good
        assert store.verify().ok and [v.step for v in store.versions("r")] == [1, 2, 3]
