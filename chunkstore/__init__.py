"""chunkstore: an incremental, content-addressed, crash-safe store for training checkpoints.

>>> import chunkstore
>>> store = chunkstore.open("ckpts/", create=True)
>>> with store.new_version(run="exp1", step=100) as v:
...     v.put("model.w", array)
"""

from __future__ import annotations

# isort: off
# First, before the slow imports: a Ctrl-C while the `chunkstore` command starts is one
# line and exit 130 (chunkstore.interrupts; the command's own process only).
from chunkstore import interrupts  # noqa: F401
# isort: on

import os
from collections.abc import Sequence
from typing import Any

from chunkstore import errors
from chunkstore.maintenance.sync import SyncResult, TagConflict, sync_locations
from chunkstore.progress import Progress
from chunkstore.read.reader import VersionReader
from chunkstore.store import Store, VersionInfo, open
from chunkstore.write.writer import VersionWriter

__version__ = "0.1.0"
__all__ = ["Store", "SyncResult", "TagConflict", "VersionInfo", "VersionReader",
           "VersionWriter", "errors", "open", "sync"]


def sync(src: str | os.PathLike[str] | Store, dst: str | os.PathLike[str] | Store,
         selectors: Sequence[str] = (), *, dry_run: bool = False, verify: bool = False,
         src_options: dict[str, Any] | None = None, dst_options: dict[str, Any] | None = None,
         progress: Progress | None = None) -> SyncResult:
    """Copy versions from store ``src`` into store ``dst`` (paths, URLs or open stores).

    ``selectors`` name the versions (any selector; none: every version); only what
    ``dst`` lacks travels, commit records last, so the versions keep their ids and a
    killed sync publishes nothing partial.  ``dst`` is created with ``src``'s settings
    when absent.  Tags of the copied versions travel unless ``dst`` has the name for
    another version (``result.conflicts``).  ``dry_run`` changes nothing and says what
    would be copied; ``verify`` reads every copied version back, hash-checked.
    ``src_options`` / ``dst_options`` are fsspec storage options (see :func:`open`).
    See docs/recovery.md.
    """
    return sync_locations(src, dst, selectors, opener=open, dry_run=dry_run, verify=verify,
                          src_options=src_options, dst_options=dst_options,
                          progress=progress)

