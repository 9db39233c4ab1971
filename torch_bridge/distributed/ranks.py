"""The Checkpointer under torch.distributed: every rank's state, one version per save.

Each rank passes its own objects to ``Checkpointer.save``/``restore`` (SPMD, as
under torchrun).  A version holds every rank's states, one section per rank
(``_torch_bridge``: ``"world_size"``, ``"ranks"``; :mod:`torch_bridge.capture.layout`):

- a DTensor (sharded or replicated placements) is one entry of the global
  tensor; each distinct box is written once, by the lowest rank holding it;
- any other tensor is the rank's own (RNG states, a sampler's, a DDP
  module's weights).  The ranks compare BLAKE3 digests of their tensors
  first: one that is the same on several ranks (a replicated module) is
  written once, by the lowest of them, and those ranks' sections name one
  entry; one that differs is an entry per rank;
- plain data (skeletons, sampler positions, RNG tuples) stays in each rank's
  section, in chunkstore's plain-data encoding.  Nothing is ever pickled:
  the ranks exchange plain data too (:mod:`torch_bridge.distributed.collectives`).

The save protocol is DCP's commit (:mod:`torch_bridge.dcp.writer`) with the
Checkpointer's own planning; every step ends in a collective that carries
each rank's verdict, so a failure on one rank fails the save on every rank,
and no rank waits in a collective the others skip:

1. every rank captures its states, digests its own tensors and sends its
   plan (run, step, state keys, sections, boxes, digests); every rank checks
   that all ranks save the same run, step and keys (else RanksDisagreeError,
   naming the ranks, on every rank: nothing has been written) and assigns
   each tensor its entry name and writing rank, the same way on every rank;
2. rank 0 opens the version: its store session object is stored and the GC
   journal read before the entries it lists as seen (``gc_seen``) go to the
   ranks, exactly as DCP's ``prepare_global_plan``;
3. every rank stores the tensors assigned to it under a session of its own
   fenced by ``gc_seen`` (:func:`torch_bridge.distributed.sharded.stage_boxes`), makes
   them durable (file and directory fsync; a completed PUT) and only then
   sends their chunk lists.  Nothing is published: they are orphans;
4. rank 0, once every rank has reported success, claims every staged chunk
   (:meth:`chunkstore.VersionWriter.adopt`: the GC fence, the index claim, an
   existence check), adds the sections and commits; the outcome goes to
   every rank.  If any rank failed, rank 0 aborts and nothing is published.

Published only when every rank's data is durable: rank 0 commits in step 4,
which follows a collective in which every rank sent the result of step 3, and
a rank sends it only after its flush returned; a rank that fails or dies
before that fails the collective, so rank 0 aborts.  Why no GC deletes a
staged chunk before or after the commit is :mod:`torch_bridge.dcp.writer`'s argument
word for word (steps 1-3 there are steps 2-4 here).

Restore: rank 0 lists the run's candidate versions (newest first) and sends
the list, so every rank considers the same ones even while saves publish.  For
each candidate every rank reads its own section's tensors, hash-verified,
into its objects (nothing is applied yet) and the ranks exchange verdicts: if
the version is damaged for any rank, every rank moves on to the next
candidate; if all read it, every rank applies it.  So every rank restores the
same version: the newest that reads back intact on all of them.

Async saves run the protocol in a background thread on a process group of the
checkpoint's own (``group``: a gloo group the Checkpointer makes when it is
constructed, on every rank), never on the training's: there the exchanges could
interleave with the training's own collectives (a DDP all-reduce) in a different
order on different ranks and deadlock.  On its own group each rank runs one save
at a time, so every rank issues the checkpoint's collectives in the same order.
The training pauses for :func:`capture_copies` (the state copied into host memory)
and one small exchange on that group in which the ranks agree the copy succeeded
everywhere (a rank whose state is bad must not leave the others waiting in the
background).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from chunkstore import Store, VersionInfo, VersionReader, VersionWriter
from chunkstore.errors import IntegrityError, SelectorError, UntrustedVersionError
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest
from chunkstore.format.shards import RANKS_ENTRY, ShardRanks, StagedShard
from chunkstore.index.lmdbindex import NewChunk
from chunkstore.objects.signing import Trust
from torch_bridge.capture.dtensors import is_dtensor, local_box
from torch_bridge.capture.layout import (
    BRIDGE_ENTRY,
    DTENSOR,
    FORMAT,
    apply_states,
    capture_states,
    load_states,
    read_sections,
    warn_unrestored,
)
from torch_bridge.capture.state import CapturedState, EntryNames
from torch_bridge.capture.tensors import as_array, host_copy
from torch_bridge.distributed.collectives import all_gather_bytes, rank_and_world
from torch_bridge.distributed.sharded import Box, stage_boxes, staged_entry
from torch_bridge.errors import (
    RanksDisagreeError,
    RanksFailedError,
    RestoreFallbackWarning,
    nothing_restored,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

T = TypeVar("T")


@dataclass
class _Item:
    """One tensor of this rank: its state key and record number, its bytes, and its
    box of a global tensor (a DTensor) or the digest of its bytes (the rank's own)."""

    key: str
    index: int
    array: np.ndarray
    dtype: str | None
    offsets: tuple[int, ...] | None
    digest: str | None

    def plain(self) -> list[Any]:
        return [self.key, self.index, None if self.offsets is None else list(self.offsets),
                self.digest]


def _capture(states: dict[str, Any], copy: bool = False
             ) -> tuple[list[CapturedState], list[_Item]]:
    """Step 1's local part: take every state apart; each DTensor becomes its local box.
    ``copy``: every array is a copy of its own (an async save's, which training then
    changes) and its digest is left for :func:`_digested` (in the background)."""
    captured = capture_states(states)
    items = []
    for state in captured:
        for index, (record, value) in enumerate(zip(state.records, state.values, strict=True)):
            if is_dtensor(value):
                local, offsets, _ = local_box(value)
                record.kind = DTENSOR
                array, override = as_array(host_copy(local))
                items.append(_Item(state.key, index, np.array(array) if copy else array,
                                   override, offsets, None))
                continue
            array, override = ((value, None) if isinstance(value, np.ndarray)
                               else as_array(host_copy(value)))
            item = _Item(state.key, index, np.array(array) if copy else array, override,
                         None, None)
            items.append(item if copy else _digested(item))
        if copy:
            state.values = []  # the copies are what the background reads
    return captured, items


def _digested(item: _Item) -> _Item:
    """``item`` with the digest of its bytes (a rank's own tensor; a box has none)."""
    if item.offsets is not None or item.digest is not None:
        return item
    flat = np.ascontiguousarray(item.array).reshape(-1).view(np.uint8)
    item.digest = Digest.of(flat.data).hex
    return item


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of one rank goes: its entry in the version, and whether this
    rank writes it (the lowest rank holding the same box or the same bytes does)."""

    name: str
    writes: bool


def _record(plan: dict[str, Any], key: str, index: int) -> list[Any]:
    """[path, entry, kind, dtype, shape] of a rank's tensor."""
    record: list[Any] = plan["sections"][key]["tensors"][index]
    return record


def _check_global(plans: list[dict[str, Any]]) -> None:
    """A tensor sharded (a DTensor) on one rank has one dtype and global shape, and is
    sharded, on every rank that holds it."""
    seen: dict[bytes, list[Any]] = {}
    for rank, plan in enumerate(plans):
        for key, index, _, _ in plan["items"]:
            path, _, kind, dtype, shape = _record(plan, key, index)
            seen.setdefault(plaindata.encode([key, path]), [None] * len(plans))[rank] = [
                kind == DTENSOR, dtype, shape]
    for where, values in seen.items():
        held = [v for v in values if v is not None]
        if any(v[0] for v in held) and any(v != held[0] for v in held):
            raise RanksDisagreeError(f"sharding, dtype and shape of {plaindata.decode(where)}",
                                     values)


def _assign(plans: list[dict[str, Any]]) -> list[dict[tuple[str, int], _Slot]]:
    """Every rank's slots, computed from every rank's plan (the same on every rank).

    A DTensor is one entry named by its path; another tensor is one entry per
    distinct content (named by its path when every rank holds that content, with
    the lowest holder's rank added otherwise).  Each box (DTensor) or content is
    written by the lowest rank holding it.
    """
    _check_global(plans)
    holders: dict[bytes, set[int]] = {}
    keyed: list[list[tuple[bytes, bytes]]] = []
    for rank, plan in enumerate(plans):
        mine = []
        for key, index, offsets, digest in plan["items"]:
            path, _, kind, dtype, shape = _record(plan, key, index)
            ident = plaindata.encode([key, path] if kind == DTENSOR
                                     else [key, path, dtype, shape, digest])
            holders.setdefault(ident, set()).add(rank)
            mine.append((ident, plaindata.encode([ident.decode(), offsets])))
        keyed.append(mine)
    names = EntryNames({BRIDGE_ENTRY, RANKS_ENTRY})
    named: dict[bytes, str] = {}
    writers: dict[bytes, int] = {}
    slots: list[dict[tuple[str, int], _Slot]] = []
    for rank, plan in enumerate(plans):
        mine_slots = {}
        for (key, index, _, _), (ident, box) in zip(plan["items"], keyed[rank], strict=True):
            if ident not in named:
                path, _, kind, _, _ = _record(plan, key, index)
                everyone = kind == DTENSOR or len(holders[ident]) == len(plans)
                named[ident] = names.claim(key, tuple(path) if everyone
                                           else (*path, f"rank{rank}"))
            writer = writers.setdefault(box, rank)
            mine_slots[(key, index)] = _Slot(named[ident], writer == rank)
        slots.append(mine_slots)
    return slots


def _exchange(action: str, work: Callable[[], T], message: Callable[[T], dict[str, Any]],
              group: Any = None) -> tuple[T, list[dict[str, Any]]]:
    """Run ``work`` here, then send its ``message`` (or the error it raised) to every
    rank.  A failure anywhere raises on every rank after the exchange: this rank's
    own error here, RanksFailedError elsewhere; then RanksDisagreeError when the
    messages' tokens differ."""
    try:
        result = work()
        data = plaindata.encode(message(result))  # what cannot be sent fails before sending
    except Exception as exc:
        all_gather_bytes(plaindata.encode({"error": f"{type(exc).__name__}: {exc}"}), group)
        raise
    gathered = [plaindata.decode(d) for d in all_gather_bytes(data, group)]
    failures = {r: g["error"] for r, g in enumerate(gathered) if "error" in g}
    if failures:
        raise RanksFailedError(action, failures)
    tokens = [g.get("token", {}) for g in gathered]
    for field in sorted(tokens[0]):
        values = [t.get(field) for t in tokens]
        if any(v != values[0] for v in values):
            raise RanksDisagreeError(field.replace("_", " "), values)
    return result, gathered


# --- saving ---------------------------------------------------------------------------------

Prepared = tuple[list[CapturedState], list[_Item]]


def capture_copies(states: Callable[[], dict[str, Any]], group: Any) -> Prepared:
    """An async save's part in the training's pause: every tensor copied into host memory
    (hashing waits for the background), then one exchange on ``group`` so that a rank
    whose state fails raises on every rank (RanksFailedError elsewhere) instead of
    leaving the others waiting in the background.  A collective of ``group``."""
    prepared, _ = _exchange("an async save's copy", lambda: _capture(states(), copy=True),
                            lambda _: {}, group)
    return prepared


def save_ranks(store: Store, run: str, step: int, meta: dict[str, Any],
               states: Callable[[], dict[str, Any]] | None, *,
               prepared: Prepared | None = None, group: Any = None,
               before_commit: Callable[[], None] | None = None,
               sign_with: ec.EllipticCurvePrivateKey | None = None) -> VersionInfo:
    """Save every rank's ``states()`` (or the copies :func:`capture_copies` made) as one
    version of ``run`` at ``step`` (a collective of ``group``, None: the default group:
    every rank calls it); every rank returns the published version's info."""
    rank, world = rank_and_world()
    action = f"the save of {run}@{step}"

    def capture() -> Prepared:
        if prepared is not None:
            return prepared[0], [_digested(item) for item in prepared[1]]
        assert states is not None
        return _capture(states())

    (captured, items), plans = _exchange(action, capture, lambda c: {
        "token": {"run": run, "step": step, "state_keys": [s.key for s in c[0]]},
        "sections": {s.key: s.section() for s in c[0]},
        "items": [i.plain() for i in c[1]]}, group)
    slots = _assign(plans)
    version: list[VersionWriter] = []  # rank 0's, once opened

    def open_version() -> list[str]:
        if rank == 0:
            version.append(store.new_version(run, step, meta, replace=True,
                                             sign_with=sign_with))
            version[0].before_commit = before_commit
            return version[0].gc_entries_seen
        return []

    try:
        _, opened = _exchange(action, open_version, lambda seen: {"gc_seen": seen}, group)
        shapes = {(s.key, i): r.shape for s in captured for i, r in enumerate(s.records)}
        boxes = [(Box(slot.name, item.array, item.dtype, shapes[(item.key, item.index)],
                      item.offsets) if item.offsets is not None
                  else Box(slot.name, item.array, item.dtype))
                 for item in items if (slot := slots[rank][(item.key, item.index)]).writes]
        _, results = _exchange(action, lambda: stage_boxes(
            store, run, step, boxes, opened[0]["gc_seen"]), lambda staged: {
                "staged": [[box.name, s.to_plain()] for box, s in zip(boxes, staged,
                                                                     strict=True)]}, group)
        header = {"format": FORMAT, "step": step, "world_size": world,
                  "ranks": [_named_sections(plan, slots[r]) for r, plan in enumerate(plans)]}
        info, published = _exchange(action, lambda: _publish(version, results, header),
                                    lambda i: {"info": None if i is None else _info_plain(i)},
                                    group)
    finally:
        for writer in version:
            writer.abort()  # a no-op once committed; else nothing is published
    return info if info is not None else _info_from_plain(published[0]["info"])


def _named_sections(plan: dict[str, Any], slots: dict[tuple[str, int], _Slot]
                    ) -> dict[str, Any]:
    """One rank's sections as the version holds them: each record names its slot's entry."""
    sections = {}
    for key, section in plan["sections"].items():
        tensors = [[path, slots[(key, index)].name, kind, dtype, shape]
                   for index, (path, _, kind, dtype, shape) in enumerate(section["tensors"])]
        sections[key] = {**section, "tensors": tensors}
    return sections


def _publish(version: list[VersionWriter], results: list[dict[str, Any]],
             header: dict[str, Any]) -> VersionInfo | None:
    """Step 4, on rank 0: claim every rank's staged chunks, add the sections, commit."""
    if not version:
        return None
    staged: dict[str, list[StagedShard]] = {}
    writers: dict[str, list[int]] = {}  # the rank that wrote each shard, in shard order
    for rank, result in enumerate(results):
        for name, plain in result["staged"]:
            staged.setdefault(name, []).append(StagedShard.from_plain(plain))
            writers.setdefault(name, []).append(rank)
    written: dict[Digest, NewChunk] = {}
    entries = {name: staged_entry(name, shards, shards[0].dtype, written)
               for name, shards in staged.items()}
    version[0].adopt(entries, written.values())
    version[0].put_data(BRIDGE_ENTRY, header)
    if len(results) > 1:  # for show and report: which rank wrote what
        version[0].put_data(RANKS_ENTRY, ShardRanks(
            len(results), {name: tuple(ranks) for name, ranks in writers.items()}).to_plain())
    return version[0].commit()


def _info_plain(info: VersionInfo) -> dict[str, Any]:
    return {"id": info.id, "run": info.run, "step": info.step, "created": info.created,
            "parent": info.parent, "root": info.root.hex, "logical_bytes": info.logical_bytes,
            "new_bytes": info.new_bytes, "new_stored_bytes": info.new_stored_bytes,
            "meta": info.meta}


def _info_from_plain(value: dict[str, Any]) -> VersionInfo:
    return VersionInfo(value["id"], value["run"], value["step"], value["created"],
                       value["parent"], Digest.parse(value["root"]), value["logical_bytes"],
                       value["new_bytes"], value["new_stored_bytes"], value["meta"])


# --- restoring ------------------------------------------------------------------------------

def restore_ranks(store: Store, run: str, step: int | None, targets: dict[str, Any],
                  special: dict[str, Callable[[Any], None]], trust: Trust | None = None
                  ) -> int | None:
    """Restore every rank from the same version: the newest (or the one at ``step``)
    whose tensors read back intact on every rank (and, with ``trust``, that is signed by
    one of its keys).  A collective."""
    rank, world = rank_and_world()
    action = f"the restore of {run}" + ("" if step is None else f"@{step}")

    def candidates() -> list[str]:
        if rank != 0:
            return []
        versions = store.versions(run)
        if step is None:
            return [v.id for v in versions[::-1]]
        matches = [v.id for v in versions if v.step == step]
        if not matches:
            raise SelectorError(f"{run}@{step}", f"run {run!r} has no version at step"
                                f" {step}; steps: {[v.step for v in versions]}")
        return matches[-1:]

    _, listed = _exchange(action, candidates, lambda ids: {
        "token": {"run": run, "step": step, "state_keys": sorted(targets)},
        "candidates": ids})
    failures: list[str] = []
    for version_id in listed[0]["candidates"]:
        (info, trees, _, saved), verdicts = _exchange(
            action, functools.partial(_load, store, version_id, targets, rank, world, trust),
            lambda loaded: {"damaged": loaded[2]})
        damaged = {r: v["damaged"] for r, v in enumerate(verdicts) if v["damaged"]}
        if damaged:
            failures.append(f"{info.short_id} (step {info.step}): " + "; ".join(
                f"rank {r}: {text}" for r, text in sorted(damaged.items())))
            if step is not None:
                raise IntegrityError(f"{action}: version {failures[-1]}")
            continue
        apply_states(targets, trees, special)
        if rank == 0:  # every rank holds the same states: one warning
            warn_unrestored(info, saved, targets, stacklevel=3)
        if failures:
            warnings.warn(RestoreFallbackWarning.skipped(run, failures, info.step, " every rank"),
                          stacklevel=3)
        return info.step
    if failures:
        raise nothing_restored(run, failures, " on every rank")
    return None


def _load(store: Store, version_id: str, targets: dict[str, Any], rank: int, world: int,
          trust: Trust | None = None) -> tuple[VersionInfo, dict[str, Any], str | None, list[str]]:
    """Read this rank's section of a version into ``targets`` (nothing applied yet): the
    trees to apply, or why the version is damaged here, and the states it holds."""
    reader = _open_by_id(store, version_id)
    try:
        if trust is not None:  # require_signed: what is not signed by a trusted key is skipped
            check = store.signature(version_id, trust)
            if not check.trusted:
                raise UntrustedVersionError(version_id, check.status, check.reason)
        sections = read_sections(reader, rank, world)
        return reader.info, load_states(reader, targets, sections), None, sorted(sections)
    except IntegrityError as exc:
        return reader.info, {}, f"{type(exc).__name__}: {exc}", []
    finally:
        reader.close()  # its read lease ends with the read


def _open_by_id(store: Store, version_id: str) -> VersionReader:
    """Open a version rank 0 listed; an index of this rank's own (another machine) may
    not have counted it in yet."""
    try:
        return store.open_version(version_id)
    except SelectorError:
        store.reconcile()
        return store.open_version(version_id)
