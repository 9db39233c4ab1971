"""Build the frozen encrypted store that pins docs/format.md §13 (``tests/data/encrypted-v3``,
store version 13: each pack member sealed on its own; ``encrypted-v1``, store version 10,
and ``encrypted-v2``, store version 12, were built by this tool before and are read,
never rebuilt).

Two versions of the format fixture's arrays and plain data (tools/make_format_fixture.py)
saved into an encrypted store, and a tag.  Every random byte (the master key, the key
object's salt and nonce, every write's salt) comes from a seeded BLAKE3 stream, and
the clock is fixed, so the tool run twice writes the same bytes: tests/test_encryption.py
rebuilds it and compares, and reads the frozen copy back with :data:`PASSWORD`.  The
key object uses the real scrypt parameters (``n=2**16``), as a new store's does.

``<name>.expected.json`` records the password, the master key (a test key: never
a real store's), the versions, what each entry reads back as, and the BLAKE3 of every
stored file.  Never regenerate an existing fixture after a format change: build
``--name encrypted-v4`` and keep the old ones.

Usage (from the repository root)::

    python tools/make_encrypted_fixture.py [--name encrypted-v3] [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import blake3
import numpy as np

import chunkstore
from chunkstore.format import plaindata
from chunkstore.objects import crypto
from chunkstore.protocol import audit

TOOLS = Path(__file__).resolve().parent
DATA_DIR = TOOLS.parent / "tests" / "data"
PASSWORD = "chunkstore fixture password"
SEED = b"chunkstore encrypted fixture v1"
RUN, TAG = "enc", "best"
START = 1_800_000_000.0
CHUNK_SIZE = 128 * 1024
#: The fixture today's writer rebuilds byte for byte.
FIXTURE = "encrypted-v3"


def _format_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_format_fixture",
                                                  TOOLS / "make_format_fixture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def reproducible() -> Iterator[None]:
    """Random bytes from a seeded BLAKE3 stream, and a clock that ticks a millisecond a call."""
    counter = itertools.count()
    clock = itertools.count()

    def stream(length: int) -> bytes:
        return blake3.blake3(SEED + next(counter).to_bytes(8, "big")).digest(length=length)

    # Without audit events (docs/format.md §16, later than the fixture): they would
    # draw from the stream and the clock, and the fixture pins §13's sealing, not them.
    with mock.patch.object(crypto, "random_source", stream), \
            mock.patch("time.time", lambda: START + next(clock) / 1000), \
            mock.patch.object(audit, "record", lambda *args, **fields: ""):
        yield


def build(root: Path) -> dict[str, Any]:
    """Write the fixture store at ``root``; what a reader must get out of it."""
    tool = _format_tool()
    arrays, data = tool.arrays_v1(), tool.data_v1()
    # Incompressible and larger than a segment: a standalone chunk of three segments.
    arrays["big.noise"] = tool._noise(200_000, b"big")
    versions = []
    with reproducible(), chunkstore.open(root, create=True, encrypt=True, password=PASSWORD,
                                         chunk_size=CHUNK_SIZE, threads=1, pack_size=16 * 1024,
                                         delta_depth=3) as store:
        store.pack_delta_chunks = False  # chunks of larger tensors: objects of their own
        for step in (1, 2):
            with store.new_version(run=RUN, step=step) as version:
                for name, array in arrays.items():
                    version.put(name, array)
                for name, value in data.items():
                    version.put_data(name, value)
            versions.append({"id": version.info.id, "step": step, "tensors": {
                name: tensor_hash(array) for name, array in arrays.items()},
                "data": {name: plaindata.to_tree(value) for name, value in data.items()}})
            arrays, data = tool.version_2(arrays, data)
        store.tag(f"{RUN}@1", TAG)
        master, _ = _unlock(store)
    shutil.rmtree(root / "index")
    return {"password": PASSWORD, "master_key": master.hex(), "run": RUN, "tag": TAG,
            "versions": versions, "files": files_of(root)}


def tensor_hash(array: np.ndarray) -> str:
    """The BLAKE3 of an array's bytes as a store reads them back (little-endian)."""
    return blake3.blake3(np.ascontiguousarray(
        array, dtype=array.dtype.newbyteorder("<")).tobytes()).hexdigest()


def _unlock(store: chunkstore.Store) -> tuple[bytes, str]:
    from chunkstore.objects.keys import unlock
    assert store.config.encryption is not None
    return unlock(store.objects, store.url, store.config.identity(), PASSWORD,
                  store.config.encryption.sealing)


def files_of(root: Path) -> dict[str, str]:
    """The BLAKE3 of every stored file (the index, read leases and publication markers,
    named by the real clock, aside)."""
    return {p.relative_to(root).as_posix(): blake3.blake3(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()
            and p.relative_to(root).parts[0] not in ("index", "readers", "published")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=FIXTURE)
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    root = args.out / args.name
    if root.exists():
        if not args.force:
            print(f"{root} exists: a frozen fixture is never rebuilt (pass --force only for"
                  " the same format)", file=sys.stderr)
            return 1
        shutil.rmtree(root)
    expected = build(root)
    (args.out / f"{args.name}.expected.json").write_text(
        json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {root} ({len(expected['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
