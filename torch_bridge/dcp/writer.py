"""torch.distributed.checkpoint storage on chunkstore: many ranks, one deduplicated version.

>>> import torch.distributed.checkpoint as dcp
>>> from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter
>>> dcp.save(state_dict, storage_writer=ChunkStoreWriter("ckpts/", run="exp1", step=100))
>>> dcp.load(state_dict, storage_reader=ChunkStoreReader("ckpts/", "exp1@latest"))

Every rank chunks, hashes and writes its own shards through chunkstore's
chunk pipeline (deduplication, put-if-absent, the GC fence and claims all
apply) and hands the coordinator its chunk lists; the coordinator publishes
ONE version whose tensor entries name every rank's shards and whose
``_dcp.metadata`` entry holds DCP's ``Metadata`` as plain data (layout:
:mod:`torch_bridge.dcp.layout`).  DCP's planner does the rest, resharding
included: a save at world size 4 loads at 2, or in one process without a
process group.

The commit protocol.  DCP calls, in this order: ``set_up_storage_writer`` and
``prepare_local_plan`` (every rank), ``prepare_global_plan`` (coordinator),
``write_data`` (every rank, once the global plan has been scattered to it),
``finish`` (coordinator, once every rank's results have been gathered).

1. ``prepare_global_plan``, on the coordinator: check that every rank saves
   the same ``RUN@STEP`` (else the save fails, naming the ranks), then open
   the version: its store session object (``sessions/<id>``) is stored and
   the GC journal read, before the plans go back to the ranks.  DCP sends
   them only when this returns, so the session exists before any rank takes
   a deduplication decision.  Each plan carries the RUN@STEP and the GC
   entries the session lists as seen (``gc_seen``): a rank's write depends on
   this step;
2. ``write_data``, on every rank: a writer of its own (its own session, GC
   journal read, index claims), fenced only by the ``gc_seen`` entries
   (:meth:`VersionWriter.follow_publisher`), writes the rank's items: each
   tensor's local box, each bytes item as ``uint8``.  It waits for every
   chunk, makes them durable (``flush``), ends its sessions and returns, per
   item, the shard (offsets, sizes, chunk size, digests, delta bases, and
   the pack, offset and length of each chunk it packed), the dtype, the
   global shape and the chunk objects it wrote (packs included), as plain
   data (:class:`StagedShard`).  Nothing is published: what it wrote is
   orphaned;
3. ``finish``, on the coordinator: build the entries from the results, then
   claim every chunk object (a packed chunk's pack, and listed bases) through
   the path a deduplication hit
   takes (:meth:`VersionWriter.adopt`: the fence of the session from step 1,
   the index claim, an existence check); a chunk that is missing fails the
   save (:class:`StagedChunkMissingError`) and nothing is published.  Then
   the metadata entry (and, from a save by several ranks, the record of which
   rank wrote each shard: :class:`chunkstore.format.shards.ShardRanks`), the nodes,
   one flush and the commit record, refused
   if the session's heartbeat lapsed for half the lease (a GC elsewhere may
   have counted it dead).  The session object goes last.

Why no GC deletes a chunk this version names (the GC side is argued in
:mod:`chunkstore.maintenance.gc`: a GC deletes only after storing its fenced journal
entry and waiting until every live session that does not list the entry as
seen has ended).  Take any GC journal entry E naming a chunk X that a rank
reuses or writes, and let R be the coordinator's journal read of step 1:

- E stored after R (not visible to it): E's GC finds the coordinator's
  session stored and not listing E, so it waits for it; the session lives,
  by its heartbeat, until the commit record exists; then the GC marks again,
  reaches X through the new version and keeps it.  Such an entry does not
  fence the ranks (waiting for it would wait for the coordinator, which
  waits for the ranks);
- E active at R: the session lists E as seen and its GC does not wait for
  the save.  But every rank reads the journal after R, sees E (active or
  finished; entries stay a week) and, being fenced by it, never reuses X
  unwritten and writes X only once E is finished, so E does not delete that
  copy; at ``finish`` the coordinator waits for E too and then requires X to
  exist;
- E finished at R: its objects are no longer dedup targets of any index that
  read it (each rank reads it too); a rank writes X, keeping an existing
  copy only after it decodes and hashes to its key.

A rank killed anywhere publishes nothing: the coordinator never reaches
``finish`` (DCP fails the collective); its session ends with its process,
its next save or :meth:`ChunkStoreWriter.close`, and GC removes the orphans
after the grace period.  A coordinator killed before the commit record
publishes nothing either; after it, the version is complete: every chunk
was durable before the ranks returned, and every node before the record.

Non-tensor values (DCP's bytes items) are plain data, never pickle: the writer
takes each value from the planner before DCP's default planner would
``torch.save`` it (``lookup_object``), stores it in chunkstore's safe encoding
(numbers, strings, bytes, None, bools, lists, tuples, dicts: docs/format.md
§6.3) and ships it to the coordinator in the write result; the coordinator
stores it as a data entry.  Anything else is refused
(:class:`~torch_bridge.errors.PickleRefusedError`, naming the value) unless
``allow_pickle=True``, which stores DCP's pickled blob as before, for
:class:`ChunkStoreReader` with ``allow_pickle=True`` to load.  The metadata is
plain data too.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

try:
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
except ImportError:  # a torch without async staging has no dcp.async_save to stage for
    class BlockingAsyncStager:  # type: ignore[no-redef]
        def __init__(self) -> None:
            pass

from chunkstore import Store, VersionInfo
from chunkstore.errors import InvalidInputError, NotSerializableError, UnsupportedDtypeError
from chunkstore.format import plaindata
from chunkstore.format.dtypes import element_size
from chunkstore.format.names import check_label
from chunkstore.format.records import MAX_COUNT
from chunkstore.format.shards import RANKS_ENTRY, ShardRanks, StagedShard
from chunkstore.objects.signing import PrivateKeyLike, signing_key
from torch_bridge.capture.tensors import as_array, check_storable, host_copy
from torch_bridge.dcp.layout import (
    METADATA_ENTRY,
    PLAIN_RESULT,
    StoreHandle,
    StoreLike,
    VersionLayout,
    item_key,
    open_options,
)
from torch_bridge.dcp.reader import HandleOwner
from torch_bridge.distributed.sharded import Box, stage_boxes
from torch_bridge.errors import PickleRefusedError

__all__ = ["ChunkStoreWriter"]


class ChunkStoreWriter(HandleOwner, StorageWriter, BlockingAsyncStager):
    """A DCP ``StorageWriter`` that publishes each save as one chunkstore version.

    ``store`` is a path, an fsspec URL (created when absent) or an open
    :class:`chunkstore.Store` (pass it when this process holds the store open
    already: an index is opened once per process); a store named by URL is
    opened for each save and closed after it.  Every rank names the same
    store, ``run`` and ``step`` (checked).  ``meta`` is plain data kept in the
    commit record.  ``replace`` publishes over an existing version of the
    same step.  After a save, :attr:`info` (coordinator only) describes the
    published version.  DCP saves store no XOR-deltas (a box's chunks are
    deduplicated, never delta-encoded).  ``dcp.async_save`` stages through
    ``BlockingAsyncStager`` (as torch's own ``FileSystemWriter`` does): torch's
    default stager copies with ``set_``, which drops conjugate and negative views.

    Non-tensor values must be plain data (None, bool, int, float, str, bytes,
    list, tuple, dict): they are stored in chunkstore's safe encoding, so loading
    runs no code.  Any other value raises
    :class:`~torch_bridge.errors.PickleRefusedError` unless ``allow_pickle=True``
    (it is then stored as DCP's pickled blob, which only a
    ``ChunkStoreReader(..., allow_pickle=True)`` loads).

    ``sign_with`` (a key file or loaded key, as for ``Store.new_version``): the
    coordinator publishes the version signed (docs/format.md §14).
    """

    def __init__(self, store: StoreLike, *, run: str, step: int,
                 meta: dict[str, Any] | None = None, replace: bool = False,
                 storage_options: dict[str, Any] | None = None,
                 index_dir: str | None = None, allow_pickle: bool = False,
                 sign_with: PrivateKeyLike | None = None) -> None:
        super().__init__()
        BlockingAsyncStager.__init__(self)
        self.run = check_label(run, "run name")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT:
            raise InvalidInputError(f"step must be a non-negative int below 2**63, got {step!r}")
        if meta is not None and not isinstance(meta, dict):
            raise InvalidInputError(f"meta must be a dict of plain data, got {type(meta).__name__}")
        self.step = step
        self.meta = dict(meta or {})
        self.replace = replace
        self.allow_pickle = allow_pickle
        #: the coordinator signs the version it publishes (docs/format.md §14); loaded now,
        #: so a bad key file fails before the save starts
        self._signing_key = None if sign_with is None else signing_key(sign_with)
        self._use(StoreHandle(store, open_options(storage_options, index_dir)))
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self.info: VersionInfo | None = None

    # --- what DCP calls --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._handle.release()
        self._switch(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._handle.url, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidInputError("ChunkStoreWriter publishes one version per save from the"
                                    " coordinator; save with use_collectives=True")
        self._handle.release()  # what a save of this writer that never finished left open
        self.is_coordinator = is_coordinator
        self.info = None
        self._handle.open(create=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=self._token())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Step 1: check the ranks agree, then store the save's session (see above)."""
        token = self._token()
        others = [rank for rank, plan in enumerate(plans) if plan.storage_data != token]
        if others:
            raise InvalidInputError(
                f"ranks {others} save {[plans[r].storage_data for r in others]}, the"
                f" coordinator {token}: every rank must save the same run and step")
        self._handle.abort_version()
        version = self._handle.open(create=True).new_version(
            self.run, self.step, self.meta, replace=self.replace, sign_with=self._signing_key)
        self._handle.version = version
        planned = {**token, "gc_seen": version.gc_entries_seen}
        return [dataclasses.replace(plan, storage_data=planned) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Step 2: store this rank's items, publish nothing, report the chunks."""
        planned = plan.storage_data
        if not isinstance(planned, dict) or not isinstance(planned.get("gc_seen"), list) \
                or {k: v for k, v in planned.items() if k != "gc_seen"} != self._token():
            raise InvalidInputError("this plan was not prepared by ChunkStoreWriter's"
                                    " prepare_global_plan for this run and step")
        try:
            store = self._handle.open(create=True)
            results = _write_items(store, self.run, self.step, plan.items, planner,
                                   planned["gc_seen"], self.allow_pickle)
        except BaseException:
            self._handle.release()  # the coordinator's version too: finish() will not come
            raise
        if not self.is_coordinator:
            self._handle.release()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Step 3: claim every rank's chunks, then commit one version."""
        version, self._handle.version = self._handle.version, None
        if version is None:
            raise InvalidInputError("finish() without prepare_global_plan() on this writer"
                                    " (DCP calls both on the coordinator)")
        try:
            staged, plain = {}, {}
            for per_rank in results:
                for r in per_rank:
                    key = item_key(r.index.fqn, r.index.offset)
                    if isinstance(r.storage_data, dict) and PLAIN_RESULT in r.storage_data:
                        plain[key] = plaindata.decode(r.storage_data[PLAIN_RESULT])
                    else:
                        staged[key] = StagedShard.from_plain(r.storage_data)
            # DCP gathers the results in rank order: the writer of each item.
            writers = {item_key(r.index.fqn, r.index.offset): rank
                       for rank, per_rank in enumerate(results) for r in per_rank}
            layout = VersionLayout(metadata, staged, writers, plain)
            version.adopt(layout.tensors, layout.written.values())
            for name, value in layout.data.items():
                version.put_data(name, value)
            version.put_data(METADATA_ENTRY, layout.plain)
            if len(results) > 1:
                version.put_data(RANKS_ENTRY, ShardRanks(len(results), layout.ranks).to_plain())
            self.info = version.commit()
        except BaseException:
            version.abort()
            raise
        finally:
            self._handle.release()

    def close(self) -> None:
        """Abort a save that never finished and close a store opened here."""
        self._handle.release()

    def _token(self) -> dict[str, Any]:
        return {"chunkstore": 1, "run": self.run, "step": self.step}


def _write_items(store: Store, run: str, step: int, items: list[WriteItem],
                 planner: SavePlanner, gc_seen: list[str], allow_pickle: bool
                 ) -> list[WriteResult]:
    """Store the items' chunks, publish nothing, and describe each item for the
    coordinator: a tensor's (or pickled value's) shard, or a plain value, encoded."""
    boxes, boxed, results = [], [], {}
    for n, item in enumerate(items):
        if item.type == WriteItemType.BYTE_IO:
            encoded = _plain_value(item, planner, allow_pickle)
            if encoded is not None:
                results[n] = WriteResult(index=item.index, size_in_bytes=len(encoded),
                                         storage_data={PLAIN_RESULT: encoded})
                continue
        array, override = _as_array(item, planner.resolve_data(item))
        box = Box(f"i{n}", array, override)
        if item.tensor_data is not None:  # a tensor's box, placed in the global shape
            box = dataclasses.replace(box, shape=tuple(item.tensor_data.size),
                                      offsets=tuple(item.tensor_data.chunk.offsets))
        boxes.append(box)
        boxed.append(n)
    for n, shard in zip(boxed, stage_boxes(store, run, step, boxes, gc_seen), strict=True):
        results[n] = WriteResult(index=items[n].index, size_in_bytes=shard.shard.nbytes(
            element_size(shard.dtype)), storage_data=shard.to_plain())
    return [results[n] for n in range(len(items))]


def _plain_value(item: WriteItem, planner: SavePlanner, allow_pickle: bool) -> bytes | None:
    """A non-tensor value in the safe plain-data encoding, taken from the planner before
    DCP's default planner would pickle it; None when it is to be stored pickled (only with
    ``allow_pickle``); PickleRefusedError otherwise."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)  # DefaultSavePlanner and subclasses
    if not callable(lookup):
        if allow_pickle:
            return None
        raise PickleRefusedError(fqn, f"{fqn}: the planner {type(planner).__name__} hands"
                                 " non-tensor values over only pickled (it has no"
                                 " lookup_object); pass allow_pickle=True to ChunkStoreWriter"
                                 " (and to ChunkStoreReader to load them) to store them so")
    value = lookup(item.index)
    try:
        return plaindata.encode(value)
    except NotSerializableError as exc:
        if allow_pickle:
            return None
        where = "" if exc.path == "$" else f" (at {exc.path.removeprefix('$')}:" \
            f" a {exc.type_name})"
        raise PickleRefusedError(fqn, f"{fqn} is a {type(value).__name__}{where}, not plain"
                                 " data; storing it needs pickle, and loading a pickle runs"
                                 " code, so it is refused: convert it to plain data (None,"
                                 " bool, int, float,"
                                 " str, bytes, list, tuple, dict), or pass allow_pickle=True"
                                 " to ChunkStoreWriter (and to ChunkStoreReader to load"
                                 " it)") from exc


def _as_array(item: WriteItem, data: object) -> tuple[np.ndarray, str | None]:
    """What the planner resolved an item to, as an array to store (and its dtype name)."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidInputError(f"{item.index.fqn}: the planner resolved a bytes item to"
                                    f" {type(data).__name__}, not BytesIO")
        return np.frombuffer(data.getvalue(), dtype=np.uint8), None
    return as_array(_host_tensor(item, data))


def _host_tensor(item: WriteItem, data: object) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise InvalidInputError(f"{item.index.fqn}: the planner resolved a tensor item to"
                                f" {type(data).__name__}")
    problem = check_storable(data)
    if problem is not None:
        raise UnsupportedDtypeError(str(data.dtype), f"{item.index.fqn}: {problem}")
    tensor = host_copy(data)
    assert item.tensor_data is not None
    if tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes):
        raise InvalidInputError(f"{item.index.fqn}: the planner resolved a tensor of shape"
                                f" {list(tensor.shape)} for a box of sizes"
                                f" {list(item.tensor_data.chunk.sizes)}")
    return tensor
