"""Copying versions from one store into another: ``sync``.

A copy is verbatim: commit records, manifest nodes, chunk objects and packs keep
their bytes and so their keys, and a version keeps its id (the BLAKE3 of its
record).  Into the destination it is a save, under the destination's save-session
protocol (docs/format.md §11.1), so a GC there, from any index, never races it.
The order (docs/recovery.md says the same for users):

1. everything is checked before anything is written: the source opens (never
   created), every selector resolves there, the destination is another store with
   the same chunk size and at least the source's delta depth (created with the
   source's settings when it does not exist);
2. a session object is stored in the destination and its GC journal read
   (:func:`chunkstore.write.writer.open_store_session`), before the first decision
   to leave an object uncopied; the session lives until the last version is
   published;
3. versions go oldest first; one the destination's index lists is skipped, and so is
   one whose RUN@STEP the destination holds (the same tree: already there; another:
   a conflict, reported, nothing published for it: a store holds one version per step
   of a run).  For
   the others, the tree is walked in the source (:func:`~chunkstore.handle.tree.flatten`
   bounds and checks it), and only what it references is asked about in the
   destination, a subtree at a time (:mod:`chunkstore.maintenance.synccopy`): the chunk
   objects first (packs and delta bases included; for a pack the source repacked,
   its moved record and the pack it points to), then the nodes.  Every object is
   checked as it is read from the source, before the destination gets it
   (:func:`~chunkstore.maintenance.synccopy.checked_object`: a chunk decoded through
   its listed chain and hash-checked, a pack's content hashed, a node hashed), and an
   object the destination holds is replaced only by checked bytes, and only where it
   fails that check itself or is a delta the copied manifest cannot read.  A version
   with an object that fails (or is missing) is not published; it is reported with
   the object, and the next version is copied;
4. the version's signature object, where it has one, checked against the record
   (:func:`~chunkstore.handle.signatures.copy_signature`: a bad one fails the
   version, which is not published); one flush makes them durable; the commit
   record is created with put-if-absent, verbatim: the commit point.  A session
   whose heartbeat lapsed publishes nothing;
5. the destination's index counts the version in (its refcounts, the chunks written,
   where packed chunks lie), in the transaction that ends the version's index session;
6. tags that name a copied (or already present) version are created where the
   destination has no tag of that name; one naming another version is a conflict,
   reported and left alone;
7. with ``verify`` every copied version is read back in the destination,
   hash-checked, as ``chunkstore verify`` reads it.

A sync killed anywhere leaves whole versions only: before step 4 of a version what it
wrote is unreachable (orphans GC removes after the grace period).  Run again, it
skips the versions published and finds the objects that landed: put-if-absent keeps
them (they are read back and compared, not sent again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.errors import (
    ChunkStoreError,
    CorruptNodeError,
    CorruptRecordError,
    CorruptSignatureError,
    EncryptionError,
    FormatVersionError,
    IntegrityError,
    InvalidInputError,
    InvalidSettingError,
    MissingChunkError,
    NotAStoreError,
    SessionExpiredError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.format.records import (
    MEMBERS_STORE_FORMAT_VERSION,
    SALTED_STORE_FORMAT_VERSION,
    CommitRecord,
)
from chunkstore.handle.censusrecord import contribution
from chunkstore.handle.handle import StoreHandle
from chunkstore.handle.signatures import copy_signature
from chunkstore.handle.tree import flatten
from chunkstore.handle.versions import VersionInfo, entry_from_record
from chunkstore.index.lmdbindex import CHUNK, NODE
from chunkstore.maintenance.synccopy import Copied, Spans, VersionCopy, add_spans
from chunkstore.maintenance.verify import verify as verify_store
from chunkstore.objects.kinds import MOVED, SESSIONS, VERSIONS
from chunkstore.progress import NullProgress, Progress
from chunkstore.protocol import audit
from chunkstore.protocol.audit import versions_named
from chunkstore.protocol.holds import Hold, held_ids, read_hold
from chunkstore.protocol.published import write_marker
from chunkstore.protocol.tombstones import write_tombstone
from chunkstore.write.writer import open_store_session

if TYPE_CHECKING:
    from chunkstore.protocol.journal import Fence
    from chunkstore.protocol.sessions import StoreSession

#: Opens a store: ``chunkstore.open`` (the facade sits above this layer).
Opener = Callable[..., StoreHandle]


@dataclass
class TagConflict:
    """A tag the destination has under the same name, naming another version."""

    name: str
    src_version: str
    dst_version: str


@dataclass
class StepConflict:
    """A version the destination has at the same ``RUN@STEP`` with other content: the
    source's is not copied (a store holds one version per step of a run)."""

    run: str
    step: int
    src_version: str
    dst_version: str


