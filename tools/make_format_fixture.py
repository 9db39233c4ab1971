"""Build a small frozen store that pins the on-disk format (see docs/format.md).

The store under ``tests/data/store-vN/`` is committed to the repository and
read by ``tests/test_format.py`` with every later release: old stores must stay
readable.  ``tests/data/store-vN.expected.json`` records what a reader must get
out of it (the BLAKE3 of each tensor's bytes, each plain-data value as tagged
JSON, run/step/meta of each version, the tag) and the BLAKE3 of every object
file, so an accidental edit of the fixture is caught too.

Besides the versions, a fixture holds the protocol objects of docs/format.md §11.5
and §11.6 a reader meets (store-v11 on): the run's generations and commit slots, the
``@rolled-``/``@withdrawn-`` markers of a takeover whose stopped writer published a
removed version late, and the read lease of a reader that is gone.  They are written
through :class:`~chunkstore.protocol.runlease.RunLease` and a real reader; only what no
live process writes (the owner of a process on another machine that is gone, and the
times it recorded) is set here.

Never regenerate an existing fixture after a format change: that would turn a
pinned old format into the new one.  Build a new fixture (``--name store-v2``)
and keep the old one.  Regenerating with an unchanged format yields the same
chunk keys and the same manifest nodes; the store config, tag and commit
records differ (they carry creation times, so the version ids differ too).

With ``--with-hold`` (store-v12 on) the store also holds a legal hold (docs/format.md
§15) on one version, with a fixed reason, owner and time, which upgrades it to store
version 11.

Usage (from the repository root)::

    python tools/make_format_fixture.py                 # refuses to overwrite
    python tools/make_format_fixture.py --force         # same format, rebuilt
    python tools/make_format_fixture.py --name store-v2 # after a format change
    python tools/make_format_fixture.py --name store-v12 --with-hold
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast
from unittest import mock

import blake3
import ml_dtypes
import numpy as np

import chunkstore
from chunkstore.codecs import PACK
from chunkstore.format import plaindata
from chunkstore.format.chunkobj import CHUNK_FORMAT_VERSION, HEADER
from chunkstore.format.digest import Digest
from chunkstore.format.dtypes import dtype_name
from chunkstore.format.manifest import NODE_FORMAT_VERSION
from chunkstore.format.records import (
    HOLDS_STORE_FORMAT_VERSION,
    RECORD_FORMAT_VERSION,
    STORE_FORMAT_VERSION,
)
from chunkstore.handle.holding import upgrade_for_holds
from chunkstore.handle.tree import load_tree
from chunkstore.objects.kinds import CHUNKS, HOLDS, LEASES, READERS, VERSIONS
from chunkstore.protocol import runlease
from chunkstore.protocol.holds import HOLD_FORMAT, encode_hold
from chunkstore.protocol.readleases import READ_LEASE_FORMAT, expired_read_leases
from chunkstore.protocol.runlease import (
    LEASE_FORMAT,
    MARKER_FORMAT,
    SLOT_FORMAT,
    RunLease,
    read_lease,
    withdrawn,
)
from chunkstore.protocol.sessions import owner_info

CHUNK_SIZE = 4096
RUN = "fmt"
TAG = "best"
TAGGED_SELECTOR = f"{RUN}@1"
DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data"
#: Codec ids every fixture must contain at least one chunk of.
REQUIRED_CODECS = {0: "raw", 1: "zstd", 2: "shuffle-zstd", 3: "xor-delta", 4: "pack",
                   5: "sub-delta", 6: "sparse-delta"}
MAX_FIXTURE_BYTES = 300_000
#: The fixture store's delta chain bound: the versions after the second build
#: chains of every depth up to it, then one that starts over standalone.
DELTA_DEPTH = 3
#: The fixture store's handle inlines subtrees into tree nodes up to this size (node
#: format 4): small enough that its versions have inlined subtrees (dotted names) next
#: to subtrees that are nodes of their own, and levels split into continuation nodes.
NODE_SIZE = 1200


def _noise(length: int, seed: bytes) -> np.ndarray:
    """Incompressible bytes from BLAKE3's XOF: identical on every platform and numpy."""
    return np.frombuffer(blake3.blake3(seed).digest(length=length), dtype=np.uint8).copy()


