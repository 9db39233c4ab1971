"""A store's config: loaded, created in an empty location, or, when ``chunkstore.json``
is damaged or missing in a location that holds commit records, recovered from what the
store's objects carry (docs/format.md §2.1) and written back by ``chunkstore init
--recover``.

Recovery opens the store read-only (:class:`RecoveredReadOnly`): a config derived from
the objects may be wrong where they do not say (a chunk size with no tensor to show it,
a delta depth other than the default), and writing objects on it could not be undone,
so nothing is written until the config is written back; the fix is one command.

Every field is derived from the store, never guessed where the store says more:

1. **Chunk size**: every shard of a tensor records its ``chunk_bytes``, the store's
   chunk size rounded down to a multiple of its element size (§6.2); every element
   size divides 64, and chunk sizes are multiples of 64, so the largest
   ``chunk_bytes`` is the chunk size itself.  With no tensor at all (or one whose
   largest ``chunk_bytes`` is no valid chunk size) it is not known: reads take the
   smallest value every manifest allows, and writing the config back needs it given.
2. **Delta depth**: the default, or the longest delta chain a manifest lists where that
   is longer (a writer never builds a chain longer than the store's depth).
3. **Created** (the store's identity, which every index records: another identity
   empties an index): the identity the local index recorded, else the creation time of
   the oldest commit record (a config is written before any version), else now.
4. **Format version**: this release's.  An older store read as the current version is
   what an upgrade makes of it (the upgrade rewrites only the config), and the config
   is written back as this release writes every config.  A version whose record or
   nodes are of a format newer than this release's is counted: then the store may be
   a newer release's, and the config is not written back.
5. **Compression**: ``auto`` (a writer's default; readers do not need it).

The walk reads each commit record and each distinct tree node once, as an index
rebuild does; a record or node that cannot be read is counted and skipped.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.errors import (
    ChunkStoreError,
    CorruptConfigError,
    FormatVersionError,
    InvalidSettingError,
    NoStoreError,
    NotAStoreError,
    RecoveredConfigError,
    StoreLocationError,
    recover_command,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import MAX_DELTA_DEPTH, TensorEntry
from chunkstore.format.records import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DELTA_DEPTH,
    HOLDS_STORE_FORMAT_VERSION,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    STORE_FORMAT_VERSION,
    CommitRecord,
    Encryption,
    StoreConfig,
)
from chunkstore.handle.tree import NodeCache, load_tree
from chunkstore.index.lmdbindex import STORE_KEY, Index
from chunkstore.objects.kinds import HOLDS, KEYS, VERSIONS
from chunkstore.objects.objectstore import ObjectStore

#: The compression policy a recovered config names.
RECOVERED_COMPRESSION = "auto"


@dataclass(frozen=True)
class RecoveredConfig:
    """A config derived from the store's objects, and what it was derived from."""

    config: StoreConfig
    #: what is wrong with the stored ``chunkstore.json`` ("is missing", "is damaged: ...")
    reason: str
    #: whether a manifest fixes the chunk size (else it is the smallest every one allows)
    chunk_size_known: bool
    #: the largest ``chunk_bytes`` of any shard (0: no tensor)
    largest_chunk_bytes: int
    #: the longest delta chain any manifest lists
    longest_chain: int
    #: where ``created`` came from
    created_from: str
    #: commit records read, and those (or their trees) that could not be read
    versions: int
    unreadable: int
    #: what is of a format newer than this release's (the store may be a newer one's)
    newer: tuple[str, ...] = ()

    def describe(self) -> str:
        """What was recovered, and from what, in a few words."""
        config = self.config
        size = (f"chunk size {config.chunk_size} (from the manifests)" if self.chunk_size_known
                else f"chunk size unknown: {config.chunk_size} for reads, the smallest every"
                " manifest allows")
        depth = (f"delta depth {config.delta_depth} (the default)"
                 if config.delta_depth == DEFAULT_DELTA_DEPTH and self.longest_chain
                 <= DEFAULT_DELTA_DEPTH else
                 f"delta depth {config.delta_depth} (the longest chain listed)")
        newer = f", {len(self.newer)} of a newer format" if self.newer else ""
        return (f"{size}, {depth}, compression {config.compression}, created"
                f" {config.created!r} (from {self.created_from}), format version"
                f" {config.format_version}; {self.versions} versions read,"
                f" {self.unreadable} unreadable{newer}")