@dataclass
class FailedVersion:
    """A version not copied because an object it needs failed its check in the source
    (or is missing there): ``kind`` is verify's word for it, ``digest`` the object."""

    version: str
    run: str
    step: int
    kind: str
    message: str
    digest: str | None = None


@dataclass
class SyncResult:
    """What a sync copied (or, in a dry run, would copy)."""

    src: str
    dst: str
    dry_run: bool = False
    created: bool = False  # the destination was created (would be, in a dry run)
    copied: list[str] = field(default_factory=list)  # version ids, oldest first
    skipped: list[str] = field(default_factory=list)  # already in the destination
    objects_copied: int = 0
    bytes_copied: int = 0
    #: objects the copied versions reference that the destination had (checked)
    objects_present: int = 0
    #: tree nodes the destination had with their whole subtree (nothing below asked)
    subtrees_present: int = 0
    tags_created: list[str] = field(default_factory=list)
    tags_present: list[str] = field(default_factory=list)
    conflicts: list[TagConflict] = field(default_factory=list)
    #: versions not copied: the destination has their RUN@STEP with other content
    step_conflicts: list[StepConflict] = field(default_factory=list)
    #: versions not copied: damaged or incomplete in the source
    failed: list[FailedVersion] = field(default_factory=list)
    verified: int = 0  # versions read back in the destination
    problems: list[str] = field(default_factory=list)  # what that read-back found
    #: copied versions under a legal hold in the source: a hold belongs to its store,
    #: so the copy is not held (docs/format.md §15)
    held_at_source: list[Hold] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every selected version is in the destination, whole as far as checked."""
        return not self.problems and not self.failed and not self.step_conflicts

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["conflicts"] = [c.__dict__ for c in self.conflicts]
        doc["step_conflicts"] = [c.__dict__ for c in self.step_conflicts]
        doc["failed"] = [f.__dict__ for f in self.failed]
        doc["held_at_source"] = [h.to_json() for h in self.held_at_source]
        doc["ok"] = self.ok
        return doc


def select(src: StoreHandle, selectors: Sequence[str]) -> list[VersionInfo]:
    """The versions ``selectors`` name in ``src`` (all when none), oldest first; a
    selector that names none raises before anything is copied."""
    if isinstance(selectors, str):
        selectors = [selectors]
    chosen = ({v.id: v for v in src.versions()} if not selectors
              else {info.id: info for info in (src.resolve(s) for s in selectors)})
    return sorted(chosen.values(), key=lambda v: (v.created, v.id))


def check_pair(src: StoreHandle, dst: StoreHandle) -> None:
    """Refuse a destination that is the source, or whose settings a copy cannot keep."""
    if same_location(src, dst):
        raise _itself(dst)
    if src.config.chunk_size != dst.config.chunk_size:
        raise InvalidSettingError(
            f"{dst.url} has chunk size {dst.config.chunk_size}, {src.url} has"
            f" {src.config.chunk_size}: a copy keeps the chunks as they are, so both must"
            " have one chunk size; sync into a new (or empty) location instead")
    # A smaller delta depth in the destination is no obstacle: the copied chains keep
    # their length (readers take chains of any listed length), and the destination's
    # own saves start a new chain wherever a listed one is at its depth or longer.
    check_same_keys(src, dst, "sync")


def check_same_keys(src: StoreHandle, dst: StoreHandle, operation: str) -> None:
    """Refuse two stores that name chunks or nodes apart (an encrypted and a plain store,
    two encrypted ones with other master keys, or of store versions that name nodes
    apart): objects copied by key would be another store's ids there (docs/format.md
    §13)."""
    if src.objects.chunk_ids != dst.objects.chunk_ids \
            or src.objects.node_ids != dst.objects.node_ids:
        plain = [h.url for h in (src, dst) if not h.objects.encrypted]
        why = (f"{' and '.join(plain)} {'is' if len(plain) == 1 else 'are'} not encrypted"
               if plain else "they are encrypted under different master keys"
               if src.objects.chunk_ids != dst.objects.chunk_ids else
               "one names its nodes by keyed ids (store version"
               f" {SALTED_STORE_FORMAT_VERSION} or later), the other by plain ones")
        raise EncryptionError(dst.url, f"{operation} between {src.url} and {dst.url} would"
                              f" copy chunks keyed for one store into the other ({why});"
                              " nothing was copied. Copy between stores of the same kind, or"
                              " restore from one and save into the other")
    if src.objects.sealed_members != dst.objects.sealed_members:
        members, packs = (src, dst) if src.objects.sealed_members else (dst, src)
        raise EncryptionError(dst.url, f"{operation} between {src.url} and {dst.url} would"
                              " copy packs between stores that lay them out apart:"
                              f" {members.url} seals each pack member on its own (store"
                              f" version {MEMBERS_STORE_FORMAT_VERSION}), {packs.url} seals"
                              " each pack whole (store version"
                              f" {packs.config.format_version}); nothing was copied. Restore"
                              " from one and save into the other")
    segments = [h.config.encryption.segment_size if h.config.encryption is not None else None
                for h in (src, dst)]
    if src.objects.sealed_members and segments[0] != segments[1]:
        # Members' stored bytes are copied as they are: each opens only in segments of
        # the size it was sealed in.
        raise EncryptionError(dst.url, f"{operation} between {src.url} and {dst.url} would"
                              " copy pack members sealed in segments of"
                              f" {segments[0]} bytes into a store that opens them in"
                              f" segments of {segments[1]}; nothing was copied. Restore"
                              " from one and save into the other")


def _itself(dst: StoreHandle) -> InvalidInputError:
    return InvalidInputError(f"{dst.url} is the source store itself; name another store to"
                             " copy into")


def same_location(src: StoreHandle, dst: StoreHandle) -> bool:
    """Whether both handles name one store.  Two folders are one store only when they are
    one directory (a byte copy, ``cp -a``, is another store with the same config); two
    remote locations with other URLs and the same config are told apart by
    :func:`_check_not_itself` once the destination holds the sync's session object."""
    here, there = src.objects.local_path(), dst.objects.local_path()
    if here is not None and there is not None:
        try:
            return os.path.samefile(here, there)
        except OSError:
            return os.path.realpath(here) == os.path.realpath(there)
    return src.url.rstrip("/") == dst.url.rstrip("/")


