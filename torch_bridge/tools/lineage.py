"""The lineage file of an export artifact: where its weights came from and what was done.

One JSON object (``lineage.json`` in the artifact directory, signed with the weights
by ``chunkstore export --sign``), its fields in this order:

- ``format``, ``format_version``: ``chunkstore.export-lineage``, 1.
- ``source``: the store's URL, the version's id, run, step, creation time and root
  node, and ``parents``: its parent, that one's parent and so on (nearest first, at
  most :data:`MAX_PARENTS`, as far as the store still holds them; a removed one is
  listed by id with ``"removed": true`` and ends the list; ``parents_cut`` says the
  chain goes on past the limit).
- ``code`` and ``dataset``: the code revision (``code_rev``, ``code_dirty``, or why it
  is unknown) and the dataset identity the version's metadata records (what the
  Checkpointer's provenance captured, or ``meta={"dataset": ...}``); null where the
  version has none.
- ``saved_with``: the environment the version was saved in (python, torch, numpy,
  chunkstore, host, world size, CUDA), as far as its metadata records it.
- ``meta``: the version's whole metadata.
- ``environment``: the exporting environment (python, platform, torch, safetensors,
  chunkstore, model-signing).
- ``export``: the weights file, the prefix taken, the tensor count, the dtype cast
  (null for none) and how many tensors it changed, and ``stripped``: what was left
  out, by the first part of the entry names (``optimizer``, ``rng``, ...), with counts
  of tensors and plain-data entries and their logical bytes.
- ``signature``: the signature file, its format and hash, the public key's SHA-256
  fingerprint; null for an unsigned artifact.

It holds nothing that differs between two exports of one version with the same
options and environment except ``exported`` (the time).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
from typing import Any

import chunkstore
from chunkstore import Store, VersionInfo
from chunkstore.errors import SelectorError
from chunkstore.format import plaindata
from torch_bridge.tools.export import ExportedTensors

LINEAGE_FORMAT = "chunkstore.export-lineage"
LINEAGE_FORMAT_VERSION = 1
#: How many ancestors the lineage names: enough to see a run's recent history, bounded
#: so that a run of 100,000 saves does not make a 100,000-entry file.
MAX_PARENTS = 16
#: The keys of the Checkpointer's provenance (torch_bridge.capture.provenance) that
#: describe the saving environment.
SAVED_WITH_KEYS = ("python", "torch", "numpy", "chunkstore", "host", "world_size", "cuda")
CODE_KEYS = ("code_rev", "code_dirty", "code_rev_unknown")


def parent_chain(store: Store, info: VersionInfo) -> tuple[list[dict[str, Any]], bool]:
    """``info``'s ancestors, nearest first, and whether the chain goes on past the limit."""
    parents: list[dict[str, Any]] = []
    parent = info.parent
    while parent is not None:
        if len(parents) == MAX_PARENTS:
            return parents, True
        try:
            found = store.resolve(parent)
        except SelectorError:  # removed (or never copied into this store)
            parents.append({"id": parent, "removed": True})
            break
        parents.append({"id": found.id, "run": found.run, "step": found.step})
        parent = found.parent
    return parents, False


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "safetensors": _version_of("safetensors"),
            "chunkstore": chunkstore.__version__, "model_signing": _version_of("model-signing")}


def build_lineage(store_url: str, exported: ExportedTensors,
                  parents: tuple[list[dict[str, Any]], bool], *, weights_file: str,
                  prefix: str, dtype: str | None,
                  signature: dict[str, Any] | None) -> dict[str, Any]:
    """The lineage object (see the module docstring) of one export."""
    info = exported.info
    meta = plaindata.to_tree(info.meta)
    assert isinstance(meta, dict)
    code = {key: meta[key] for key in CODE_KEYS if key in meta} or None
    return {
        "format": LINEAGE_FORMAT,
        "format_version": LINEAGE_FORMAT_VERSION,
        "exported": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {"store": store_url, "version": info.id, "run": info.run, "step": info.step,
                   "created": info.created_iso, "root": info.root.hex,
                   "parents": parents[0], "parents_cut": parents[1]},
        "code": code,
        "dataset": meta.get("dataset"),
        "saved_with": {key: meta[key] for key in SAVED_WITH_KEYS if key in meta},
        "meta": meta,
        "environment": environment(),
        "export": {"file": weights_file, "format": "safetensors", "prefix": prefix,
                   "tensors": len(exported.tensors), "dtype_cast": dtype,
                   "tensors_cast": exported.cast, "stripped": exported.left_out},
        "signature": signature,
    }
