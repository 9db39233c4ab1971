"""``verify``: every chunk reachable from the chosen versions is present, decodes
and hashes right at the length the manifest implies; commit records, manifest
nodes and data nodes parse; every tensor entry is one a read can read; tags
parse; hold objects parse (a damaged one still holds); refcounts match.  The
refcounts are those of the store as it is now: a verify of the whole store first
counts in and out what was saved or removed through another index (as opening the
store does), so an index that only lags is never reported as damaged.

Findings are collected as :class:`Problem` objects instead of stopping at the
first one.  The versions' commit records and manifests are read in parallel
(:mod:`chunkstore.maintenance.verifyload`), the findings made in version order.

A large store can be read over several runs (``read_data_subset``, as restic's
``check --read-data-subset``): the structure check (every object each version
needs exists: a stat, no read) always covers everything; only the stored objects
in the subset (chunk objects and packs) are read, decoded and hash-checked.
``N/M`` takes the objects whose digest, as a number, is ``N - 1`` modulo ``M``:
the M runs ``1/M`` .. ``M/M`` read every object exactly once, and an object stays
in its slice as the store grows.  ``X%`` reads a random sample of that share.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from chunkstore.errors import (
    ChunkStoreError,
    CorruptTagError,
    InvalidInputError,
    SubsetError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.records import CommitRecord, Tag
from chunkstore.handle.signatures import (
    BAD_SIGNATURE,
    CORRUPT,
    SIGNED_BY_TRUSTED,
    SIGNED_BY_UNTRUSTED,
    SignatureCheck,
    check_signature,
)
from chunkstore.handle.tree import FlatTree
from chunkstore.maintenance.atfault import ChunkCheck, at, failed_read_problems
from chunkstore.maintenance.findings import (
    DamagedObject,
    Problem,
    VersionVerdict,
    summarize,
)
from chunkstore.maintenance.reconcile import line_up
from chunkstore.maintenance.verifyload import problem_from
from chunkstore.maintenance.verifytrust import (
    forget_damaged,
    load_untrusted,
    note_readable,
    split_refs,
    trusted_versions,
)
from chunkstore.objects.kinds import CHUNKS, HOLDS, MOVED, SIGNATURES, TAGS, VERSIONS
from chunkstore.progress import NullProgress, Progress
from chunkstore.protocol.holds import list_holds
from chunkstore.protocol.moved import list_moved
from chunkstore.read.chain import NO_CACHE
from chunkstore.read.members import locate_member, missing_chunk
from chunkstore.read.packs import pack_header_problem
from chunkstore.read.reader import read_chunk_into

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.index.lmdbindex import VerifiedVersion

__all__ = ["DataSubset", "Problem", "VerifyResult", "verify"]

log = logging.getLogger(__name__)


_SLICE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")


@dataclass(frozen=True)
class DataSubset:
    """The stored objects a verify reads: slice ``slice`` of ``slices``, or a random
    ``percent`` (drawn with ``seed``; None: a fresh draw each run)."""

    slice: int = 0
    slices: int = 0
    percent: float | None = None
    seed: int | None = None

    @classmethod
    def parse(cls, text: object, seed: int | None = None) -> DataSubset:
        """``"2/5"`` or ``"10%"``; anything else is a :class:`SubsetError`."""
        if not isinstance(text, str):
            raise SubsetError(text, "not text")
        if match := _SLICE.fullmatch(text):
            n, m = int(match[1]), int(match[2])
            if m < 1 or not 1 <= n <= m:
                raise SubsetError(text, f"slice {n} of {m} does not exist: N runs from 1 to M")
            return cls(n, m)
        if match := _PERCENT.fullmatch(text):
            percent = float(match[1])
            if not 0 < percent <= 100:
                raise SubsetError(text, "a percentage above 0 and at most 100")
            return cls(percent=percent, seed=seed)
        raise SubsetError(text, "not N/M nor X%")

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else f"{self.slice}/{self.slices}"

    def select(self, objects: Collection[Digest]) -> set[Digest]:
        """The objects of ``objects`` in this subset."""
        if self.percent is None:
            return {d for d in objects
                    if int.from_bytes(d.raw[:8], "big") % self.slices == self.slice - 1}
        count = round(len(objects) * self.percent / 100)
        count = max(count, 1) if objects else 0  # a sample reads something
        return set(random.Random(self.seed).sample(sorted(objects, key=lambda d: d.raw), count))


@dataclass
class VerifyResult:
    versions_checked: int = 0
    chunks_checked: int = 0
    #: raw bytes of the chunks read, decoded and hash-checked
    bytes_checked: int = 0
    #: chunks read in full (all of them, unless a subset or ``read_data=False``)
    chunks_read: int = 0
    #: stored objects (chunk objects and packs) the checked versions need
    objects_total: int = 0
    #: of those, the objects read in full
    objects_read: int = 0
    #: of ``versions_checked``, those a ``--quick`` run took as readable from an earlier
    #: verify's reading, or from the save that built them through this index (recorded
    #: in the index), and only checked present
    versions_trusted: int = 0
    #: the data subset read (``"1/5"``, ``"10%"``); None: all, or none with read_data=False
    subset: str | None = None
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    #: Damage that no read of a version meets (a pack's own header): the versions
    #: read back whole, so they are not ``problems``; worth a look all the same.
    warnings: list[Problem] = field(default_factory=list)
    #: every checked version once: damaged or not, and which of its entries
    versions: list[VersionVerdict] = field(default_factory=list)
    #: every damaged stored object once, with the versions and entries that need it
    objects: list[DamagedObject] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        labels = {v.id: v.label for v in self.versions}
        return {"ok": self.ok, "versions_checked": self.versions_checked,
                "chunks_checked": self.chunks_checked, "bytes_checked": self.bytes_checked,
                "chunks_read": self.chunks_read, "objects_total": self.objects_total,
                "objects_read": self.objects_read, "subset": self.subset,
                "versions_trusted": self.versions_trusted,
                "bytes_read": self.bytes_checked, "seconds": round(self.seconds, 3),
                "problems": [p.to_json() for p in self.problems],
                "warnings": [w.to_json() for w in self.warnings],
                "versions": [v.to_json() for v in self.versions],
                "objects": [o.to_json(labels) for o in self.objects]}


def _check_chunk(store: StoreHandle, check: ChunkCheck, read_data: bool,
                 listed: set[bytes]) -> tuple[int, Problem | None]:
    """Read the chunk exactly as a read of the version would (same checks, same code:
    a delta through its listed chain, so a missing or corrupt base is found here).
    Not reading it: a chunk every stored object of which (its own or its pack, and each
    base's) is in ``listed`` (a listing of the chunk objects) is present, as a check of
    each would find it; any other is checked as a read finds it (a pack's members where
    its moved record says)."""
    digest, length, chain, location, locations = check
    stored = digest if location is None else location.pack
    bases = zip(chain, locations or (None,) * len(chain), strict=True)
    if not read_data and stored.raw in listed \
            and all((base if at is None else at.pack).raw in listed for base, at in bases):
        return 0, None
    try:
        if read_data:
            read_chunk_into(store, digest, memoryview(bytearray(length)), chain, NO_CACHE,
                            check_links=True, location=location, locations=locations)
            return length, None
        if location is None:
            store.objects.stat(CHUNKS, stored)
        else:
            locate_member(store, digest, location)
        for base, at in zip(chain, locations or (None,) * len(chain), strict=True):
            if at is not None:
                locate_member(store, base, at)
            elif not store.objects.exists(CHUNKS, base):
                return 0, problem_from(missing_chunk(store, base), None)
        return 0, None
    except FileNotFoundError:
        return 0, problem_from(missing_chunk(store, stored), None)
    except ChunkStoreError as exc:
        return 0, problem_from(exc, None)


def _check_pack_headers(store: StoreHandle, packs: set[Digest], result: VerifyResult) -> None:
    """A pack's own header and length, which reads never use: a warning each."""
    for pack in sorted(packs):
        try:
            problem = pack_header_problem(store, pack)
        except FileNotFoundError:
            continue  # repacked (its members read where the moved record says) or missing
        if problem is not None:
            result.warnings.append(Problem("pack-header", problem, None, pack.hex))


def _check_tags(store: StoreHandle, result: VerifyResult) -> None:
    for name in store.objects.ids(TAGS):
        try:
            Tag.decode(name, store.objects.get(TAGS, name))
        except FileNotFoundError:
            continue  # removed meanwhile
        except CorruptTagError as exc:
            result.problems.append(replace(problem_from(exc, None), object_kind="tag",
                                           object_key=TAGS.key(name), object_state="corrupt"))


def _check_holds(store: StoreHandle, result: VerifyResult) -> None:
    """A hold object that cannot be read still holds its version (never read as released,
    docs/format.md §15): name it, and how to end it if it is not wanted."""
    for version_id, hold in list_holds(store.objects).items():
        if hold.damage is not None:
            result.problems.append(Problem(
                "corrupt-hold", f"the hold of version {version_id[:12]} cannot be read"
                f" ({hold.damage}); it still holds the version: no removal removes it until"
                f" `chunkstore release STORE {version_id}`", version_id,
                object_kind="hold", object_key=HOLDS.key(version_id), object_state="corrupt"))


def _check_moved(store: StoreHandle, result: VerifyResult) -> None:
    """A moved record that cannot be parsed stops every GC (it cannot know where that
    pack's members went), and a read through it fails: name it."""
    for pack, record in sorted(list_moved(store.objects).items()):
        if record is None:
            result.problems.append(Problem(
                "corrupt-moved", f"the moved record of pack {pack.short()} cannot be parsed:"
                " gc deletes nothing while it is there, and reads through it fail", None,
                pack.hex, object_kind="moved record", object_key=MOVED.key(pack),
                object_state="corrupt"))


def _check_refcounts(store: StoreHandle, refs: dict[str, set[bytes]], unreadable: set[str],
                     result: VerifyResult, trusted: Counter[bytes]) -> None:
    """Compare the index's refcounts with the manifests' references (``refs``: the raw
    digests of the chunk objects each version read names; ``trusted``: the references
    of versions an earlier verify found to name exactly the index's)."""
    indexed = store.index.version_ids()
    for vid in sorted(set(refs) - indexed):
        result.problems.append(Problem("index", "version is not in the index; run"
                                       " `chunkstore index rebuild`", vid))
    expected = Counter(trusted)
    for chunks in refs.values():
        expected.update(chunks)
    # A version whose manifests cannot be read is already reported; take the
    # index's word for its references rather than flag each as a refcount error
    # (rebuilding the index would drop them and expose the chunks to GC).
    for vid in sorted(indexed & unreadable):
        expected.update(d.raw for d in store.index.version_refs(vid))
    for digest, record in store.index.iter_chunks():
        if record.refcount != expected.get(digest.raw, 0):
            result.problems.append(Problem(
                "refcount", f"index counts {record.refcount} references, the manifests"
                f" {expected.get(digest.raw, 0)}; run `chunkstore index rebuild`", None,
                digest.hex))
        expected.pop(digest.raw, None)
    for raw in expected:
        result.problems.append(Problem("refcount", "referenced chunk has no index record;"
                                       " run `chunkstore index rebuild`", None, raw.hex()))


def _check_signatures(store: StoreHandle, verdicts: dict[str, VersionVerdict],
                      result: VerifyResult) -> None:
    """Each version's signature as the handle's trusted keys see it (only where some
    are): a bad one is a problem, as damage or tampering; a version damaged elsewhere
    is reported ``corrupt`` whatever its signature says (what was signed is not what is
    stored)."""
    def check(version_id: str) -> SignatureCheck | None:
        try:
            data = store.objects.get(VERSIONS, version_id)
            CommitRecord.decode(version_id, data)
        except (FileNotFoundError, ChunkStoreError):  # reported by the record's check
            return None
        return check_signature(store.objects, version_id, data, store.trust)

    for version_id, found in zip(verdicts, store.executor.map(check, list(verdicts)),
                                 strict=True):
        verdict = verdicts[version_id]
        verdict.signature = CORRUPT if found is None else found.status
        verdict.signed_by = None if found is None else found.key
        if found is not None and found.status == BAD_SIGNATURE:
            result.problems.append(at(verdict, Problem(
                "bad-signature", f"version {version_id[:12]}: {found.reason}"), None,
                ("signature", SIGNATURES.key(version_id), "corrupt")))


def _mark_corrupt_signatures(verdicts: dict[str, VersionVerdict]) -> None:
    for verdict in verdicts.values():
        if verdict.damaged and verdict.signature in (SIGNED_BY_TRUSTED, SIGNED_BY_UNTRUSTED):
            verdict.signature = CORRUPT


def _stored_object(check: ChunkCheck) -> Digest:
    """The stored object a chunk check reads: the chunk's own, or its pack."""
    return check[0] if check[3] is None else check[3].pack


def _subset(read_data: bool, read_data_subset: str | DataSubset | None) -> DataSubset | None:
    if read_data_subset is None or isinstance(read_data_subset, DataSubset):
        subset = read_data_subset
    else:
        subset = DataSubset.parse(read_data_subset)
    if subset is not None and not read_data:
        raise InvalidInputError("a data subset to read was given with read_data=False"
                                " (--quick), which reads no data: give one or the other")
    return subset


def _check_store_wide(store: StoreHandle, ids: list[str], trees: dict[str, FlatTree],
                      trusted: dict[str, VerifiedVersion], verdicts: dict[str, VersionVerdict],
                      result: VerifyResult) -> None:
    """What only a verify of the whole store checks: tags, holds, moved records and the
    refcounts; then the index remembers the versions found readable."""
    _check_tags(store, result)
    _check_holds(store, result)
    _check_moved(store, result)
    # each read version's references, computed once for both
    refs = {vid: {d.raw for d in flat.chunk_digests()} for vid, flat in trees.items()}
    _check_refcounts(store, refs, set(ids) - set(trees) - set(trusted), result,
                     Counter(d for v in trusted.values() for d in split_refs(v.chunk_refs)))
    note_readable(store, trees, refs, verdicts, result.problems)


def verify(store: StoreHandle, sel: str | None = None, *, read_data: bool = True,
           read_data_subset: str | DataSubset | None = None,
           progress: Progress | None = None) -> VerifyResult:
    """Check the chosen version (all when ``sel`` is None); tags and refcounts only for all.

    Every check a read of a version makes is made here, through the same
    functions, so a version verify passes reads back in full.  With
    ``read_data_subset`` (``"N/M"``, ``"X%"`` or a :class:`DataSubset`) only the
    stored objects in it are read; every other one is checked present.
    """
    progress = progress or NullProgress()
    started = time.monotonic()
    subset = _subset(read_data, read_data_subset)
    result = VerifyResult(subset=None if subset is None else str(subset))
    if sel is None:
        in_index = store.index.version_ids()  # before the listing
        ids = sorted(store.stored_version_ids())
        # The index brought in line with that listing first, as an open that lists
        # does: a record created or deleted where no marker said so (an older
        # release's save or removal, its tombstone gone too) is no index problem
        # (docs/format.md §17).
        line_up(store, in_index, set(ids))
    else:
        ids = [store.resolve(sel).id]
    # --quick over the whole store: every chunk object listed once (a LIST request per
    # 1,000 on an object store, not a HEAD each); a version an earlier verify read is
    # checked present by that listing alone
    quick = not read_data and sel is None
    listed = {d.raw for d in store.objects.ids(CHUNKS)} if quick else set()
    trusted = trusted_versions(store, ids, listed) if quick else {}
    reads: dict[ChunkCheck, list[str]] = {}
    trees, verdicts = load_untrusted(store, ids, trusted, result.problems, reads)
    result.versions_checked += len(verdicts)
    for vid, known in trusted.items():
        result.versions_checked += 1
        verdicts[vid] = VersionVerdict(vid, known.entry.run, known.entry.step, known.entries)
    result.versions_trusted = len(trusted)
    pending = list(reads)
    failed: list[tuple[ChunkCheck, Problem]] = []
    stored = {_stored_object(check) for check in pending}
    chosen = set() if not read_data else stored if subset is None else subset.select(stored)
    trusted_objects = {d for v in trusted.values() for d in split_refs(v.chunk_refs)}
    trusted_objects.difference_update(d.raw for d in stored)
    result.objects_total = len(stored) + len(trusted_objects)
    result.objects_read = len(chosen)
    checks = store.executor.map(
        lambda r: _check_chunk(store, r, _stored_object(r) in chosen, listed), pending)
    progress.start(len(pending), "verify: chunks")
    result.chunks_checked += len(trusted_objects)
    for check, (size, problem) in zip(pending, checks, strict=True):
        progress.advance()
        result.chunks_checked += 1
        result.chunks_read += _stored_object(check) in chosen
        result.bytes_checked += size
        if problem is not None:
            failed.append((check, problem))
    progress.finish()
    result.problems.extend(failed_read_problems(store, failed, reads, trees, verdicts))
    if store.trust:
        _check_signatures(store, verdicts, result)
    _check_pack_headers(store, {c[3].pack for c in pending if c[3] is not None} & chosen,
                        result)
    if sel is None:
        _check_store_wide(store, ids, trees, trusted, verdicts, result)
    verdicts = dict(sorted(verdicts.items(), key=lambda item: (
        item[1].run or "", item[1].step or 0, item[0])))  # RUN@STEP order
    result.objects = summarize(result.problems, result.warnings, verdicts)
    forget_damaged(store, verdicts)  # marked by summarize
    _mark_corrupt_signatures(verdicts)
    result.versions = list(verdicts.values())
    result.seconds = time.monotonic() - started
    return result