def _check_not_itself(src: StoreHandle, dst: StoreHandle, session: StoreSession) -> None:
    """A remote destination with the source's config may be the source under another
    URL (an alias, another endpoint): it is, when the source sees the session object
    just stored in the destination."""
    if src.config.identity() != dst.config.identity() \
            or (src.objects.local_path() is not None and dst.objects.local_path() is not None):
        return
    if src.objects.exists(SESSIONS, session.id):
        raise _itself(dst)


def sync(src: StoreHandle, dst: StoreHandle | None, selectors: Sequence[str] = (), *,
         dry_run: bool = False, verify: bool = False, progress: Progress | None = None,
         created: bool = False) -> SyncResult:
    """Copy the versions ``selectors`` name (all when none) that ``dst`` lacks; see the
    module docstring.  ``dst`` None: a dry run into a store that does not exist yet."""
    if dst is None and not dry_run:
        raise InvalidInputError("a sync needs a destination store")
    result = SyncResult(src.url, dst.url if dst is not None else "", dry_run, created)
    versions = select(src, selectors)
    if dst is not None:
        check_pair(src, dst)
    todo = [v for v in versions if dst is None or dst.index.version(v.id) is None]
    result.skipped = [v.id for v in versions if v not in todo]
    already = set(result.skipped)
    if dst is not None:
        todo = _without_step_conflicts(src, dst, todo, result)
    progress = progress or NullProgress()
    session: StoreSession | None = None
    fence: Fence | None = None
    if todo and not dry_run:
        assert dst is not None
        session, fence = open_store_session(dst, f"sync from {src.url}")
        try:
            _check_not_itself(src, dst, session)
        except BaseException:
            session.close()
            raise
    planned: set[tuple[bytes, Digest]] = set()  # a dry run's: see VersionCopy
    spans = _spans(src, todo)
    try:
        progress.start(len(todo), "sync")
        for info in todo:
            try:
                _copy_version(src, dst, info, session, fence, result, planned, spans)
            except (IntegrityError, FormatVersionError) as exc:
                # Nothing of it is published; the other versions still travel.
                result.failed.append(_failure(info, exc))
            else:
                result.copied.append(info.id)
            progress.advance()
    finally:
        progress.finish()
        if session is not None:
            session.close()
    if result.copied:  # one listing of the source's holds/, a read of each copied one's
        held = held_ids(src.objects)
        result.held_at_source = [hold for vid in result.copied if vid in held
                                 and (hold := read_hold(src.objects, vid)) is not None]
    there = set(result.copied) | already  # tags may name only what the destination has
    _sync_tags(src, dst, [v for v in versions if v.id in there], result)
    if verify and dst is not None and not dry_run:
        # The versions already there too: one damaged there is named (repair mends it).
        _verify(dst, [v.id for v in versions if v.id in there], result, progress)
    return result