def arrays_v1() -> dict[str, np.ndarray]:
    """Arrays of the first version; exact arithmetic only, so the bytes never vary."""
    steps = np.arange(3000, dtype=np.float32)
    # Smooth floats with random low mantissa bytes: shuffle-zstd with planes
    # kept raw (mode 0) next to planes compressed (mode 1).
    smooth = (steps * np.float32(0.5) + np.float32(1000)).view(np.uint32)
    smooth = (smooth & np.uint32(0xFFFFFF00)) | _noise(3000, b"smooth").astype(np.uint32)
    return {
        "model.embed.weight": smooth.view(np.float32).reshape(100, 30),
        "model.embed.bias": (np.arange(2500, dtype=np.float32) / 4).astype(ml_dtypes.bfloat16),
        "model.counts": (np.arange(1500, dtype=np.int64) % 97) * 1_000_003,  # zstd
        "model.noise": _noise(6000, b"noise").reshape(60, 100),  # raw: incompressible
        "model.mask": (np.arange(77) % 3 == 0).reshape(7, 11),
        "model.layers.0.w": np.arange(-60, 60, dtype=np.int16).reshape(2, 3, 20),
        "model.layers.1.w": np.arange(24, dtype=np.complex64).reshape(4, 6) * (1 + 2j),
        "head": np.arange(12, dtype=np.float64).reshape(3, 4) / 8,
        # complex128 (16-byte elements): its deltas are xor-delta, the others sub-delta.
        "head.phase": np.arange(300, dtype=np.complex128) * (0.25 - 0.5j),
        "empty": np.zeros((0, 3), dtype=np.float16),
        "scalar": np.array(2.5, dtype=np.float64),
        "big.endian": np.arange(10, dtype=">u4"),  # stored little-endian, as uint32
    }


def data_v1() -> dict[str, object]:
    """Plain data of the first version: every tag of the safe encoding appears."""
    return {
        "trainer": {
            "epoch": 3, "lr": 1e-4, "name": "h\u00e9llo \u2713", "none": None,
            "flags": [True, False], "betas": (0.9, 0.999), "blob": b"\x00\x01\xfe\xff",
            "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
            "big": 2**70, "neg": -7,
        },
        "optimizer.state": {0: {"step": 10, "exp_avg_shape": (3, 4)}, 1: {"step": 10}},
        "rng": ("MT19937", (1, 2, 3), None),
        "head.scale": {"$literal": "dollar keys force the $dict tag", (1, "a"): b"k"},
        "empty.data": {},
    }


def version_2(arrays: dict[str, np.ndarray], data: dict[str, object]
              ) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """The second version: most entries unchanged (shared), one chunk changed, one added."""
    arrays = dict(arrays)
    counts = arrays["model.counts"].copy()
    counts[:10] = -1  # touches the first chunk only
    arrays["model.counts"] = counts
    arrays["extra"] = np.arange(5, dtype=np.uint8)
    data = dict(data)
    trainer = dict(cast("dict[str, object]", data["trainer"]))
    trainer["epoch"] = 4
    data["trainer"] = trainer
    return arrays, data


