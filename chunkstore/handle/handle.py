"""The store handle: an open store's objects, index, config and caches, its versions
and selectors, tags and removal.

What reading, writing, the protocol and the operations work with.  It sits below
them: it imports nothing that reads or writes a version (the manifest tree walk it
needs to name an unreadable version is :mod:`chunkstore.handle.tree`).  The facade
on top, :class:`chunkstore.store.Store`, adds what needs the layers above (new and
open versions, gc, verify, report, rebuild) and is what :func:`chunkstore.open`
returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from chunkstore.backends import Backend
from chunkstore.codecs.policy import RAW_TENSOR_BYTES
from chunkstore.errors import (
    AmbiguousSelectorError,
    ChunkStoreError,
    CorruptConfigError,
    CorruptTagError,
    InvalidInputError,
    InvalidNameError,
    NotAStoreError,
    SelectorError,
    VersionRemovedError,
)
from chunkstore.format import plaindata
from chunkstore.format.digest import Digest, is_hex_digest
from chunkstore.format.names import check_label
from chunkstore.format.records import (
    MIN_PREFIX,
    STORE_FORMAT_VERSION,
    CommitRecord,
    StoreConfig,
    Tag,
    looks_like_a_version_id,
)
from chunkstore.handle.basecopies import BASE_COPY_BYTES, BaseCopies
from chunkstore.handle.caches import BaseCache
from chunkstore.handle.holding import place_hold, release_version
from chunkstore.handle.removal import remove_versions
from chunkstore.handle.signatures import BAD_SIGNATURE, SignatureCheck, check_signature
from chunkstore.handle.tree import NodeCache, flatten
from chunkstore.handle.versions import VersionInfo, entry_from_record
from chunkstore.index.lmdbindex import Index
from chunkstore.index.versiontables import VersionEntry
from chunkstore.objects.kinds import TAGS, VERSIONS
from chunkstore.objects.objectstore import ObjectStore
from chunkstore.objects.signing import Trust
from chunkstore.protocol import audit
from chunkstore.protocol.audit import versions_named
from chunkstore.protocol.holds import Hold, list_holds
from chunkstore.protocol.moved import MovedRecord

if TYPE_CHECKING:
    from chunkstore.format.manifest import TensorEntry
    from chunkstore.write.delta import Learnt, Listing

    #: A run's last saved version on this handle: its id, tensor entries, chunk chains
    #: and what the chunk positions learnt of their deltas lately
    #: (chunkstore.write.delta.Skips).
    ParentCacheEntry = tuple[str, dict[str, TensorEntry], dict[Digest, Listing], Learnt]

#: Saves seal a pack of small chunks once it holds this many bytes (a handle's
#: ``pack_size``).  Measured on this project's 2-core machine: writing a pack costs its
#: bytes plus one object; above a few MiB the per-object cost is noise, and a pack stays
#: small next to a 4 MiB chunk.
PACK_TARGET_BYTES = 8 * 1024 * 1024
#: The largest target a store handle accepts.  A pack holds one member more than its
#: target at most, and never more than a location may point into (``MAX_PACK_BYTES``):
#: a member that would cross it starts a new pack.
MAX_PACK_TARGET = 64 * 1024 * 1024
#: Saves inline a subtree of the names into its parent manifest node while the parent
#: stays this small (docs/format.md §5.1), so a model's version is a few nodes, not one
#: per branch of its names; a change rewrites at most about this much per level above it.
#: Measured on the benchmark workloads (python -m benchmarks.suite): at 64 KiB a save of
#: a GPT's scattered updates rewrote 8-12 nodes (LoRA: 10 nodes next to one pack); at
#: 512 KiB the trees of all six are one or two nodes, and rewriting half a MiB of node
#: bytes is small next to the data of a save.
NODE_TARGET_BYTES = 512 * 1024
#: The largest inlining target a store handle accepts (0: a node per branch, as before).
MAX_NODE_TARGET = 16 * 1024 * 1024


def _removable_key_name(name: object) -> bool:
    """A name writers refuse that still names one plain key (to remove a damaged tag)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and name.isprintable() and "\\" not in name)