def _without_step_conflicts(src: StoreHandle, dst: StoreHandle, todo: list[VersionInfo],
                            result: SyncResult) -> list[VersionInfo]:
    """``todo`` less the versions whose RUN@STEP the destination holds: the same tree
    there is the same checkpoint (counted as already there), another is a conflict."""
    kept = []
    for info in todo:
        there = [v for v in dst.versions(info.run) if v.step == info.step
                 and dst.objects.exists(VERSIONS, v.id)]  # one another process removed is not
        same = next((v for v in there if v.root == info.root), None)
        if same is not None:
            result.skipped.append(info.id)
        elif there:
            result.step_conflicts.append(StepConflict(info.run, info.step, info.id,
                                                      there[-1].id))
        else:
            kept.append(info)
    return kept


def _retract_if_broken(dst: StoreHandle, info: VersionInfo, record: CommitRecord) -> None:
    """The session lapsed between its last check and the commit record (the process
    paused past half the lease): a GC elsewhere may have taken it for dead and deleted
    what the version relies on.  Every object it needs is checked now; if one is gone
    the version is unpublished again (tombstone, then record, as a removal) and the
    sync fails for it, so nothing broken stays published."""
    try:
        found = verify_store(dst, info.id, read_data=False)
        broken = None if found.ok else found.problems[0].message
    except ChunkStoreError as exc:  # its tree itself is gone
        broken = str(exc)
    if broken is None:
        return
    write_tombstone(dst.objects, info.id, record.root, record.run, record.step)
    write_marker(dst.objects, info.id, removed=True)  # openers of dst count it out
    dst.objects.flush()
    dst.objects.delete(VERSIONS, info.id)
    raise SessionExpiredError(
        f"the sync into {dst.url} was paused past its session's lease at its commit, and a"
        f" GC there deleted what version {info.short_id} needs ({broken}); the version was"
        " unpublished again. Sync again")


