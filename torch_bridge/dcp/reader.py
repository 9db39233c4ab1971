"""The DCP ``StorageReader`` half of :mod:`torch_bridge.dcp.writer` (import it from there)."""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import weakref
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
from chunkstore.read.reader import BoxRequest
from torch_bridge.capture.tensors import as_array, torch_dtype
from torch_bridge.dcp.layout import (
    METADATA_ENTRY,
    StoredItems,
    StoreHandle,
    StoreLike,
    open_options,
)
from torch_bridge.errors import NotACheckpointError, PickleRefusedError

#: Host copies (of boxes whose tensors the store cannot fill in place: on a GPU,
#: conjugate or negative views) a rank's read gathers before it reads them, in bytes
#: (so at most this and one box more at once).
HOST_COPY_BYTES = 256 << 20


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
    error; the store stays open for the load's ``read_data``, which closes it
    (``close()`` does too; a later load by this reader opens it again).  Every
    tensor read is hash-verified; a resharding read reads only the chunks that
    hold the boxes it needs, those of all the rank's boxes in one round of the
    store's pool.

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
        """Resolve the selector and read DCP's metadata.  The store stays open for the
        load's ``read_data``, which closes it (so does ``close``, or collecting this
        reader); on an error it is closed now."""
        try:
            self._version: VersionReader | None = None
            self.info, self._items, self._version = self._resolve()
        except BaseException:
            self._handle.release()
            raise

    def _resolve(self) -> tuple[VersionInfo, StoredItems, VersionReader]:
        store = self._handle.open(create=False)
        reader = store.open_version(self.selector)
        entries = reader.entries()
        leaf = entries.get(METADATA_ENTRY)
        if not isinstance(leaf, DataEntry):
            raise NotACheckpointError(
                f"version {reader.info.short_id} ({reader.info.run}@{reader.info.step}) holds"
                " no DCP checkpoint (no _dcp.metadata entry); load it with"
                " torch_bridge.Checkpointer or chunkstore's own reader")
        return reader.info, StoredItems(leaf, reader.get_data(METADATA_ENTRY), entries), reader

    def _opened_version(self) -> VersionReader:
        """The resolved version, on the store ``_load`` left open, or (a later load by
        this reader) on the store opened again."""
        version, self._version = self._version, None
        if version is None or self._handle.store is None:
            version = self._handle.open(create=False).open_version(self.info.id)
        return version

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
            reader = self._opened_version()
            boxes: list[_Box] = []
            held = 0  # bytes of the boxes' host copies
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
                    boxes.append(_Box(reader, item, name,
                                      planner.resolve_tensor(item).detach()))
                    held += boxes[-1].host_bytes
                    if held >= HOST_COPY_BYTES:
                        _read_boxes(reader, planner, boxes)
                        boxes, held = [], 0
            _read_boxes(reader, planner, boxes)
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


def _read_boxes(reader: VersionReader, planner: LoadPlanner, boxes: list[_Box]) -> None:
    """Read ``boxes`` and hand each to the planner.  One call for them all: their chunks
    are read in one round of the store's pool (locally a thread per core; from S3 a
    request per thread in flight), not a round per box."""
    reader.get_boxes([box.request for box in boxes])
    for box in boxes:
        box.finish()
        planner.commit_tensor(box.item, box.target)


class _Box:
    """A tensor item of a rank's plan: the box of a stored shard it reads, checked
    against the tensor the planner gave, and where it is read to (that tensor, or a
    host copy of it copied over after the read)."""

    def __init__(self, reader: VersionReader, item: ReadItem, name: str,
                 target: torch.Tensor) -> None:
        index, lengths = item.storage_index, tuple(item.lengths)
        entry = reader.entry(name)
        assert isinstance(entry, TensorEntry)
        dtype = torch_dtype(entry.dtype)
        if target.dtype != dtype or tuple(target.shape) != lengths:
            raise InvalidInputError(f"{index.fqn}: the plan reads a {entry.dtype} box of"
                                    f" {list(lengths)}, the planner gave a {target.dtype}"
                                    f" tensor of {list(target.shape)} to read it into")
        self.item, self.target = item, target
        direct = target.device.type == "cpu" and not target.is_conj() and not target.is_neg()
        self.host = target if direct else torch.empty(lengths, dtype=dtype)
        self.host_bytes = 0 if direct else self.host.nbytes
        array, _ = as_array(self.host)
        self.request: BoxRequest = (name, find_shard(entry, index.offset or ()),
                                    tuple(item.storage_offsets), lengths, array)

    def finish(self) -> None:
        """After the read: the host copy into the planner's tensor, where there is one."""
        if self.host is not self.target:
            self.target.copy_(self.host)
