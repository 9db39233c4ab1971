"""The DCP ``StorageReader`` half of :mod:`torch_bridge.dcp.writer` (import it from there)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from chunkstore import VersionInfo, VersionReader
from chunkstore.errors import InvalidInputError
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.format.shards import find_shard
from torch_bridge.capture.tensors import as_array, torch_dtype
from torch_bridge.dcp.layout import (
    METADATA_ENTRY,
    StoredItems,
    StoreHandle,
    StoreLike,
    open_options,
)
from torch_bridge.errors import NotACheckpointError, PickleRefusedError

#: Boxes a rank reads at once (each spreads its chunks over the store's thread pool).
READ_PARALLEL = 4


def is_store(checkpoint_id: str | os.PathLike[str]) -> bool:
    """True for a local folder holding a chunkstore store (DCP's storage detection
    cannot build these classes anyway: they need a run and a step, or a selector)."""
    return os.path.isfile(os.path.join(os.fspath(checkpoint_id), "chunkstore.json"))


class HandleOwner:
    """What the DCP writer and reader share: the store they use through a
    :class:`StoreHandle`, released when the owner is collected."""

    _handle: StoreHandle
    _finalizer: weakref.finalize[Any, Any]

    def _use(self, handle: StoreHandle) -> None:
        """Take ``handle``, releasing the one held before."""
        old = getattr(self, "_handle", None)
        if old is not None:
            old.release()
            self._finalizer.detach()
        self._handle = handle
        self._finalizer = weakref.finalize(self, StoreHandle.release, handle)

    def _switch(self, checkpoint_id: str | os.PathLike[str] | None) -> bool:
        """Use the store at ``checkpoint_id`` when DCP names another; True if it did."""
        if checkpoint_id is None or os.fspath(checkpoint_id) == self._handle.url:
            return False
        self._use(StoreHandle(checkpoint_id, self._handle.options))
        return True

    @property
    def checkpoint_id(self) -> str:
        return self._handle.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local folder holding a chunkstore store."""
        return is_store(checkpoint_id)