def _failure(info: VersionInfo, exc: ChunkStoreError) -> FailedVersion:
    digest = getattr(exc, "digest", None) or getattr(exc, "version_id", None)
    kind = ("missing-chunk" if isinstance(exc, MissingChunkError)
            else "corrupt-node" if isinstance(exc, CorruptNodeError)
            else "corrupt-record" if isinstance(exc, CorruptRecordError)
            else "bad-signature" if isinstance(exc, CorruptSignatureError)
            else "format-version" if isinstance(exc, FormatVersionError) else "corrupt-chunk")
    return FailedVersion(info.id, info.run, info.step, kind, str(exc),
                         digest if isinstance(digest, str) else None)


def _spans(src: StoreHandle, versions: list[VersionInfo]) -> Spans:
    """What the versions to copy list in each pack, so that a pack holding leftovers of
    removed versions travels as those members only (a version whose tree cannot be
    read is left to its own copy, which names the damage)."""
    spans: Spans = {}
    for info in versions:
        try:
            flat = flatten(src.objects, info.root, src.node_cache)
        except ChunkStoreError:
            continue
        for leaf in flat.leaves.values():
            if isinstance(leaf, TensorEntry):
                add_spans(leaf, spans)
    return spans


def _copy_version(src: StoreHandle, dst: StoreHandle | None, info: VersionInfo,
                  session: StoreSession | None, fence: Fence | None,
                  result: SyncResult, planned: set[tuple[bytes, Digest]],
                  spans: Spans) -> None:
    """Copy one version's missing objects, then its commit record; count it in."""
    data = src.objects.get(VERSIONS, info.id)
    record = CommitRecord.decode(info.id, data)
    flat = flatten(src.objects, record.root, src.node_cache)  # bounded and checked first
    index_session = None
    if session is not None:
        assert dst is not None
        index_session = dst.index.open_session(f"sync {info.run}@{info.step}")
    try:
        copied = VersionCopy(src, dst, session=index_session, fence=fence,
                             planned=planned, spans=spans).run(record.root)
        _add(result, copied)
        if index_session is None:
            return
        assert dst is not None and session is not None
        copy_signature(src.objects, dst.objects, info.id, data)  # checked, before the record
        write_marker(dst.objects, info.id)  # openers of dst learn of it without a listing
        # The destination's audit event, durable with the copy (its own trail: the
        # source's events are not copied).
        audit.record(dst.objects, "sync", deferred=True, versions=versions_named([info]),
                     source=src.url)
        dst.objects.flush()  # every object durable before the commit point
        for pack in copied.moved:  # a GC may drop a moved record no version reaches yet
            if not dst.objects.exists(MOVED, pack):
                raise ChunkStoreError(f"the moved record of pack {pack.short()} vanished from"
                                      f" {dst.url} during the copy (a gc there?); sync again")
        if session.lapsed():
            raise SessionExpiredError(
                f"the sync into {dst.url} could not keep its session alive for half the"
                f" lease, so a GC there may have deleted objects it reuses; version"
                f" {info.short_id} is not published. Sync again")
        dst.objects.put_if_absent(VERSIONS, info.id, data)  # the commit point
        if session.lapsed():
            _retract_if_broken(dst, info, record)
    except BaseException:
        if index_session is not None and dst is not None:
            dst.index.close_session(index_session)
        raise
    # Published: the index counts it in and ends the version's index session.
    nodes = {d: copied.node_sizes.get(d, 0) for d in flat.tree_nodes | flat.data_nodes()}
    refs = flat.chunk_digests()
    dst.index.add_version(entry_from_record(info.id, record), refs, nodes, copied.new_chunks,
                          index_session, flat.pack_members(), census=contribution(flat.leaves))
    dst.saw_stored(CHUNK, refs)
    dst.saw_stored(NODE, nodes)


def _add(result: SyncResult, copied: Copied) -> None:
    result.objects_copied += copied.objects
    result.bytes_copied += copied.bytes
    result.objects_present += copied.present
    result.subtrees_present += copied.subtrees_present