def recorded_created(index: Index) -> float | None:
    """The creation time of the store ``index`` was built for (its recorded identity,
    :meth:`StoreConfig.identity`), None if it records none."""
    with index.env.begin(db=index.meta) as txn:
        found = txn.get(STORE_KEY)
    text = bytes(found).decode(errors="replace") if found is not None else ""
    head, _, number = text.partition(" ")
    try:
        created = float(number) if head == "created" else math.nan
    except ValueError:
        return None
    return created if math.isfinite(created) else None


def holds_versions(objects: ObjectStore) -> bool:
    """Whether the location holds a commit record (so it clearly holds a store)."""
    return next(iter(objects.ids(VERSIONS)), None) is not None


def check_settings(url: str, config: StoreConfig, recovered: RecoveredConfig | None,
                    chunk_size: int | None, delta_depth: int | None) -> None:
    """Settings given to :func:`open` that the store's config contradicts.  A recovered
    config that does not know its chunk size takes any (its store writes nothing)."""
    known = recovered is None or recovered.chunk_size_known
    if chunk_size is not None and known and chunk_size != config.chunk_size:
        raise InvalidSettingError(f"{url} was created with chunk size {config.chunk_size};"
                                  " the chunk size of an existing store cannot change")
    if delta_depth is not None and delta_depth > config.delta_depth:
        raise InvalidSettingError(
            f"{url} was created with delta depth {config.delta_depth}: its saves build delta"
            f" chains of at most {config.delta_depth} links, so delta_depth={delta_depth}"
            f" cannot hold; pass 0 to {config.delta_depth} (shorter chains, faster restores,"
            " more bytes per version) or leave it out")


def load_or_create_config(url: str, objects: ObjectStore, create: bool,
                           chunk_size: int | None, compression: str | None,
                           delta_depth: int | None, encryption: Encryption | None = None
                           ) -> StoreConfig | str:
    """The stored config (created first where asked and the location is empty), or what
    is wrong with it where it is damaged or missing in a location that holds commit
    records (a store: its config is recovered from them, docs/format.md §2.1)."""
    try:
        data = objects.get_config()
    except FileNotFoundError:
        data = None
    if data is not None:
        damage = damage_of(url, data)  # a newer store raises FormatVersionError
        if damage is None:
            return StoreConfig.decode(url, data)
        if holds_versions(objects):
            return _recoverable(url, objects, damage)
        StoreConfig.decode(url, data)  # no store's damaged config: not a store, as it says
    elif holds_versions(objects):
        return _recoverable(url, objects, "is missing")
    if not create:
        local = objects.local_path()
        hint = " (create one with `chunkstore init` or chunkstore.open(..., create=True))"
        if local is not None and not os.path.isdir(local):
            raise NoStoreError(url, "the directory does not exist", hint)
        if objects.is_empty():
            raise NoStoreError(url, "nothing is stored there", hint)
        raise NotAStoreError(url, "no chunkstore.json" + hint)
    if not objects.is_empty():
        raise NotAStoreError(url, "the location is not empty and has no chunkstore.json")
    config = StoreConfig(chunk_size or DEFAULT_CHUNK_SIZE, compression or "auto", time.time(),
                         DEFAULT_DELTA_DEPTH if delta_depth is None else delta_depth,
                         encryption=encryption)
    try:
        objects.create_config(config.encode())
    except OSError as exc:  # not a place for a store: nothing of it was written
        raise StoreLocationError(url, exc.strerror or str(exc)) from None
    # A concurrent creator may have won: the stored config is the one that counts.
    return StoreConfig.decode(url, objects.get_config())


def _recoverable(url: str, objects: ObjectStore, damage: str) -> str:
    """``damage``, where a config can be recovered from the objects; an encrypted store's
    cannot (its records are sealed under a key the config's absence hides), so it is
    refused, with the fix."""
    if next(iter(objects.ids(KEYS)), None) is not None:
        raise CorruptConfigError(url, f"chunkstore.json {damage}, and the store is encrypted"
                                 " (keys/ holds its key objects): its config is not recovered"
                                 " from its sealed objects. Put back a copy of its"
                                 " chunkstore.json (it holds no secret: any copy of the"
                                 " store's, a mirror's or a backup's); nothing was changed")
    return damage