class ChunkStoreReader(HandleOwner, StorageReader):
    """A DCP ``StorageReader`` of one chunkstore version written by :class:`ChunkStoreWriter`.

    ``selector`` is any version selector (``RUN@latest``, ``RUN@STEP``, an id or
    prefix, a tag).  The store is opened and the version resolved here, so a bad
    selector or a version that is no DCP checkpoint raises now, with its typed
    error.  Every tensor read is hash-verified; a resharding read reads only the
    chunks that hold the boxes it needs.

    Non-tensor values come back from chunkstore's plain-data encoding: loading
    runs no code.  (They reach DCP's planner as it expects them, as the bytes of
    ``torch.save`` of the decoded value, which holds only plain types.)  A value
    stored pickled (by ``ChunkStoreWriter(..., allow_pickle=True)``, or by a
    release before plain values) is loaded only with ``allow_pickle=True``:
    otherwise :class:`~torch_bridge.errors.PickleRefusedError`, before anything
    is read.
    """

    def __init__(self, store: StoreLike, selector: str = "latest", *,
                 storage_options: dict[str, Any] | None = None,
                 index_dir: str | None = None, allow_pickle: bool = False) -> None:
        super().__init__()
        self.selector = selector
        self.allow_pickle = allow_pickle
        self._use(StoreHandle(store, open_options(storage_options, index_dir)))
        self._load()
        self.load_id = uuid.uuid4().hex

    def _load(self) -> None:
        """Resolve the selector and read DCP's metadata (the store is closed after)."""
        try:
            self.info, self._items = self._resolve()
        finally:
            self._handle.release()

    def _resolve(self) -> tuple[VersionInfo, StoredItems]:
        store = self._handle.open(create=False)
        reader = store.open_version(self.selector)
        entries = reader.entries()
        leaf = entries.get(METADATA_ENTRY)
        if not isinstance(leaf, DataEntry):
            raise NotACheckpointError(
                f"version {reader.info.short_id} ({reader.info.run}@{reader.info.step}) holds"
                " no DCP checkpoint (no _dcp.metadata entry); load it with"
                " torch_bridge.Checkpointer or chunkstore's own reader")
        return reader.info, StoredItems(leaf, reader.get_data(METADATA_ENTRY), entries)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if self._switch(checkpoint_id):
            self._load()
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._items.metadata
        storage_meta = metadata.storage_meta or StorageMeta()
        return dataclasses.replace(metadata, storage_meta=dataclasses.replace(
            storage_meta, load_id=self.load_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.info.id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse a load whose ranks resolved the selector to different versions (a
        save published between their lookups): they would mix two checkpoints."""
        chosen = {plan.storage_data for plan in plans}
        if len(chosen) > 1:
            by_rank = {rank: str(plan.storage_data)[:12] for rank, plan in enumerate(plans)}
            raise InvalidInputError(
                f"the ranks resolved {self.selector!r} to different versions ({by_rank});"
                " load by version id (the same on every rank) while saves may publish")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of this rank's plan, hash-verified, into what the planner gives."""
        self._refuse_pickled(plan)
        try:
            reader = self._handle.open(create=False).open_version(self.info.id)
            boxes: list[tuple[ReadItem, str, torch.Tensor]] = []
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO and item.storage_index.fqn in \
                        self._items.data:
                    planner.load_bytes(item, _plain_blob(reader.get_data(
                        self._items.data[item.storage_index.fqn])))
                elif item.type == LoadItemType.BYTE_IO:
                    name = self._lookup(self._items.bytes, item.storage_index)
                    planner.load_bytes(item, io.BytesIO(reader.get(name).tobytes()))
                else:
                    name = self._lookup(self._items.tensors, item.storage_index)
                    boxes.append((item, name, planner.resolve_tensor(item).detach()))
            # Several boxes at a time: each read waits for its chunks (round trips on S3).
            with ThreadPoolExecutor(min(READ_PARALLEL, len(boxes) or 1),
                                    thread_name_prefix="dcp-read") as pool:
                list(pool.map(lambda box: _read_box(reader, *box), boxes))
            for item, _, target in boxes:
                planner.commit_tensor(item, target)
        finally:
            self._handle.release()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def close(self) -> None:
        self._handle.release()

    def _refuse_pickled(self, plan: LoadPlan) -> None:
        """PickleRefusedError, before anything is read, for a plan that loads a value
        stored pickled, unless ``allow_pickle``."""
        if self.allow_pickle:
            return
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO and fqn not in self._items.data:
                raise PickleRefusedError(fqn, f"{fqn} was stored pickled (by"
                                         " ChunkStoreWriter(..., allow_pickle=True), or by a"
                                         " release that pickled every non-tensor value);"
                                         " loading it runs whatever code the pickle names:"
                                         " pass allow_pickle=True to ChunkStoreReader only"
                                         " for a store whose writers you trust")

    @staticmethod
    def _lookup(names: dict[str, str], index: MetadataIndex) -> str:
        try:
            return names[index.fqn]
        except KeyError:
            raise InvalidInputError(f"the checkpoint has no item {index.fqn!r} of that kind"
                                    ) from None


def _plain_blob(value: object) -> io.BytesIO:
    """A decoded plain value as DCP's planner takes a bytes item: ``torch.save``'s bytes.
    The value holds only plain types (built by the plain-data decoder, not unpickled),
    so the planner's ``torch.load`` of them rebuilds those types and runs nothing else."""
    blob = io.BytesIO()
    torch.save(value, blob)
    blob.seek(0)
    return blob


def _read_box(reader: VersionReader, item: ReadItem, name: str, target: torch.Tensor) -> None:
    index, offsets, lengths = item.storage_index, item.storage_offsets, item.lengths
    entry = reader.entry(name)
    assert isinstance(entry, TensorEntry)
    shard = find_shard(entry, index.offset or ())
    dtype = torch_dtype(entry.dtype)
    if target.dtype != dtype or tuple(target.shape) != tuple(lengths):
        raise InvalidInputError(f"{index.fqn}: the plan reads a {entry.dtype} box of"
                                f" {list(lengths)}, the planner gave a {target.dtype} tensor of"
                                f" {list(target.shape)} to read it into")
    direct = target.device.type == "cpu" and not target.is_conj() and not target.is_neg()
    host = target if direct else torch.empty(tuple(lengths), dtype=dtype)
    array, _ = as_array(host)
    reader.get_box(name, shard, tuple(offsets), tuple(lengths), array)
    if not direct:
        target.copy_(host)
