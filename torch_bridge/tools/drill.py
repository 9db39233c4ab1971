"""``python -m torch_bridge.tools.drill STORE [SELECTOR]``: the restore process of
``chunkstore drill`` when torch_bridge is importable, materializing every tensor entry
as a torch tensor (chunkstore itself never imports torch).  Prints one JSON line, the
restore's report (:mod:`chunkstore.maintenance.drillrestore`).  A URL store is opened
with the storage options in ``CHUNKSTORE_STORAGE_OPTIONS`` (where the drill puts the
command line's)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

import torch

from chunkstore.cli.common import CliError, open_any
from chunkstore.errors import ChunkStoreError
from chunkstore.format.manifest import TensorEntry
from chunkstore.maintenance.drillrestore import restore, trust_from_env
from chunkstore.read.reader import VersionReader
from torch_bridge.capture.tensors import as_array, torch_dtype


def read_tensor(reader: VersionReader, name: str) -> torch.Tensor:
    """Entry ``name`` read straight into a new CPU tensor of its dtype and shape."""
    entry = reader.entry(name)
    assert isinstance(entry, TensorEntry)
    tensor = torch.empty(tuple(entry.shape), dtype=torch_dtype(entry.dtype))
    array, stored_as = as_array(tensor)
    reader.get_into(name, array, dtype=stored_as)
    return tensor


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m torch_bridge.tools.drill STORE [SELECTOR]", file=sys.stderr)
        return 2
    started = time.monotonic()  # the interpreter and the imports are the startup phase
    try:
        with open_any(args[0], create=False) as store:
            report = restore(store, args[1] if len(args) > 1 else None,
                             materialize=read_tensor, materialized_as="torch",
                             started=started, trust=trust_from_env())
    except CliError as exc:  # CHUNKSTORE_STORAGE_OPTIONS that is not a JSON object
        print(f"chunkstore: error: {exc.format_message()}", file=sys.stderr)
        return 2
    except ChunkStoreError as exc:
        print(f"chunkstore: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()))
    return 0 if report.ok else 3


if __name__ == "__main__":
    sys.exit(main())