def version_n(arrays: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Versions 3 and later: a few elements of two float tensors change (a sparse
    update), so their chunks become deltas against the previous version's (sparse-delta;
    xor-delta for complex128); at step 5 every element of the last chunk of the
    embedding changes too (a dense update: sub-delta)."""
    arrays = dict(arrays)
    embed = arrays["model.embed.weight"].copy()
    embed.reshape(-1)[[7 * n, 1100 + n, 2500 + 3 * n]] += np.float32(n)
    if n == 5:
        embed.reshape(-1)[2048:] += np.float32(4)
    arrays["model.embed.weight"] = embed
    bias = arrays["model.embed.bias"].copy()
    bias[[n, 1500 + n]] = ml_dtypes.bfloat16(-n)
    arrays["model.embed.bias"] = bias
    phase = arrays["head.phase"].copy()
    phase[[n, 290 - n]] += 1j * n
    arrays["head.phase"] = phase
    return arrays


def removed_version() -> dict[str, np.ndarray]:
    """The third version, removed at once: its own bytes, so chunks await GC."""
    return {"gone": _noise(3000, b"removed").astype(np.float32)}


def _tensor_expectation(array: np.ndarray) -> dict[str, Any]:
    little = array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array
    little = np.ascontiguousarray(little)
    return {"kind": "tensor", "dtype": dtype_name(little.dtype),
            "shape": list(array.shape), "nbytes": little.nbytes,
            "blake3": blake3.blake3(little.tobytes()).hexdigest()}


def _write_version(store: chunkstore.Store, step: int, arrays: dict[str, np.ndarray],
                   data: dict[str, object], meta: dict[str, object], run: str = RUN,
                   before_commit: Callable[[], None] | None = None) -> dict[str, Any]:
    with store.new_version(run=run, step=step, meta=meta) as version:
        version.before_commit = before_commit  # a RunLease: the commit is fenced
        for name, array in arrays.items():
            version.put(name, array)
        for name, value in data.items():
            version.put_data(name, value)
    entries: dict[str, Any] = {name: _tensor_expectation(a) for name, a in arrays.items()}
    for name, value in data.items():
        entries[name] = {"kind": "data", "value": plaindata.to_tree(value)}
    return {"id": version.info.id, "run": run, "step": step, "parent": version.info.parent,
            "meta": plaindata.to_tree(meta), "entries": dict(sorted(entries.items()))}


#: The run whose packs GC repacks (store version 6): ten small tensors; step 2 changes
#: the first six, step 3 the first nine.
MOVED_RUN = "moved"
MOVED_CHANGES = {1: 10, 2: 6, 3: 9}


def moved_arrays(step: int) -> dict[str, np.ndarray]:
    """Tensor ``t<i>`` holds the noise of the last step (up to ``step``) that changed it."""
    def last_change(i: int) -> int:
        return max(s for s, count in MOVED_CHANGES.items() if s <= step and i < count)
    return {f"t{i}": _noise(300, f"t{i}@{last_change(i)}".encode()) for i in range(10)}


def _repacked_versions(store: chunkstore.Store) -> list[dict[str, Any]]:
    """Versions whose packs GC repacked twice (store version 6): after step 1 is removed,
    step 1's pack is 6/10 garbage and its four live members move to a new pack; after
    step 2 is removed, three of those four are garbage and the last moves again, so step
    3 reads it through two moved records (step 1's pack, then the first new pack)."""
    written = [_write_version(store, step, moved_arrays(step), {}, {"step": step}, MOVED_RUN)
               for step in MOVED_CHANGES]
    for removed in written[:2]:
        store.delete(removed["id"])
        result = store.gc(grace=0)
        if result.packs_repacked != 1:
            raise SystemExit(f"gc repacked {result.packs_repacked} packs after removing"
                             f" {MOVED_RUN}@{removed['step']}, not 1")
    records = sorted(store.backend.list("moved/"))
    if len(records) != 2:
        raise SystemExit(f"the fixture needs two moved records, saw {records}")
    return written[2:]


def _is_repack_target(root: Path, key: str) -> bool:
    """Whether chunk object ``key`` is a pack a moved record points to."""
    targets = {json.loads(p.read_bytes())["to"] for p in (root / "moved").glob("*")}
    return key.rsplit("/", 1)[-1] in targets


def _object_digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): blake3.blake3(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _codec_census(root: Path) -> tuple[dict[str, int], set[int]]:
    """Chunk objects per codec name, and the shuffle plane modes seen."""
    counts: dict[str, int] = {}
    modes: set[int] = set()
    for path in sorted((root / "chunks").rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        name = REQUIRED_CODECS.get(data[5], str(data[5]))
        counts[name] = counts.get(name, 0) + 1
        modes |= _plane_modes(data, 0)
    return dict(sorted(counts.items())), modes


def _plane_modes(data: bytes, pos: int) -> set[int]:
    """The plane modes of the codec-2, 3 or 5 object at ``pos`` of ``data``."""
    codec_id, element_size, flags = data[pos + 5], data[pos + 6], data[pos + 7]
    if codec_id not in (2, 3, 5):
        return set()
    start = pos + HEADER.size + (32 if flags & 1 else 0) + 1  # after any base digest
    return {struct.unpack_from("<B", data, start + 5 * i)[0] for i in range(element_size)}


def _member_census(root: Path) -> tuple[set[str], set[int]]:
    """The codecs of the members inside the fixture's packs, and their plane modes."""
    names: set[str] = set()
    modes: set[int] = set()
    for path in sorted((root / "chunks").rglob("*")):
        data = path.read_bytes() if path.is_file() else b""
        if len(data) < HEADER.size or data[5] != 4:
            continue
        pos = HEADER.size
        while pos < len(data):
            *_, flags, _, payload_length = HEADER.unpack_from(data, pos)
            names.add(REQUIRED_CODECS.get(data[pos + 5], str(data[pos + 5])))
            modes |= _plane_modes(data, pos)
            pos += HEADER.size + (32 if flags & 1 else 0) + payload_length
    return names, modes


def _packed_deltas(store: chunkstore.Store) -> tuple[int, int]:
    """Packed chunks listed with a delta chain, and listed bases that lie in packs."""
    deltas: set[str] = set()
    bases: set[str] = set()
    for info in store.versions():
        for leaf in store.open_version(info.id).entries().values():
            for shard in getattr(leaf, "shards", ()):
                for i, digest in enumerate(shard.chunks):
                    if shard.location(i) is not None and shard.chain(i):
                        deltas.add(digest.hex)
                    bases.update(base.hex for base, at in zip(shard.chain(i),
                                                              shard.chain_locations(i),
                                                              strict=True) if at is not None)
    return len(deltas), len(bases)


def _chain_depths(store: chunkstore.Store) -> set[int]:
    """The delta chain depths the versions' manifests list."""
    depths: set[int] = set()
    for info in store.versions():
        for leaf in store.open_version(info.id).entries().values():
            for shard in getattr(leaf, "shards", ()):
                depths.update(len(shard.chain(i)) for i in range(len(shard.chunks)))
    return depths


def _packed_chunks(store: chunkstore.Store) -> tuple[int, int]:
    """Distinct packed chunks the versions list, and the versions that reuse a pack
    an earlier version wrote (deduplication against an older pack)."""
    members: set[tuple[str, str]] = set()
    first_seen: dict[str, str] = {}
    reusing = set()
    for info in store.versions():
        for leaf in store.open_version(info.id).entries().values():
            for shard in getattr(leaf, "shards", ()):
                for i, digest in enumerate(shard.chunks):
                    location = shard.location(i)
                    if location is None:
                        continue
                    members.add((digest.hex, location.pack.hex))
                    owner = first_seen.setdefault(location.pack.hex, info.id)
                    if owner != info.id:
                        reusing.add(info.id)
    return len(members), len(reusing)


def _tree_layout(store: chunkstore.Store) -> tuple[int, int, int]:
    """Tree entries named by a dotted path (an inlined subtree), entries that name a
    subtree node, and continuation nodes listed, over every version's tree nodes."""
    inlined = referenced = continued = 0
    seen: set[Digest] = set()
    todo = [info.root for info in store.versions()]
    while todo:
        digest = todo.pop()
        if digest in seen:
            continue
        seen.add(digest)
        node = load_tree(store.objects, digest, store.node_cache)
        inlined += sum("." in name for name in set(node.leaves) | set(node.subtrees))
        referenced += len(node.subtrees)
        continued += len(node.more)
        todo.extend(node.children())
    return inlined, referenced, continued


# --- protocol objects (docs/format.md §11.5 and §11.6) -------------------------------------

#: The times the fixture's launches and reader record (Unix seconds, November 2023):
#: fixed and long past, so that every one of them is gone by its heartbeat wherever and
#: whenever the fixture is read.  (A run's holder on another machine is judged by its
#: object's stored time, which a checkout does not keep: tests set it to the heartbeat.)
LEASE_TIME = 1_700_000_000.0
#: A pid namespace no machine has: pids compare only within one (docs/format.md §11.1).
GONE_PIDNS = "00000000-0000-4000-8000-000000000000:4026531836"
#: The reader of the removed version, killed while it read, on a machine of its own.
GONE_READER = "0f0f0f0f0f0f4f0f8f0f0f0f0f0f0f0f"


def _gone_owner(name: str, pid: int) -> dict[str, Any]:
    """Owner fields (``owner_info``'s) of a process on machine ``name`` (``.invalid``: no
    machine has that name), since gone."""
    owner: dict[str, Any] = {"host": f"{name}.invalid", "pid": pid, "pidns": GONE_PIDNS,
                             "process_start": "1"}
    if set(owner) != set(owner_info()):
        raise SystemExit(f"owner fields are now {sorted(owner_info())}: update _gone_owner")
    return owner


@contextmanager
def _launch(name: str, pid: int, at: float) -> Iterator[None]:
    """Play a launch of the run on machine ``name`` at time ``at``: a RunLease made and
    acquired here records that owner and time (``runlease.clock``, the seam tests use to
    play a machine whose clock is off)."""
    with mock.patch.object(runlease, "owner_info", lambda: _gone_owner(name, pid)), \
            mock.patch.object(runlease, "clock", lambda: at):
        yield


class _StoppedBeforeItsPut(RunLease):
    """A writer's lease whose process is stopped after its commit check, right before
    the PUT of its commit record (``meanwhile`` runs then), and killed right after that
    PUT, before :meth:`RunLease.confirm`: the one way a record of a withdrawn version
    stays in ``versions/`` (docs/format.md §11.5)."""

    meanwhile: Callable[[], None] = staticmethod(lambda: None)

    def check(self) -> None:
        super().check()
        self.meanwhile()

    __call__ = check

    def confirm(self, version_id: str) -> None:
        """Killed before it looks for the ``withdrawn`` marker."""


def _gone_reader(store: chunkstore.Store, version_id: str) -> str:
    """Store the lease of a reader of ``version_id`` on another machine, killed while it
    read (never deleted; its last heartbeat long past): the bytes a reader writes (taken
    from a real reader's lease), with that reader's owner, id and times."""
    with store.open_version(version_id):
        [live] = store.objects.ids(READERS)
        body = plaindata.load_json(store.objects.get(READERS, live))
    body.update(_gone_owner("fixture-reader", 4404), id=GONE_READER, since=LEASE_TIME + 1800,
                heartbeat=LEASE_TIME + 1830)
    if not store.objects.put_if_absent(READERS, GONE_READER,
                                       json.dumps(body, sort_keys=True).encode()):
        raise SystemExit(f"readers/{GONE_READER} exists")
    return GONE_READER


def _lease_history(store: chunkstore.Store, arrays: dict[str, np.ndarray],
                   data: dict[str, object]) -> dict[str, Any]:
    """Three launches of the run (docs/format.md §11.5):

    1. takes the run (generation 1, fences slot 1), saves nothing, releases it;
    2. takes it (generation 2, fences slot 2) and saves step 7 (the state of step 6
       again): claims slot 3 with its intent, checks, and is stopped before its PUT;
    3. meanwhile takes the run over (generation 3): rolls slot 3's intent forward
       (``@rolled-``, the record), fences slot 4, removes the version (its tombstone,
       ``@withdrawn-``, the record deleted) and is killed, its generation never
       released, the earlier releases' ``leases/<run>`` its own;
    4. launch 2 continues: its PUT creates the record again, and it is killed before it
       looks for the marker.

    Returns what a reader must make of them."""
    objects = store.objects
    with _launch("fixture-launch-1", 4101, LEASE_TIME):
        first = RunLease(objects, RUN)
        first.acquire()
    first.release()
    taken: list[str] = []

    def take_over_and_remove() -> None:
        with _launch("fixture-launch-3", 4303, LEASE_TIME + 1200):
            taker = RunLease(objects, RUN)
            taker.acquire(takeover=True)
        taker.held = False  # killed: its heartbeat stops, it never releases the run
        if taker.head is None:
            raise SystemExit("the takeover rolled nothing forward")
        store.delete(taker.head)
        taken.append(taker.head)

    with _launch("fixture-launch-2", 4202, LEASE_TIME + 600):
        stopped = _StoppedBeforeItsPut(objects, RUN)
        stopped.acquire()
    stopped.meanwhile = take_over_and_remove
    late = _write_version(store, 7, arrays, data, {"step": 7}, before_commit=stopped)["id"]
    stopped.held = False  # killed
    holder = read_lease(objects, RUN) or {}
    slots = {int(n.rpartition("-")[2]): json.loads(objects.get(LEASES, n))
             for n in objects.ids(LEASES, f"{RUN}@slot-")}
    if (taken != [late] or withdrawn(objects) != {late} or not objects.exists(VERSIONS, late)
            or store.read_record(late).root != store.resolve(f"{RUN}@6").root
            or holder.get("generation") != 3 or sorted(slots) != [2, 3, 4]
            or slots[3].get("version") != late):
        raise SystemExit(f"the run's lease objects are not the history told: rolled forward"
                         f" {taken}, late record {late}, holder {holder}, slots {slots}")
    return {"run": RUN, "holder": {k: holder[k] for k in ("generation", "host", "pid",
                                                          "heartbeat")},
            "generations": {"1": "released", "2": "taken over", "3": "held, gone"},
            "slots": {str(n): slot.get("version", "fence") for n, slot in slots.items()},
            "rolled": [late], "withdrawn": [late],
            # records in versions/ that are never versions: an index deletes them
            "late_records": [late]}


#: The fixture's legal hold (``--with-hold``): on this version, with this reason, placed
#: by a user on a machine no one has, at a fixed time after the launches.
HELD_SELECTOR = f"{RUN}@3"
HOLD_REASON = "fixture hold: audit 2023-11, keep until released"
HOLD_WHO = "fixture-user@fixture-hold.invalid"
HOLD_PROCESS = "pid 4505 make_format_fixture.py"


def _hold(store: chunkstore.Store) -> dict[str, str]:
    """Hold :data:`HELD_SELECTOR` (the store becomes version 11 first, as a hold does)."""
    version_id = store.resolve(HELD_SELECTOR).id
    upgrade_for_holds(store)
    store.objects.put(HOLDS, version_id, encode_hold(version_id, HOLD_REASON,
                                                     LEASE_TIME + 3600, who=HOLD_WHO,
                                                     process=HOLD_PROCESS))
    if {h.reason for h in store.holds().values()} != {HOLD_REASON}:
        raise SystemExit("the fixture's hold does not read back")
    return {version_id: HOLD_REASON}


def _format_versions(with_hold: bool) -> dict[str, int]:
    versions = {"store": STORE_FORMAT_VERSION, "record": RECORD_FORMAT_VERSION,
                "node": NODE_FORMAT_VERSION, "chunk": CHUNK_FORMAT_VERSION,
                "lease": LEASE_FORMAT, "lease_slot": SLOT_FORMAT,
                "lease_marker": MARKER_FORMAT, "read_lease": READ_LEASE_FORMAT}
    if with_hold:
        versions.update(store=HOLDS_STORE_FORMAT_VERSION, hold=HOLD_FORMAT)
    return versions


def build(root: Path, with_hold: bool = False) -> dict[str, Any]:
    """Create the fixture store at ``root`` (must not exist); return the expectations
    (``with_hold``: with a legal hold, store version 11)."""
    arrays, data = arrays_v1(), data_v1()
    versions = []
    with chunkstore.open(root, chunk_size=CHUNK_SIZE, compression="auto",
                         delta_depth=DELTA_DEPTH, node_size=NODE_SIZE, create=True) as store:
        # The fixture's tensors are small, so that it stays small: compress them as
        # larger ones are (else `auto` stores every one raw and no codec is pinned).
        store.raw_tensor_bytes = 0
        meta: dict[str, object] = {"code_rev": "0123abc", "dataset": ("toy", 2),
                                   "note": "format fixture"}
        versions.append(_write_version(store, 1, arrays, data, meta))
        arrays, data = version_2(arrays, data)
        versions.append(_write_version(store, 2, arrays, data, {"code_rev": "4567def"}))
        for step in range(3, 4 + DELTA_DEPTH):
            arrays = version_n(arrays, step)
            versions.append(_write_version(store, step, arrays, data, {"step": step}))
        store.tag(TAGGED_SELECTOR, TAG)
        packed, reusing = _packed_chunks(store)
        if packed == 0 or reusing == 0:
            raise SystemExit("the fixture needs packed chunks and a version that reuses an"
                             " older pack")
        inlined, referenced, continued = _tree_layout(store)
        if not inlined or not referenced or not continued:
            raise SystemExit(f"the fixture's tree nodes need inlined subtrees (saw {inlined}),"
                             f" subtrees of their own (saw {referenced}) and continuation"
                             f" nodes (saw {continued})")
        depths = _chain_depths(store)
        if depths != set(range(DELTA_DEPTH + 1)):
            raise SystemExit(f"fixture chains have depths {sorted(depths)}, not 0..{DELTA_DEPTH}")
        packed_deltas, packed_bases = _packed_deltas(store)
        if CHUNK_FORMAT_VERSION >= 5 and (not packed_deltas or not packed_bases):
            raise SystemExit(f"the fixture needs packed deltas ({packed_deltas}) on packed"
                             f" bases ({packed_bases}) (chunk format 5)")
        versions.extend(_repacked_versions(store))
        packed, _ = _packed_chunks(store)
        # A removed version (store version 2): its tombstone, and its chunks awaiting GC.
        removed = _write_version(store, 99, removed_version(), {}, {})["id"]
        kept = {d for v in store.versions() if v.id != removed
                for d in store.index.version_refs(v.id)}
        awaiting_objects = set(store.index.version_refs(removed)) - kept
        awaiting = len(awaiting_objects)
        awaiting_packs = sum(1 for d in awaiting_objects
                             if (record := store.index.chunk(d)) is not None
                             and record.codec_id == PACK.id)
        # Its reader was killed while it read (§11.6): an expired lease protects nothing.
        reader = _gone_reader(store, removed)
        store.delete(removed)
        result = store.verify()
        if not result.ok:
            raise SystemExit(f"the new fixture does not verify: {result.to_json()}")
        protocol = _lease_history(store, arrays, data)
        if expired_read_leases(store.objects) != [reader]:
            raise SystemExit(f"readers/{reader} is not an expired read lease")
        protocol["expired_read_leases"] = {reader: removed}
        # what only the expired reader's version reaches: a GC deletes it
        protocol["reached_by_expired_readers_only"] = sorted(CHUNKS.key(d)
                                                             for d in awaiting_objects)
        holds = _hold(store) if with_hold else {}
    # The index is a cache, rebuilt on open: it is not part of the format.
    shutil.rmtree(root / "index")
    codec_counts, plane_modes = _codec_census(root)
    member_codecs, member_modes = _member_census(root)
    missing = set(REQUIRED_CODECS.values()) - set(codec_counts) - member_codecs
    if missing or plane_modes | member_modes != {0, 1}:
        raise SystemExit(f"fixture lacks codecs {sorted(missing)} or shuffle plane modes"
                         f" (saw {sorted(plane_modes)}); adjust the arrays")
    return {
        "generator": "tools/make_format_fixture.py",
        "format_versions": _format_versions(with_hold),
        **({"holds": holds} if with_hold else {}),
        "chunk_size": CHUNK_SIZE,
        "codec_counts": codec_counts,
        "versions": versions,
        "tags": {TAG: TAGGED_SELECTOR},
        "removed": [removed],
        "awaiting_gc_chunks": awaiting,
        # of which packs (verify reads their members, not them: see packed_chunks)
        "awaiting_gc_packs": awaiting_packs,
        # verify reads each packed chunk on its own, and the pack holding it is one file
        "packed_chunks": packed,
        # packs GC wrote when repacking: no version lists them, so a rebuilt index counts
        # them unreferenced (GC's mark reaches them through the moved records)
        "repacked_into": sum(1 for key in _object_digests(root)
                             if key.startswith("chunks/") and _is_repack_target(root, key)),
        # the run's lease objects and the read leases (docs/format.md §11.5, §11.6)
        "protocol": protocol,
        "objects": _object_digests(root),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="folder for the fixture")
    parser.add_argument("--name", default=f"store-v{STORE_FORMAT_VERSION}",
                        help="fixture name (a new one for every format change)")
    parser.add_argument("--with-hold", action="store_true",
                        help="also hold a version (store version 11; store-v12 on)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing fixture (only when the format is unchanged)")
    args = parser.parse_args(argv)
    root = args.out / args.name
    expected_path = args.out / f"{args.name}.expected.json"
    if root.exists() or expected_path.exists():
        if not args.force:
            print(f"{root} exists; old fixtures pin old formats. Pass --force only if the"
                  " format is unchanged.", file=sys.stderr)
            return 1
        shutil.rmtree(root, ignore_errors=True)
    expected = build(root, with_hold=args.with_hold)
    expected_path.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    print(f"wrote {root} ({len(expected['objects'])} objects, {size} bytes,"
          f" chunks per codec {expected['codec_counts']}) and {expected_path}")
    if size > MAX_FIXTURE_BYTES:
        print(f"warning: the fixture is over {MAX_FIXTURE_BYTES} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