@dataclass
class _Found:
    """What the walk over the store's versions met."""

    records: list[CommitRecord] = dataclasses.field(default_factory=list)
    chunk_bytes: int = 0
    longest_chain: int = 0
    unreadable: int = 0
    newer: list[str] = dataclasses.field(default_factory=list)

    def met(self, what: str, exc: ChunkStoreError) -> None:
        if isinstance(exc, FormatVersionError):
            self.newer.append(what)
        else:
            self.unreadable += 1

    def add_entry(self, entry: TensorEntry) -> None:
        for shard in entry.shards:
            self.chunk_bytes = max(self.chunk_bytes, shard.chunk_bytes)
            for i in range(len(shard.chunks)):
                self.longest_chain = max(self.longest_chain, len(shard.chain(i)))


def _read_records(objects: ObjectStore, found: _Found) -> None:
    for version_id in objects.ids(VERSIONS):
        try:
            found.records.append(CommitRecord.decode(version_id, objects.get(VERSIONS,
                                                                              version_id)))
        except FileNotFoundError:
            continue  # removed meanwhile
        except ChunkStoreError as exc:
            found.met(f"version {version_id[:12]}", exc)


def _walk_trees(objects: ObjectStore, found: _Found) -> None:
    """Every distinct tree node of every version once; its tensor entries noted."""
    cache, seen = NodeCache(), set[Digest]()
    stack = [record.root for record in found.records]
    while stack:
        digest = stack.pop()
        if digest in seen:
            continue
        seen.add(digest)
        try:
            node = load_tree(objects, digest, cache)
        except ChunkStoreError as exc:
            found.met(f"node {digest.hex[:12]}", exc)
            continue
        for leaf in node.leaves.values():
            if isinstance(leaf, TensorEntry):
                found.add_entry(leaf)
        stack.extend(node.children())