def _sync_tags(src: StoreHandle, dst: StoreHandle | None, versions: Iterable[VersionInfo],
               result: SyncResult) -> None:
    """Create the source's tags of the chosen versions; report those in the way."""
    chosen = {v.id for v in versions}
    wanted = {name: vid for name, vid in sorted(src.tags().items()) if vid in chosen}
    if not wanted:
        return
    existing = dst.stored_tags() if dst is not None else {}
    for name, version_id in wanted.items():
        there = existing.get(name)
        if there == version_id:
            result.tags_present.append(name)
        elif there is not None:
            result.conflicts.append(TagConflict(name, version_id, there))
        else:
            if not result.dry_run:
                assert dst is not None
                dst.tag(version_id, name)
            result.tags_created.append(name)


def _verify(dst: StoreHandle, version_ids: list[str], result: SyncResult,
            progress: Progress) -> None:
    for version_id in version_ids:
        found = verify_store(dst, version_id, read_data=True, progress=progress)
        result.verified += 1
        result.problems.extend(f"{version_id[:12]}: {p.kind}: {p.message}"
                               for p in found.problems)


# --- stores by URL ---------------------------------------------------------------------------


def sync_locations(src: str | os.PathLike[str] | StoreHandle,
                   dst: str | os.PathLike[str] | StoreHandle, selectors: Sequence[str] = (),
                   *, opener: Opener, dry_run: bool = False, verify: bool = False,
                   src_options: dict[str, Any] | None = None,
                   dst_options: dict[str, Any] | None = None,
                   progress: Progress | None = None) -> SyncResult:
    """:func:`sync` between stores named by path or URL (or open ones), opened with
    ``opener``: the source must exist; the destination is created with the source's
    settings when it does not (not in a dry run), after every selector resolved."""
    if _normalised(src) == _normalised(dst):
        raise InvalidInputError(f"source and destination are both {_normalised(src)!r};"
                                " name another store to copy into")
    opened: list[StoreHandle] = []
    try:
        if isinstance(src, StoreHandle):
            source = src
        else:
            source = opener(src, create=False, storage_options=src_options)
            opened.append(source)
        select(source, selectors)  # a bad selector changes nothing, DST included
        created = False
        if isinstance(dst, StoreHandle):
            target: StoreHandle | None = dst
        else:
            target, created = _open_destination(source, dst, opener, dst_options, dry_run)
            if target is not None:
                opened.append(target)
        result = sync(source, target, selectors, dry_run=dry_run, verify=verify,
                      progress=progress, created=created)
        result.dst = result.dst or os.fspath(dst)  # type: ignore[arg-type]
        return result
    finally:
        for store in reversed(opened):
            store.close()


def _open_destination(src: StoreHandle, location: str | os.PathLike[str], opener: Opener,
                      options: dict[str, Any] | None, dry_run: bool
                      ) -> tuple[StoreHandle | None, bool]:
    """The destination store, and whether it was created (None: a dry run's)."""
    # An encrypted source's copy is created encrypted with its key material (its config
    # and key objects), and opens with the source's key (docs/format.md §13.4).
    key_of = {"key_of": src} if src.objects.encrypted else {}
    try:
        return opener(location, create=False, storage_options=options, **key_of), False
    except NotAStoreError:
        if not dry_run:
            # Created only where nothing is stored (open refuses a non-empty location).
            return opener(location, create=True, storage_options=options,
                          chunk_size=src.config.chunk_size, compression=src.config.compression,
                          delta_depth=src.config.delta_depth, **key_of), True
    path = os.fspath(location)
    if "://" not in path and os.path.isdir(path) and os.listdir(path):
        raise NotAStoreError(path, "the location is not empty and has no chunkstore.json")
    return None, True


def _normalised(location: str | os.PathLike[str] | StoreHandle) -> str:
    if isinstance(location, StoreHandle):
        location = location.objects.local_path() or location.url
    text = os.fspath(location)
    if not isinstance(text, str):
        return repr(text)
    return os.path.realpath(text) if "://" not in text else text.rstrip("/")


__all__ = ["FailedVersion", "StepConflict", "SyncResult", "TagConflict", "check_pair", "select",
           "sync", "sync_locations"]
