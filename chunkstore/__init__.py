"""chunkstore: an incremental, content-addressed, crash-safe store for training checkpoints.

>>> import chunkstore
>>> store = chunkstore.open("ckpts/")
>>> with store.new_version(run="exp1", step=100) as v:
...     v.put("model.w", array)
"""

from chunkstore import errors
from chunkstore.read.reader import VersionReader
from chunkstore.store import Store, VersionInfo, open
from chunkstore.write.writer import VersionWriter

__version__ = "0.1.0"
__all__ = ["Store", "VersionInfo", "VersionReader", "VersionWriter", "errors", "open"]
