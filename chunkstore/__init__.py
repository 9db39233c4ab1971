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
from chunkstore.maintenance.repair import RepairResult, repair_locations
from chunkstore.maintenance.sync import SyncResult, TagConflict, sync_locations
from chunkstore.progress import Progress
from chunkstore.read.reader import VersionReader
from chunkstore.store import Store, VersionInfo, check_sync_locations, open
from chunkstore.write.writer import VersionWriter

__version__ = "0.1.0"
__all__ = ["RepairResult", "Store", "SyncResult", "TagConflict", "VersionInfo",
           "VersionReader", "VersionWriter", "errors", "open", "repair", "sync"]


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
    check_sync_locations(src, dst)
    return sync_locations(src, dst, selectors, opener=open, dry_run=dry_run, verify=verify,
                          src_options=src_options, dst_options=dst_options,
                          progress=progress)



def repair(store: str | os.PathLike[str] | Store, source: str | os.PathLike[str] | Store,
           selectors: Sequence[str] = (), *, dry_run: bool = False,
           store_options: dict[str, Any] | None = None,
           source_options: dict[str, Any] | None = None,
           progress: Progress | None = None) -> RepairResult:
    """Rewrite what is missing or damaged in ``store`` from ``source``'s checked bytes.

    Every object the selected versions need (every version when ``selectors`` is empty)
    is checked as a read checks it; one that is missing or fails is replaced by
    ``source``'s object of the same key once that passed the same check there; nothing
    that passes is replaced.  ``result.fixed`` and ``result.unfixed`` name the objects,
    ``result.problems_after`` what a verify of the versions still finds (``result.ok``:
    none).  ``dry_run`` checks and changes nothing.  See docs/recovery.md.
    """
    return repair_locations(_location(store, "store"), _location(source, "source"),
                            selectors, opener=open, dry_run=dry_run,
                            store_options=store_options, source_options=source_options,
                            progress=progress)


def _location(where: object, what: str) -> str | Store:
    if isinstance(where, Store):
        return where
    if isinstance(where, (str, os.PathLike)):
        text = os.fspath(where)
        if isinstance(text, str):
            return text
    raise errors.InvalidInputError(f"repair's {what} is {where!r}: give a path, a URL or an"
                                   " open store")
