"""A storage plugin for ``torch.distributed.checkpoint``: each DCP save is one chunkstore
version, each rank's shards deduplicated against the run's earlier saves.

>>> from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter
>>> dcp.save(state, storage_writer=ChunkStoreWriter("ckpts/", run="exp1", step=100))
>>> dcp.load(state, storage_reader=ChunkStoreReader("ckpts/", "exp1@latest"))

:mod:`.writer` (the save, and why it is safe with GC running anywhere), :mod:`.reader`
and :mod:`.layout` (how DCP's metadata and items map to entries).
"""

from torch_bridge.dcp.reader import ChunkStoreReader
from torch_bridge.dcp.writer import ChunkStoreWriter

__all__ = ["ChunkStoreReader", "ChunkStoreWriter"]
