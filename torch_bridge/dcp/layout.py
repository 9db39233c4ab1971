"""How a torch.distributed.checkpoint (DCP) save sits in one chunkstore version.

Every tensor DCP saves is one tensor entry whose shards are the boxes the
ranks saved (``ChunkStorageMetadata``: offsets and sizes), named by its FQN
when that is a valid entry name (``_dcp.t<n>`` otherwise).  Every non-tensor
value (a DCP bytes item) is a plain-data entry ``_dcp.data.<fqn>``
(``_dcp.d<n>``), kind ``"data"`` in the items below; a value stored pickled
(``allow_pickle=True``, or any value of a format-1 save) is a ``uint8`` tensor
entry ``_dcp.bytes.<fqn>`` (``_dcp.b<n>``) holding DCP's blob, kind
``"bytes"``, which the reader loads only with ``allow_pickle=True``.  One
plain-data entry, ``_dcp.metadata``, holds the rest of DCP's ``Metadata`` in
chunkstore's safe encoding (never pickle)::

    {"format": 2, "version": "1.0.0",
     "items": [[fqn, "tensor", entry, {"requires_grad": false, "pin_memory": false,
                                      "memory_format": "contiguous"}],
               [fqn, "data", entry, {}], [fqn, "bytes", entry, {}], ...],
     "planner_data": {...}, "storage_meta": {"checkpoint_id": ..., "save_id": ...,
                                             "load_id": null, "modules": [...]}}

Sizes, offsets and dtypes are not repeated there: a reader takes them from
the tensor entries, which it checks anyway (shards tile the shape).

A save by more than one rank also stores chunkstore's ranks record
(:data:`chunkstore.format.shards.RANKS_ENTRY`, :class:`chunkstore.format.shards.ShardRanks`):
the rank that wrote each shard, which ``chunkstore show`` and ``report``
present.  Loading does not read it; versions saved before it existed (and
saves by one process) have none, and their shards are shown by box.

:class:`StoreHandle` is how the writer and the reader hold the store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import chunkstore
from chunkstore import Store, VersionWriter
from chunkstore.errors import CorruptNodeError, InvalidInputError, InvalidNameError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.format.names import check_entry_name
from chunkstore.format.shards import RANKS_ENTRY, StagedShard
from chunkstore.index.lmdbindex import NewChunk
from torch_bridge.capture.tensors import stored_name, torch_dtype
from torch_bridge.distributed.sharded import staged_entry

METADATA_ENTRY = "_dcp.metadata"
#: 2: non-tensor values as plain-data entries ("data" items); 1 stored them pickled.
FORMAT = 2
FORMATS = (1, 2)
#: The key of a rank's write result that carries a plain value (encoded), not a shard.
PLAIN_RESULT = "plain_data"
_PREFIX = "_dcp"
#: First name components an item's FQN may not take as its entry name.
_RESERVED = (_PREFIX, RANKS_ENTRY.split(".")[0])
_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve": torch.preserve_format}
_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}

StoreLike = Store | str | os.PathLike[str]
#: (fqn, offsets or None for a bytes item): how a rank's result names its item.
ItemKey = tuple[str, tuple[int, ...] | None]


def item_key(fqn: str, offset: Iterable[int] | None) -> ItemKey:
    return fqn, None if offset is None else tuple(int(o) for o in offset)


def _entry_name(fqn: str, fallback: str, prefix: str = "") -> str:
    """The entry name of an item: its FQN (under ``prefix``) when that is a valid name
    outside ``_dcp.``, else ``fallback``."""
    try:
        name = check_entry_name(f"{prefix}{fqn}")
    except InvalidNameError:
        return fallback
    return name if prefix or name.split(".")[0] not in _RESERVED else fallback


def _storage_meta_plain(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    checkpoint_id = meta.checkpoint_id
    return {"checkpoint_id": None if checkpoint_id is None else os.fspath(checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)}


class VersionLayout:
    """The entries and plain metadata of one DCP save, built from every rank's results."""

    def __init__(self, metadata: Metadata, staged: dict[ItemKey, StagedShard],
                 writers: dict[ItemKey, int] | None = None,
                 plain: dict[ItemKey, object] | None = None) -> None:
        self.tensors: dict[str, TensorEntry] = {}
        #: entry name -> a non-tensor value, stored as plain data
        self.data: dict[str, object] = {}
        plain = dict(plain or {})
        self.written: dict[Digest, NewChunk] = {}
        #: entry name -> the rank that wrote each shard (when ``writers`` says)
        self.ranks: dict[str, tuple[int, ...]] = {}
        items: list[list[Any]] = []
        for n, (fqn, item) in enumerate(metadata.state_dict_metadata.items()):
            if isinstance(item, BytesStorageMetadata) and item_key(fqn, None) in plain:
                name = _entry_name(fqn, f"{_PREFIX}.d{n}", f"{_PREFIX}.data.")
                self.data[name] = plain.pop(item_key(fqn, None))
                items.append([fqn, "data", name, {}])
                continue
            if isinstance(item, BytesStorageMetadata):
                name = _entry_name(fqn, f"{_PREFIX}.b{n}", f"{_PREFIX}.bytes.")
                self.tensors[name] = staged_entry(fqn, [self._take(staged, fqn, None)], "uint8",
                                                 self.written)
                self._record_ranks(name, writers, [item_key(fqn, None)])
                items.append([fqn, "bytes", name, {}])
                continue
            shards = [self._take(staged, fqn, chunk.offsets) for chunk in item.chunks]
            for chunk, shard in zip(item.chunks, shards, strict=True):
                if shard.shard.sizes != tuple(chunk.sizes) or shard.shape != tuple(item.size):
                    raise InvalidInputError(f"{fqn}: a rank stored a box of sizes"
                                            f" {list(shard.shard.sizes)} in shape"
                                            f" {list(shard.shape)}, the plan says"
                                            f" {list(chunk.sizes)} in {list(item.size)}")
            name = _entry_name(fqn, f"{_PREFIX}.t{n}")
            self.tensors[name] = staged_entry(fqn, shards, stored_name(item.properties.dtype),
                                             self.written)
            self._record_ranks(name, writers, [item_key(fqn, c.offsets) for c in item.chunks])
            props = item.properties
            items.append([fqn, "tensor", name, {
                "requires_grad": bool(props.requires_grad), "pin_memory": bool(props.pin_memory),
                "memory_format": _FORMAT_NAMES.get(props.memory_format, "contiguous")}])
        if staged or plain:
            extra = [*staged, *plain]
            raise InvalidInputError(f"ranks stored {len(extra)} items the save's metadata does"
                                    f" not name (first: {extra[0]})")
        self.plain = {"format": FORMAT, "version": metadata.version, "items": items,
                      "planner_data": metadata.planner_data,
                      "storage_meta": _storage_meta_plain(metadata.storage_meta)}

    def _record_ranks(self, name: str, writers: dict[ItemKey, int] | None,
                      keys: list[ItemKey]) -> None:
        if writers is not None:
            self.ranks[name] = tuple(writers[key] for key in keys)

    @staticmethod
    def _take(staged: dict[ItemKey, StagedShard], fqn: str, offsets: Iterable[int] | None
              ) -> StagedShard:
        try:
            return staged.pop(item_key(fqn, offsets))
        except KeyError:
            raise InvalidInputError(f"no rank stored item {fqn!r} at offsets"
                                    f" {None if offsets is None else list(offsets)}") from None


