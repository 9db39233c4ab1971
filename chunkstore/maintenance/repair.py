"""``repair``: rewrite what is missing or damaged in a store from another store's
checked bytes.

A store damaged by rot, a lost file or a truncated write still has the versions'
commit records, and another store (a mirror, a backup made by ``sync``) often holds
whole copies of the same objects under the same keys: sync copies verbatim.  For each
selected version (every version when none is named), in this order:

1. its commit record is read and checked; a damaged one is replaced by the other
   store's record of the same id, which hashes to the id (a missing record is a
   removed version and is left alone: repair never brings back what was removed);
   then its signature object: a missing or bad one is replaced by the other store's
   where that one holds for the record's bytes (docs/format.md §14);
2. its tree is walked (:func:`~chunkstore.handle.tree.flatten`); a node that is
   missing or fails its hash is replaced by the other store's node that passes it,
   and the walk starts again, until the tree is whole or a node cannot be had; then
   every data node is checked the same way;
3. every chunk object the version needs (its chunks, their listed delta bases, the
   packs they lie in; through the store's moved record where it repacked a pack) is
   read and checked as a read checks it
   (:func:`~chunkstore.maintenance.synccopy.checked_object`).  An object whose own
   check fails (not one whose base failed: the base is checked on its own) is
   replaced by the other store's object, which must pass the same check there first;
   where the other store holds the chunk as a delta against another base, a
   standalone encoding of its checked bytes is written instead (the one replacement
   docs/format.md §3.4 allows).  A delta checked before its base was repaired is
   checked again afterwards, until nothing more can be fixed;
4. each repaired object is written atomically (a temp file renamed over the damaged
   one locally, one PUT on an object store), so a repair killed at any point leaves
   every object either as it was or whole;
5. the selected versions are verified again, as ``chunkstore verify`` reads them,
   and what is still wrong is reported.

Only objects that fail their own check are ever replaced, and only by bytes that
passed it, so a repair never makes a store worse.  The objects a live version
reaches are never GC's to delete, so a GC running meanwhile does not race it; an
object written for a version removed meanwhile is an orphan GC removes later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore import codecs
from chunkstore.errors import (
    ChunkStoreError,
    CorruptChunkError,
    CorruptNodeError,
    CorruptRecordError,
    FormatVersionError,
    IntegrityError,
    InvalidInputError,
    MissingChunkError,
)
from chunkstore.format.chunkobj import ChunkHeader, parse_header
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.format.records import CommitRecord
from chunkstore.handle.signatures import has_signature, signature_bytes
from chunkstore.handle.tree import FlatTree, flatten
from chunkstore.maintenance.sync import check_same_keys, same_location, select
from chunkstore.maintenance.synccopy import (
    Member,
    Need,
    add_members,
    add_needs,
    check_listed,
    checked_object,
)
from chunkstore.maintenance.verify import Problem
from chunkstore.maintenance.verify import verify as verify_store
from chunkstore.objects.kinds import CHUNKS, MOVED, NODES, SIGNATURES, VERSIONS
from chunkstore.progress import NullProgress, Progress
from chunkstore.protocol import audit
from chunkstore.protocol.moved import MAX_HOPS, read_moved
from chunkstore.protocol.published import write_marker
from chunkstore.read.chain import decode_chain, header_chain

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

Opener = Callable[..., "StoreHandle"]

#: How many times a tree walk starts again after a node was replaced (a tree of that
#: many damaged nodes is replaced node by node; more, and the walk gives up on it).
MAX_NODE_FIXES = 10_000
#: The versions a repair's done event names at most (about 80 bytes each).
MAX_NAMED = 1000


@dataclass
class Fix:
    """One object found missing or damaged: ``kind`` is record, node, chunk, pack or
    moved; ``problem`` what was wrong; ``reason`` why it could not be fixed (None once
    fixed)."""

    kind: str
    digest: str
    problem: str
    versions: list[str] = field(default_factory=list)  # RUN@STEP of those that need it
    reason: str | None = None


@dataclass
class RepairResult:
    """What a repair found, fixed (or, in a dry run, would fix) and could not fix."""

    store: str
    source: str
    dry_run: bool = False
    versions_checked: int = 0
    fixed: list[Fix] = field(default_factory=list)
    unfixed: list[Fix] = field(default_factory=list)
    #: what ``verify`` of the selected versions still finds after the repair
    problems_after: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unfixed and not self.problems_after

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store, "source": self.source, "dry_run": self.dry_run,
                "ok": self.ok, "versions_checked": self.versions_checked,
                "fixed": [f.__dict__ for f in self.fixed],
                "unfixed": [f.__dict__ for f in self.unfixed],
                "problems_after": [p.to_json() for p in self.problems_after]}


class _Unfixable(Exception):
    """The other store has no checked bytes for an object."""


class Repair:
    """Repairs the versions of ``store`` from ``source`` (see the module docstring)."""

    def __init__(self, store: StoreHandle, source: StoreHandle, result: RepairResult) -> None:
        self.store, self.source, self.result = store, source, result
        #: per pack, the members the version being repaired lists in it
        self.members: dict[Digest, set[Member]] = {}
        self._fixes: dict[tuple[str, str], Fix] = {}
        self.audit_intent: str | None = None  # the id of the repair's audit intent event

    # --- bookkeeping --------------------------------------------------------------------

    def _found(self, kind: str, digest: str, problem: str, label: str) -> Fix:
        fix = self._fixes.get((kind, digest))
        if fix is None:
            fix = self._fixes[(kind, digest)] = Fix(kind, digest, problem)
        if label not in fix.versions:
            fix.versions.append(label)
        return fix

    def _write(self, fix: Fix, write: Callable[[], None]) -> None:
        if fix.reason is None and fix not in self.result.fixed:
            if not self.result.dry_run:
                if self.audit_intent is None:  # before the first write (docs/format.md §16)
                    self.audit_intent = audit.record(self.store.objects, "repair",
                                                     source=self.source.url)
                write()
            self.result.fixed.append(fix)

    def _put_record(self, version_id: str, data: bytes) -> None:
        """A commit record written again: its publication marker first, as a save's
        (an index that counted the version out counts it in again at its next open)."""
        write_marker(self.store.objects, version_id)
        self.store.objects.flush()
        self.store.objects.put(VERSIONS, version_id, data)

    def record_done(self) -> None:
        """After a repair that wrote something: what it rewrote (counts, and the first
        :data:`MAX_NAMED` versions whose record or signature it replaced: those change
        what a restore accepts; an event stays small however much was repaired)."""
        if self.audit_intent is None:
            return
        fixed = self.result.fixed
        kinds = [f.kind for f in fixed]
        named = sorted({f.digest for f in fixed if f.kind in ("record", "signature")})
        audit.record_done(
            self.store.objects, "repair", self.audit_intent, fixed=len(fixed),
            records=kinds.count("record"), signatures=kinds.count("signature"),
            nodes=kinds.count("node"),
            chunks=len(kinds) - sum(map(kinds.count, ("record", "signature", "node"))),
            versions=[{"id": version_id} for version_id in named[:MAX_NAMED]])

    def _unfixed(self, fix: Fix, reason: str) -> None:
        fix.reason = reason
        if fix not in self.result.unfixed:
            self.result.unfixed.append(fix)

    # --- one version ----------------------------------------------------------------------

    def version(self, version_id: str, label: str) -> None:
        record = self._record(version_id, label)
        if record is None:
            return
        self.signature(version_id, label)
        flat = self._tree(record.root, label)
        if flat is None:
            return
        for digest in sorted(flat.data_nodes()):
            self.node(digest, label)
        needs: dict[Digest, Need] = {}
        self.members = {}
        for leaf in flat.leaves.values():
            if isinstance(leaf, TensorEntry):
                add_needs(leaf, needs)
                add_members(leaf, self.members)
        self.chunks(needs, label)

    def _record(self, version_id: str, label: str) -> CommitRecord | None:
        try:
            return self.store.read_record(version_id)
        except FileNotFoundError:
            return None  # removed meanwhile: nothing to repair
        except (CorruptRecordError, FormatVersionError) as exc:
            fix = self._found("record", version_id, str(exc), label)
        try:
            data = self.source.objects.get(VERSIONS, version_id)
            record = CommitRecord.decode(version_id, data)
        except FileNotFoundError:
            self._unfixed(fix, f"{self.source.url} does not hold this version")
            return None
        except ChunkStoreError as exc:
            self._unfixed(fix, f"damaged in {self.source.url} too: {exc}")
            return None
        self._write(fix, lambda: self._put_record(version_id, data))
        return record

    def signature(self, version_id: str, label: str) -> None:
        """A signature object that is missing or bad where the other store holds one that
        holds for the same commit record is copied (checked); an unsigned version
        stays unsigned."""
        try:
            record = self.store.objects.get(VERSIONS, version_id)
        except (FileNotFoundError, ChunkStoreError):
            return  # removed meanwhile, or a record the dry run could not fix
        try:
            if has_signature(self.store.objects, version_id, record):
                return
            problem = "missing"
        except ChunkStoreError as exc:
            problem = str(exc)
        try:
            data = signature_bytes(self.source.objects, version_id, record)
        except ChunkStoreError as exc:
            data, problem = None, f"{problem}; damaged in {self.source.url} too: {exc}"
        if data is None:
            if problem != "missing":
                self._unfixed(self._found("signature", version_id, problem, label),
                              f"{self.source.url} holds no good signature of it")
            return
        fix = self._found("signature", version_id, problem, label)
        self._write(fix, lambda: self.store.objects.put(SIGNATURES, version_id, data))

    def _tree(self, root: Digest, label: str) -> FlatTree | None:
        for _ in range(MAX_NODE_FIXES):
            try:
                return flatten(self.store.objects, root, self.store.node_cache)
            except CorruptNodeError as exc:
                if not self.node(Digest.parse(exc.digest), label):
                    return None
                if self.result.dry_run:
                    return self._tree_from_source(root, label)
        return None

    def _tree_from_source(self, root: Digest, label: str) -> FlatTree | None:
        """A dry run, below a node it would write: the tree as the other store holds it
        (the same nodes, by their keys), each of its nodes checked here, so the dry run
        names what the real run, node by node, fixes."""
        try:
            flat = flatten(self.source.objects, root, self.source.node_cache)
        except ChunkStoreError:
            return None
        for digest in sorted(flat.tree_nodes, key=lambda d: d.raw):
            self.node(digest, label)
        return flat

    def node(self, digest: Digest, label: str) -> bool:
        """Check one node and replace it when it fails; whether it is whole now."""
        problem = "does not hash to its key"
        try:
            stored: bytes | None = self.store.objects.get(NODES, digest)
        except FileNotFoundError:
            stored = None
        except CorruptNodeError as exc:  # a sealed node that fails authentication
            stored, problem = b"", exc.reason
        if stored is not None and self.store.objects.node_ids.names(digest, stored):
            return True
        fix = self._found("node", digest.hex, "missing" if stored is None else problem,
                          label)
        try:
            data = self.source.objects.get(NODES, digest)
        except FileNotFoundError:
            self._unfixed(fix, f"{self.source.url} does not hold it")
            return False
        except CorruptNodeError:
            data = b""
        if not self.source.objects.node_ids.names(digest, data):
            self._unfixed(fix, f"damaged in {self.source.url} too")
            return False
        self._write(fix, lambda: self.store.objects.put(NODES, digest, data))
        return True

    # --- chunk objects --------------------------------------------------------------------

    def chunks(self, needs: dict[Digest, Need], label: str) -> None:
        """Check every object; fix those whose own check fails; check again those that
        failed on a base, until a round fixes nothing."""
        todo = dict(needs)
        while todo:
            failed_on_base: dict[Digest, Need] = {}
            fixed_any = False
            for digest, need in sorted(todo.items(), key=lambda item: item[0].raw):
                outcome = self._chunk(digest, need, label, todo)
                if outcome == "base":
                    failed_on_base[digest] = need
                fixed_any |= outcome == "fixed"
            if not fixed_any or self.result.dry_run:
                return  # what still fails on a base is verify's to report
            todo = failed_on_base

    def _chunk(self, digest: Digest, need: Need, label: str, todo: dict[Digest, Need],
               hops: int = 0) -> str:
        """Check one object: "ok", "fixed", "base" (a base failed), or "unfixed"."""
        try:
            checked_object(self.store, digest, self.store.objects.get(CHUNKS, digest), need,
                           check_links=True)
            return "ok"
        except FileNotFoundError:
            if need is None:
                return self._missing_pack(digest, label, todo, hops)
            problem = "missing"
        except (MissingChunkError, CorruptChunkError, FormatVersionError) as exc:
            if getattr(exc, "digest", digest.hex) != digest.hex:
                return "base"
            problem = str(exc)
        fix = self._found("pack" if need is None else "chunk", digest.hex, problem, label)
        try:
            data = self._source_bytes(digest, need)
        except _Unfixable as exc:
            self._unfixed(fix, str(exc))
            return "unfixed"
        self._write(fix, lambda: self.store.objects.put(CHUNKS, digest, data))
        return "fixed"

    def _missing_pack(self, pack: Digest, label: str, todo: dict[Digest, Need],
                      hops: int) -> str:
        """A pack the store no longer holds: reads follow its moved record there, so the
        pack it moved to is checked instead; without one, the pack comes from the other
        store (or its moved record and the pack that moved to)."""
        try:
            moved = read_moved(self.store.objects, pack)
        except CorruptChunkError:
            moved = None  # the pack itself, written back, is read before any record
        problem = "missing"
        if moved is not None and hops < MAX_HOPS:
            outcome = self._chunk(moved.to, None, label, todo, hops + 1)
            broken = self._unread_member(self.store, pack)
            if outcome not in ("ok", "fixed") or broken is None or self.result.dry_run:
                return outcome
            # The pack it moved to is whole, but the record does not lead to what the
            # version lists: the pack itself, written back, is read before any record.
            problem = f"repacked, and its moved record does not lead to its members ({broken})"
        fix = self._found("pack", pack.hex, problem, label)
        try:
            data = self._source_bytes(pack, None)
        except _Unfixable as exc:
            elsewhere = read_moved(self.source.objects, pack) if hops < MAX_HOPS else None
            if elsewhere is None:
                self._unfixed(fix, str(exc))
                return "unfixed"
            record = self.source.objects.get(MOVED, pack)
            fix.kind = "moved"
            self._write(fix, lambda: self.store.objects.put(MOVED, pack, record))
            self._chunk(elsewhere.to, None, label, todo, hops + 1)
            return "fixed"
        broken = self._unread_member(self.source, pack)
        if broken is not None:
            self._unfixed(fix, f"its members do not read in {self.source.url} either"
                          f" ({broken})")
            return "unfixed"
        self._write(fix, lambda: self.store.objects.put(CHUNKS, pack, data))
        return "fixed"

    def _unread_member(self, store: StoreHandle, pack: Digest) -> str | None:
        """Why a member the version lists in ``pack`` does not read in ``store`` (through
        its moved records), or None when each does."""
        try:
            check_listed(store, pack, self.members.get(pack, ()))
        except (IntegrityError, FormatVersionError) as exc:
            return str(exc)
        return None

    def _source_bytes(self, digest: Digest, need: Need) -> bytes:
        """The other store's object of ``digest``, checked there as the store's
        manifest lists it; a standalone encoding where the other store's is a delta
        against another base."""
        try:
            data = self.source.objects.get(CHUNKS, digest)
        except FileNotFoundError:
            raise _Unfixable(f"{self.source.url} does not hold it") from None
        try:
            return checked_object(self.source, digest, data, need)
        except ChunkStoreError as exc:
            if need is None:
                raise _Unfixable(f"damaged in {self.source.url} too: {exc}") from None
            standalone = self._standalone(digest, data)
            if standalone is None:
                raise _Unfixable(f"damaged in {self.source.url} too: {exc}") from None
            return standalone

    def _standalone(self, digest: Digest, data: bytes) -> bytes | None:
        """A raw object of the chunk, decoded through the chain the other store's own
        headers name; None when that fails too."""
        chain = header_chain(self.source, digest, 64)
        if chain is None:
            return None
        try:
            raw = decode_chain(self.source, digest, data, chain)
            header = parse_header(digest, data)
        except ChunkStoreError:
            return None
        return ChunkHeader(codecs.RAW.id, header.element_size, len(raw), len(raw)).pack() \
            + bytes(raw)


def repair_objects(store: StoreHandle, source: StoreHandle, needs: dict[Digest, Need],
                   label: str) -> RepairResult:
    """Check the chunk objects ``needs`` names in ``store`` (what a read of each needs:
    its listed chain, or None for a pack) and replace those that fail from ``source``,
    as :func:`repair` does for a whole version; ``label`` names the version(s) that
    need them.  No verify afterwards: the caller knows what it asked about."""
    result = RepairResult(store.url, source.url)
    repairer = Repair(store, source, result)
    repairer.chunks(needs, label)
    repairer.record_done()
    return result


def repair_nodes(store: StoreHandle, source: StoreHandle, nodes: Sequence[Digest],
                 label: str) -> RepairResult:
    """:func:`repair_objects` for manifest nodes."""
    result = RepairResult(store.url, source.url)
    repairer = Repair(store, source, result)
    for digest in nodes:
        repairer.node(digest, label)
    repairer.record_done()
    return result


def repair(store: StoreHandle, source: StoreHandle, selectors: Sequence[str] = (), *,
           dry_run: bool = False, progress: Progress | None = None) -> RepairResult:
    """Rewrite what is missing or damaged in ``store``'s selected versions (every version
    when none is named) from ``source``'s checked bytes; see the module docstring."""
    if same_location(store, source):
        raise InvalidInputError(f"{source.url} is the store being repaired; name another"
                                " store that holds whole copies of its versions")
    check_same_keys(source, store, "repair")
    result = RepairResult(store.url, source.url, dry_run)
    versions = select(store, selectors)
    progress = progress or NullProgress()
    repairer = Repair(store, source, result)
    store.base_cache.clear()  # bases decoded before the damage are not the store's bytes
    progress.start(len(versions), "repair")
    try:
        for info in versions:
            repairer.version(info.id, f"{info.run}@{info.step}")
            result.versions_checked += 1
            progress.advance()
    finally:
        progress.finish()
    repairer.record_done()
    if not dry_run and result.fixed:
        store.base_cache.clear()
    for info in versions if not dry_run else ():
        result.problems_after.extend(verify_store(store, info.id, read_data=True).problems)
    return result


def repair_locations(store: str | StoreHandle, source: str | StoreHandle,
                     selectors: Sequence[str] = (), *, opener: Opener, dry_run: bool = False,
                     store_options: dict[str, Any] | None = None,
                     source_options: dict[str, Any] | None = None,
                     progress: Progress | None = None) -> RepairResult:
    """:func:`repair` between stores named by path or URL (or open ones), opened with
    ``opener``; both must exist."""
    opened: list[StoreHandle] = []
    try:
        handles = []
        for location, options in ((store, store_options), (source, source_options)):
            if isinstance(location, str):
                opened.append(opener(location, create=False, storage_options=options))
                handles.append(opened[-1])
            else:
                handles.append(location)
        return repair(handles[0], handles[1], selectors, dry_run=dry_run, progress=progress)
    finally:
        for handle in reversed(opened):
            handle.close()


__all__ = ["Fix", "RepairResult", "repair", "repair_locations", "repair_nodes",
           "repair_objects"]