def recover_config(objects: ObjectStore, reason: str, created: float | None) -> RecoveredConfig:
    """The config the store's objects describe (see the module docstring); ``created``
    is the local index's recorded creation time, if it has one."""
    found = _Found()
    _read_records(objects, found)
    _walk_trees(objects, found)
    largest = found.chunk_bytes
    known = MIN_CHUNK_SIZE <= largest <= MAX_CHUNK_SIZE and largest % 64 == 0
    chunk_size = min(MAX_CHUNK_SIZE, max(MIN_CHUNK_SIZE, -(-largest // 64) * 64))
    if created is not None:
        created_from = "the index"
    elif found.records:
        created, created_from = min(r.created for r in found.records), "the oldest version"
    else:
        created, created_from = time.time(), "the time of recovery"
    depth = min(MAX_DELTA_DEPTH, max(DEFAULT_DELTA_DEPTH, found.longest_chain))
    # A store with a hold object is of version 11 (docs/format.md §15): written back as
    # 9, a release that does not honour holds would open it and remove a held version.
    held = next(iter(objects.ids(HOLDS)), None) is not None
    config = StoreConfig(chunk_size, RECOVERED_COMPRESSION, created, depth,
                         HOLDS_STORE_FORMAT_VERSION if held else STORE_FORMAT_VERSION)
    return RecoveredConfig(config, reason, known, largest, found.longest_chain, created_from,
                           len(found.records), found.unreadable, tuple(found.newer))


def recover_read_only(objects: ObjectStore, reason: str,
                      created: float | None) -> RecoveredConfig:
    """:func:`recover_config`, with ``objects`` made read-only (:class:`RecoveredReadOnly`)
    before anything else reads or writes through them."""
    recovered = recover_config(objects, reason, created)
    objects.backend = RecoveredReadOnly(objects.backend)
    return recovered


def config_to_write(url: str, recovered: RecoveredConfig, chunk_size: int | None,
                    delta_depth: int | None, compression: str | None) -> StoreConfig:
    """The config ``init --recover`` writes: the recovered one, with the settings given
    (each checked against what the manifests say)."""
    operation = "write chunkstore.json back"
    if chunk_size is not None and not (MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
                                       and chunk_size % 64 == 0):
        raise InvalidSettingError(f"chunk size {chunk_size} must be a multiple of 64 between"
                                  f" {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE}")
    if delta_depth is not None and not 0 <= delta_depth <= MAX_DELTA_DEPTH:
        raise InvalidSettingError(f"delta depth {delta_depth} must be in [0, {MAX_DELTA_DEPTH}]")
    if recovered.newer:
        raise RecoveredConfigError(url, operation, (
            f"{', '.join(recovered.newer[:3])} {'is' if len(recovered.newer) == 1 else 'are'}"
            " of a format newer than this release's, so the store may be a newer"
            " release's: write its config back with that release"))
    config = recovered.config
    if chunk_size is None and not recovered.chunk_size_known:
        raise RecoveredConfigError(url, operation, (
            "no manifest fixes the chunk size (no tensor, or none cut at the chunk size);"
            f" give it: {recover_command(url)} --chunk-size N (N at least"
            f" {config.chunk_size}, a multiple of 64)"))
    if chunk_size is not None and (chunk_size < recovered.largest_chunk_bytes or (
            recovered.chunk_size_known and chunk_size != config.chunk_size)):
        raise InvalidSettingError(
            f"chunk size {chunk_size} does not fit {url}'s manifests: they were cut at"
            f" {config.chunk_size}" if recovered.chunk_size_known else
            f"chunk size {chunk_size} is below the {recovered.largest_chunk_bytes}-byte"
            f" chunks of {url}'s manifests")
    if delta_depth is not None and delta_depth < recovered.longest_chain:
        raise InvalidSettingError(
            f"delta depth {delta_depth} is below the {recovered.longest_chain}-link delta"
            f" chains {url}'s manifests list")
    return dataclasses.replace(
        config, chunk_size=config.chunk_size if chunk_size is None else chunk_size,
        delta_depth=config.delta_depth if delta_depth is None else delta_depth,
        compression=compression or config.compression)


def write_config(objects: ObjectStore, url: str, config: StoreConfig) -> None:
    """Write ``config`` as the store's ``chunkstore.json`` where the stored one is still
    missing or damaged: a missing one put-if-absent, a damaged one replaced atomically
    (a temp file renamed, or one PUT).  Refused, writing nothing, when a valid config
    is there by now (another process wrote it back)."""
    operation = "write chunkstore.json back"
    if isinstance(objects.backend, RecoveredReadOnly):
        objects = ObjectStore(objects.backend.inner)
    try:
        data = objects.get_config()
    except FileNotFoundError:
        if not objects.create_config(config.encode()):
            raise RecoveredConfigError(url, operation, "another process wrote chunkstore.json"
                                       " meanwhile; nothing was written") from None
        return
    if damage_of(url, data) is None:
        raise RecoveredConfigError(url, operation, "chunkstore.json is valid (written back"
                                   " meanwhile?); nothing was written")
    objects.replace_config(config.encode())


def damage_of(url: str, data: bytes) -> str | None:
    """What is wrong with stored config bytes (None: nothing); a config of a newer
    format version is no damage: :class:`FormatVersionError`, as opening one says."""
    try:
        StoreConfig.decode(url, data)
    except FormatVersionError as exc:
        if type(exc.found) is int and exc.found > STORE_FORMAT_VERSION:
            raise
        return f"is damaged: format_version {exc.found!r} is no store version"
    except NotAStoreError as exc:  # CorruptConfigError too
        text, prefix = str(exc), f"{url} is not a chunkstore store: chunkstore.json "
        return text[len(prefix):] if text.startswith(prefix) else f"is damaged: {text}"
    return None


def read_only_reason(url: str) -> str:
    """Why a store opened with a recovered config refuses a change, and the fix."""
    return ("the store was opened read-only because its chunkstore.json is damaged or"
            f" missing; `{recover_command(url)}` writes it back from the commit records"
            " and manifests; nothing was changed")


class RecoveredReadOnly(ForwardingBackend):
    """The backend of a store opened with a recovered config: reads pass through, every
    write is refused with :class:`RecoveredConfigError`, which names the command that
    writes the config back (nothing of the store changes until then, leftovers of
    interrupted writes included).  :func:`write_config` writes through ``inner``."""

    def _refuse(self, operation: str, key: str) -> RecoveredConfigError:
        return RecoveredConfigError(self.url, f"{operation} {key!r}", read_only_reason(self.url))

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Raise :class:`RecoveredConfigError`; nothing is written."""
        raise self._refuse("put", key)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Raise :class:`RecoveredConfigError`; nothing is written."""
        raise self._refuse("create", key)

    def delete(self, key: str) -> bool:
        """Raise :class:`RecoveredConfigError`; nothing is deleted."""
        raise self._refuse("delete", key)

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        """Count them on a dry run; otherwise raise :class:`RecoveredConfigError`."""
        if not dry_run:
            raise self._refuse("delete leftovers of interrupted writes in", self.url)
        return self.inner.remove_temporaries(older_than, dry_run)