def _pinned_version(data: bytes) -> str | None:
    """The version id a damaged tag object still names, if any."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) and is_hex_digest(version) else None


def default_threads(local: bool = False) -> int:
    """Worker threads of a store: more than the cores, because a chunk write spends
    much of its time waiting in fsync or on a request (which, like BLAKE3 and zstd,
    releases the GIL); at least 8 for an object store (requests in flight), at least 4
    for a local one.  On this project's 2-core machine 4 local threads instead of 8
    took a dense sync save from 345-381 ms to 292-337 (kernel time 256-301 -> 116-174
    ms: fewer threads writing and switching) and a first 1 GiB save from 1.95-2.59 s
    to 1.61-1.99; sparse, frozen-base and LoRA saves showed no difference (alternating
    /tmp A/B runs on the suite's recorded states)."""
    return min(32, max(4 if local else 8, 2 * (os.cpu_count() or 2)))


#: What :attr:`Store.pack_delta_chunks` is for a new handle.
PACK_DELTA_CHUNKS = True
#: Objects a handle remembers having found stored (about 200 bytes each, so some 50 MB at
#: most; with 8 MiB packs, 2 TiB of them).
SEEN_STORED_MAX = 1 << 18


def selector_list(selectors: Iterable[str]) -> list[str]:
    """``selectors`` as a list; one string is refused (:class:`InvalidInputError`): its
    letters would be taken for selectors, one-letter tags naming versions to remove."""
    if isinstance(selectors, str):
        raise InvalidInputError(f"delete_many takes a list of selectors, not the string"
                                f" {selectors!r}: call delete({selectors!r}) or"
                                f" delete_many([{selectors!r}])")
    return list(selectors)


class StoreHandle:
    """An open store, below the operations.  Use :func:`chunkstore.open` to get one
    (a :class:`chunkstore.store.Store`)."""

    def __init__(self, url: str, objects: ObjectStore, config: StoreConfig, index: Index,
                 compression: str, threads: int | None) -> None:
        self.url = url
        #: every stored object goes through here (chunkstore.objects)
        self.objects = objects
        self.config = config
        self.index = index
        self._closed = False
        self.compression = compression
        #: the longest delta chain this handle's saves build: the store's ``delta_depth``
        #: or, where :func:`chunkstore.open` was given a smaller one, that (a writer may
        #: build shorter chains than the store allows, never longer)
        self.delta_depth = config.delta_depth
        self.threads = threads or default_threads(objects.local_path() is not None)
        self.max_inflight = self.threads * 2
        #: pool jobs that hash a batch of small tensors with the caller: a thread per
        #: core in all (hashing is CPU work; the pool is sized for fsync waits)
        self.hashing_helpers = max(0, min(self.threads, os.cpu_count() or 1) - 1)
        self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix="chunkstore")
        #: read jobs of one read call that run at once: from a local store a thread per
        #: core, as decoding and hashing are CPU work and a read from the page cache
        #: waits on nothing (on 2 cores a restore took 0.90-1.00x the time of a job per
        #: pool thread: python -m benchmarks.bench_read_jobs); from other stores every
        #: thread, each read waiting on a request
        self.read_jobs = self.threads if objects.local_path() is None \
            else max(1, min(self.threads, os.cpu_count() or 1))
        self.node_cache = NodeCache()
        #: moved records read so far (immutable once written: docs/format.md §3.6)
        self.moved_cache: dict[Digest, MovedRecord] = {}
        # Decoded delta bases, shared by reads and saves: a few chunks per thread.
        self.base_cache = BaseCache(2 * self.threads * config.chunk_size)
        #: copies of the chunks a delta save wrote, the run's next bases
        #: (chunkstore.handle.basecopies)
        self.base_copies = BaseCopies(BASE_COPY_BYTES)
        # The tensor entries of the last version this handle saved, per run (the
        # next save's parent: see chunkstore.write.delta.ParentChunks).
        self.parent_cache: dict[str, ParentCacheEntry] = {}
        #: saves seal a pack of small chunks once it holds this many bytes
        self.pack_size = PACK_TARGET_BYTES
        #: in a store with delta chains, saves pack the chunks of larger tensors too
        #: (deltas included); False writes each as an object of its own, as releases
        #: before chunk format 5 did
        self.pack_delta_chunks = PACK_DELTA_CHUNKS
        #: with compression ``auto``, saves store a tensor of one chunk smaller than this
        #: raw, as compressing it costs more time than writing the bytes it saves (0:
        #: compress every tensor, as releases before this rule did; codecs.policy)
        self.raw_tensor_bytes = RAW_TENSOR_BYTES
        #: saves inline a subtree into its parent tree node while it stays this small
        self.node_size = NODE_TARGET_BYTES
        # Objects a save of this handle found stored where a check costs a request
        # (chunkstore.write.reuse: each is checked once per handle, before its first reuse).
        self._seen_stored: dict[tuple[bytes, Digest], None] = {}  # in the order seen
        self._run_locks: dict[str, threading.Lock] = {}  # see run_lock
        self._tables_lock = threading.Lock()  # guards the two tables above
        #: the keys whose signatures this handle trusts (``chunkstore.open(trust=...)``)
        self.trust = Trust()

    @property
    def backend(self) -> Backend:
        """The backend under the object layer (replaceable by a wrapper of itself)."""
        return self.objects.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.objects.backend = backend

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def run_lock(self, run: str) -> threading.Lock:
        """The lock a commit of ``run`` holds on this handle (see VersionWriter.commit)."""
        with self._tables_lock:
            return self._run_locks.setdefault(run, threading.Lock())

    def seen_stored(self, kind: bytes, digest: Digest) -> bool:
        """Whether a save of this handle found the object stored (see :meth:`saw_stored`)."""
        return (kind, digest) in self._seen_stored

    def saw_stored(self, kind: bytes, digests: Iterable[Digest]) -> None:
        """Remember objects a save found stored, or stored itself and published, on a
        store where a check costs a request (on a local store saves stat every reused
        object, and nothing is remembered).  Bounded: past :data:`SEEN_STORED_MAX`
        objects the oldest quarter is forgotten (and checked again when reused)."""
        if self.objects.local_path() is not None:
            return
        with self._tables_lock:
            for digest in digests:
                if len(self._seen_stored) >= SEEN_STORED_MAX:  # forget the oldest quarter
                    for old in list(itertools.islice(self._seen_stored, SEEN_STORED_MAX // 4)):
                        del self._seen_stored[old]
                self._seen_stored[(kind, digest)] = None

    def close(self) -> None:
        if self._closed:  # the index counts its openers: close each once
            return
        self._closed = True
        self.executor.shutdown(wait=True)
        self.base_copies.clear()
        self.base_cache.clear()
        self.index.close()
        self.objects.close()

    def __repr__(self) -> str:
        return f"<chunkstore.Store {self.url}>"

    # --- the format --------------------------------------------------------------------------

    def upgrade_format(self) -> None:
        """Make an older store the current version (with no deltas: ``delta_depth``
        0) before this release writes the first object of docs/format.md §11 into
        it (a session, journal entry or tombstone).

        Releases that know only version 1 do not honour those objects (their GC
        would not wait for saves on other machines), so from then on they
        refuse the store.  The config is replaced atomically; concurrent
        upgraders write the same bytes.
        """
        if self.config.format_version >= STORE_FORMAT_VERSION:
            return
        # Another process may have upgraded it since this handle read the config (to 11,
        # before a first hold): written back as 9, a release that does not honour holds
        # would open it again.  The stored config decides (a newer store's: refused).
        try:
            stored = StoreConfig.decode(self.url, self.objects.get_config())
        except (FileNotFoundError, CorruptConfigError, NotAStoreError):
            stored = self.config  # missing or damaged: this handle's is written
        if stored.format_version >= STORE_FORMAT_VERSION:
            self.config = dataclasses.replace(self.config,
                                              format_version=stored.format_version)
            return
        self.objects.replace_config(self.config.encode())
        self.config = dataclasses.replace(self.config, format_version=STORE_FORMAT_VERSION)

    # --- listing and selectors -------------------------------------------------------------

    def info_from_entry(self, entry: VersionEntry) -> VersionInfo:
        return VersionInfo(entry.id, entry.run, entry.step, entry.created, entry.parent,
                           Digest.parse(entry.root), entry.logical_bytes, entry.new_bytes,
                           entry.new_stored_bytes, plaindata.from_tree(entry.meta))

    def versions(self, run: str | None = None) -> list[VersionInfo]:
        """Published versions, oldest first: by commit time, or within one ``run`` by
        step (clocks differ between machines; a run's steps do not).  A run's are
        found by a seek in the index and cost what the run holds, not the store."""
        entries = self.index.versions() if run is None else self.index.run_versions(run)
        return [self.info_from_entry(e) for e in entries]

    def newest(self, run: str | None = None, count: int | None = None) -> list[VersionInfo]:
        """The ``count`` newest of :meth:`versions` (all with None), newest first, found by
        a seek: only those are decoded."""
        return [self.info_from_entry(e) for e in self.index.newest_versions(run, count)]

    def version_count(self, run: str | None = None) -> int:
        """How many versions :meth:`versions` lists, without decoding one."""
        return self.index.version_count(run)

    def lists_version(self, version_id: str) -> bool:
        """Whether the index lists the version of this full id (a keyed lookup)."""
        return self.index.version(version_id) is not None

    def latest(self, run: str | None = None) -> VersionInfo | None:
        """The last of :meth:`versions`, found by a seek (what a save asks, each time)."""
        entry = self.index.latest_version(run)
        return None if entry is None else self.info_from_entry(entry)

    def at_step(self, run: str, step: int) -> list[VersionInfo]:
        """The versions of ``RUN@STEP`` the index holds (one, unless another machine
        saved the step too), oldest first, found by a seek."""
        return [self.info_from_entry(e) for e in self.index.run_versions(run, step)]

    def runs(self) -> list[str]:
        return self.index.runs()

    def resolve(self, selector: str) -> VersionInfo:
        """Resolve a full id, unique id prefix, RUN@STEP, RUN@latest, latest or tag.

        A well-formed selector that names nothing the index holds has the index list
        every commit record and looks again before the error is raised
        (:meth:`list_after_miss`): a record created without a publication marker (an
        older release's, a crafted or copied one) is seen at once when it is named
        (docs/format.md §17)."""
        try:
            return self._resolve(selector)
        except SelectorError as exc:
            if not exc.missed or not self.list_after_miss():
                raise
        return self._resolve(selector)

    def list_after_miss(self) -> bool:
        """A selector named nothing the index holds: list every commit record into the
        index (:class:`~chunkstore.store.Store` does), and say whether it did."""
        return False

    def _resolve(self, selector: str) -> VersionInfo:
        if not isinstance(selector, str) or not selector:
            raise SelectorError(str(selector), "empty selector")
        if selector == "latest":
            found = self.latest()
            if found is None:
                raise SelectorError(selector, "the store has no versions", missed=True)
            return found
        if "@" in selector:
            return self._resolve_run_step(selector)
        tags = self.index.tags()
        if selector in tags and not looks_like_a_version_id(selector):
            return self._by_id(tags[selector], selector)
        return self._resolve_prefix(selector)

    def _by_id(self, version_id: str, selector: str) -> VersionInfo:
        entry = self.index.version(version_id)
        if entry is None:
            raise SelectorError(selector, f"version {version_id[:12]} is not in the store",
                                missed=True)
        return self.info_from_entry(entry)

    def _resolve_run_step(self, selector: str) -> VersionInfo:
        run, _, step = selector.partition("@")
        latest = self.latest(run)
        if latest is None:
            raise SelectorError(selector, f"no versions of run {run!r}", missed=True)
        if step == "latest":
            return latest
        if not (step.isascii() and step.isdigit() and len(step) <= 19):  # '²' is a digit
            raise SelectorError(selector, "expected RUN@STEP with an integer step, or RUN@latest")
        matches = self.at_step(run, int(step))
        if not matches:
            raise SelectorError(selector, f"run {run!r} has no version at step {step}",
                                missed=True)
        return matches[-1]

    def _resolve_prefix(self, selector: str) -> VersionInfo:
        prefix = selector.lower()
        if len(prefix) < MIN_PREFIX or not all(c in "0123456789abcdef" for c in prefix):
            raise SelectorError(selector, "not a tag, RUN@STEP, RUN@latest, 'latest', or a"
                                f" hex id prefix of at least {MIN_PREFIX} characters")
        matches = [self.info_from_entry(e) for e in self.index.versions_with_prefix(prefix)]
        if len(matches) > 1:
            raise AmbiguousSelectorError(selector, f"matches {len(matches)} versions; use more"
                                         " characters")
        if not matches:
            if is_hex_digest(prefix):
                self._explain_unlisted(prefix)
            raise SelectorError(selector, "no version id starts with it", missed=True)
        return matches[0]

    def _explain_unlisted(self, version_id: str) -> None:
        """Raise the typed error that keeps a committed version out of the index.

        Opening the store leaves out versions it cannot read (a newer format,
        a damaged record or tree); naming one by id says why, not "no such id".
        """
        try:
            record = self.read_record(version_id)
        except FileNotFoundError:
            return
        flatten(self.objects, record.root, self.node_cache)

    def signature(self, selector: str, trust: Trust | None = None) -> SignatureCheck:
        """Who signed the version ``selector`` names, as the keys this handle trusts (or
        ``trust``) see it (:mod:`chunkstore.handle.signatures`): its commit record is read
        from the store and hash-checked, then its signature object checked against the
        record's bytes.  A record that names another root than the index (what a read
        of the version follows) is no signature of what would be read: bad."""
        info = self.resolve(selector)
        try:
            data = self.objects.get(VERSIONS, info.id)
        except FileNotFoundError:  # removed by another process since the index looked
            raise VersionRemovedError(info.id) from None
        record = CommitRecord.decode(info.id, data)  # the id's bytes (CorruptRecordError)
        if record.root != info.root:
            return SignatureCheck(info.id, BAD_SIGNATURE, reason=(
                f"the index names root {info.root.short()}, the commit record"
                f" {record.root.short()}: rebuild the index (`chunkstore index rebuild`)"))
        return check_signature(self.objects, info.id, data,
                               self.trust if trust is None else trust)

    def read_record(self, version_id: str) -> CommitRecord:
        """Read and check a commit record from the backend (the truth)."""
        return CommitRecord.decode(version_id, self.objects.get(VERSIONS, version_id))

    # --- tags and deletion -----------------------------------------------------------------

    def tag(self, selector: str, name: str) -> VersionInfo:
        """Point tag ``name`` at a version (moving it if it exists).  Tags pin versions."""
        name = check_label(name, "tag")
        if looks_like_a_version_id(name):
            raise InvalidInputError(f"tag {name!r} looks like a version id; choose another name")
        info = self.resolve(selector)
        body = json.dumps({"version": info.id, "created": time.time()}).encode()
        audit.record(self.objects, "tag", tag=name, versions=versions_named([info]),
                     previous=self._stored_tag(name)[1])  # the store's word: the index lags
        self.objects.put(TAGS, name, body)
        self.index.set_tag(name, info.id)
        return info

    def stored_tags(self) -> dict[str, str]:
        """Tags as storage has them (``tags()`` reads the index)."""
        found = {}
        for name in self.objects.ids(TAGS):
            data = None
            try:
                data = self.objects.get(TAGS, name)
                found[name] = Tag.decode(name, data).version
            except FileNotFoundError:
                continue  # removed meanwhile
            except CorruptTagError:
                # Damaged (verify reports it); if it still names a version id, it
                # still pins that version: retention errs on the side of keeping.  A
                # sealed tag that fails authentication names none: it pins what the
                # index last read from it.
                pinned = _pinned_version(data) if data is not None \
                    else self.index.tags().get(name)
                if pinned is not None:
                    found[name] = pinned
        return found

    def untag(self, name: str) -> bool:
        try:
            name = check_label(name, "tag")
        except InvalidNameError:
            # A damaged tag (another tool's) may carry a name writers refuse: it can
            # still be removed by its exact name, if it names a plain key.
            if not _removable_key_name(name) or not self.objects.exists(TAGS, name):
                raise
        stored, previous = self._stored_tag(name)
        if stored:
            audit.record(self.objects, "untag", tag=name, previous=previous)
        existed = self.objects.delete(TAGS, name)
        return self.index.delete_tag(name) or existed

    def tags(self) -> dict[str, str]:
        return self.index.tags()

    def _stored_tag(self, name: str) -> tuple[bool, str | None]:
        """Whether tag ``name`` is stored, and the version it names (one GET; a damaged
        tag: the version it still names, else the index's), for its audit events."""
        data = None
        try:
            data = self.objects.get(TAGS, name)
            return True, Tag.decode(name, data).version
        except FileNotFoundError:
            return False, None
        except CorruptTagError:  # as stored_tags reads one (a sealed one: data None)
            pinned = _pinned_version(data) if data is not None else None
            return True, pinned or self.index.tags().get(name)

    def delete(self, selector: str, *, force: bool = False) -> VersionInfo:
        """Unpublish a version.  Its chunks are freed by GC after the grace period.

        A tagged version is refused unless ``force`` (which drops its tags too).
        A full version id whose commit record cannot be read (so it is never
        listed) is removed too.  See :mod:`chunkstore.handle.removal`.
        """
        return self.delete_many([selector], force=force)[0]

    def delete_many(self, selectors: Iterable[str], *, force: bool = False
                    ) -> list[VersionInfo]:
        """:meth:`delete` of every selector, in bulk (a few requests in all and a PUT per
        version, where one by one each cost six).  Every selector is resolved, and every
        tag checked, before anything is removed: one bad selector removes nothing."""
        infos = list({info.id: info for info in map(self.resolve_for_removal,
                                                    selector_list(selectors))}.values())
        remove_versions(self, infos, force=force)
        return infos

    def delete_listed_many(self, infos: Iterable[VersionInfo], *,
                           operation: str = "retention") -> list[Hold]:
        """Remove versions a caller listed moments ago (retention), in bulk; one that
        is gone from the store already (another process removed it) is simply gone.
        Held versions are left as they are: their holds are returned.  ``operation``
        names the removal in the audit trail."""
        return remove_versions(self, list({info.id: info for info in infos}.values()),
                               skip_held=True, operation=operation)

    # --- legal holds (chunkstore.protocol.holds) -------------------------------------------

    def hold(self, selector: str, reason: str) -> Hold:
        """Put the version ``selector`` names under a legal hold: no removal path (``rm``,
        ``prune``, retention, ``keep_last``, replacement) removes it until
        :meth:`release`.  Returns the hold, confirmed against removals in progress
        (:class:`HoldUnconfirmedError` if one could not be ruled out)."""
        return place_hold(self, selector, reason)

    def release(self, selector: str) -> Hold:
        """Release the hold of a version (deletes its hold object); returns the hold."""
        return release_version(self, selector)

    def holds(self) -> dict[str, Hold]:
        """Every hold in the store (not the index: holds are read where they are), by
        version id; a damaged hold object is a hold with ``damage`` set."""
        return list_holds(self.objects)

    def delete_listed(self, version_id: str) -> bool:
        """Remove a version a caller listed moments ago (retention, replacement).

        Returns False when it is already gone from the store (another process
        removed it, and this index had not heard yet): for retention that is
        done, not an error.
        """
        try:  # (no listing after a miss: gone is the common case here, and fine)
            remove_versions(self, [self.resolve_for_removal(version_id, listing=False)],
                            operation="replace")
        except SelectorError:
            if self.objects.exists(VERSIONS, version_id):
                raise
            self.index.remove_version(version_id)
            return False
        return True

    def resolve_for_removal(self, selector: str, *, listing: bool = True) -> VersionInfo:
        """:meth:`resolve` (without its listing after a miss where not ``listing``), and
        also a full version id whose commit record exists but cannot be read (never
        listed): then an info with ``meta={"unreadable": True}``."""
        try:
            return self.resolve(selector) if listing else self._resolve(selector)
        except ChunkStoreError:
            if not (isinstance(selector, str) and is_hex_digest(selector)
                    and self.objects.exists(VERSIONS, selector)):
                raise
        try:  # the index may only lag the store (another process's save or rebuild)
            record = self.read_record(selector)
            flatten(self.objects, record.root, self.node_cache)
        except FileNotFoundError:
            raise SelectorError(selector, "no version with this id (removed already?)") from None
        except ChunkStoreError:
            return VersionInfo(selector, "?", 0, 0.0, None, Digest(bytes(32)), 0, 0, 0,
                               {"unreadable": True})
        return self.info_from_entry(entry_from_record(selector, record))  # the store's word

    # --- the store's own word ----------------------------------------------------------------

    def stored_version_ids(self) -> list[str]:
        """The id of every commit record in the store (``versions()`` reads the index)."""
        return list(self.objects.ids(VERSIONS))