class StoredItems:
    """A DCP version read back: DCP's Metadata, and where each item's bytes are."""

    def __init__(self, leaf: DataEntry, value: object, entries: dict[str, Any]) -> None:
        self.tensors: dict[str, str] = {}
        self.bytes: dict[str, str] = {}
        #: fqn -> the plain-data entry of a non-tensor value
        self.data: dict[str, str] = {}
        try:
            self.metadata = self._decode(value, entries)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidInputError):
                raise
            raise CorruptNodeError(leaf.digest.hex, f"malformed DCP metadata: {exc!r}") from exc

    def _decode(self, value: object, entries: dict[str, Any]) -> Metadata:
        found = value.get("format") if isinstance(value, dict) else None
        if not isinstance(value, dict) or type(found) is not int or found not in FORMATS:
            raise ValueError(f"format {found!r}, this release reads {list(FORMATS)}")
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, kind, name, props in value["items"]:
            entry = entries[name]
            if kind == "data" and found >= 2 and isinstance(fqn, str) \
                    and isinstance(entry, DataEntry):
                self.data[fqn] = name
                state[fqn] = BytesStorageMetadata()
                continue
            if not isinstance(fqn, str) or not isinstance(entry, TensorEntry) \
                    or not isinstance(props, dict):
                raise ValueError(f"item {fqn!r}: not a tensor entry {name!r}")
            if kind == "bytes":
                self.bytes[fqn] = name
                state[fqn] = BytesStorageMetadata()
                continue
            if kind != "tensor":
                raise ValueError(f"item {fqn!r} of unknown kind {kind!r}")
            self.tensors[fqn] = name
            properties = TensorProperties(
                dtype=torch_dtype(entry.dtype), layout=torch.strided,
                requires_grad=bool(props["requires_grad"]), pin_memory=bool(props["pin_memory"]),
                memory_format=_MEMORY_FORMATS[props["memory_format"]])
            state[fqn] = TensorStorageMetadata(
                properties, torch.Size(entry.shape),
                [ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.sizes))
                 for s in entry.shards])
        meta = value["storage_meta"]
        storage_meta = None if meta is None else StorageMeta(
            checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"],
            load_id=meta["load_id"], modules=list(meta["modules"]))
        return Metadata(state, planner_data=value["planner_data"], storage_meta=storage_meta,
                        version=value["version"])


class StoreHandle:
    """The store a writer or reader uses, opened from a URL on demand (and closed when
    the save ends) or given open by the caller (never closed here); plus the
    coordinator's unpublished version, aborted if the save never reaches ``finish``."""

    def __init__(self, store: StoreLike, options: dict[str, Any]) -> None:
        self.given = store if isinstance(store, Store) else None
        self.url = store.url if isinstance(store, Store) else os.fspath(store)
        self.options = options
        self.store: Store | None = None
        self.version: VersionWriter | None = None

    def open(self, *, create: bool) -> Store:
        if self.store is None:
            self.store = self.given or chunkstore.open(self.url, create=create, **self.options)
        return self.store

    def abort_version(self) -> None:
        version, self.version = self.version, None
        if version is not None:
            version.abort()

    def release(self) -> None:
        """Abort an unpublished version and close a store opened here (idempotent)."""
        try:
            self.abort_version()
        finally:
            store, self.store = self.store, None
            if store is not None and self.given is None:
                store.close()


def open_options(storage_options: dict[str, Any] | None, index_dir: str | None
                  ) -> dict[str, Any]:
    return {"storage_options": storage_options, "index_dir": index_dir}
