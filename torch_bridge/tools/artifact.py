"""An export artifact: a directory holding the weights, their lineage and a signature.

::

    OUT/
      model.safetensors   the weights (torch_bridge.tools.export)
      lineage.json        where they came from and what was done (torch_bridge.tools.lineage)
      model.sig           the OpenSSF model-signing signature over both (with a key only)

How it is written, and why in this order:

1. The key is loaded and the target checked before the store is opened: a wrong
   password, a key of another type, a missing model-signing or an OUT that is taken
   is an error before anything is read or written.
2. The version is read (every tensor hash-checked) into memory.
3. Everything is written into ``OUT/../.NAME.export-XXXX/NAME``, a fresh hidden
   directory beside OUT (the same file system, so the move below is a rename), the
   signature last, then each file and the directory fsynced: a rename of unsynced
   files could survive a power cut with their data lost.
4. The directory is renamed to OUT, and OUT's parent fsynced.  A process killed before
   this leaves OUT untouched and the hidden directory behind (whose name says what it
   is; remove it), never an OUT that is missing a file.  The directory is signed
   under its final name, so the signature's subject names OUT.
5. With ``overwrite``, an existing artifact at OUT is first moved into the hidden
   directory and removed after the rename: between the two renames OUT is briefly
   absent, never half-written.  Only a file or a directory that holds nothing but an
   artifact's files is replaced; anything else at OUT is refused even with
   ``overwrite``, so a mistyped OUT cannot delete a directory of other files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore import Store
from chunkstore.errors import InvalidInputError
from torch_bridge.checkpointer import open_store
from torch_bridge.tools import lineage, signing
from torch_bridge.tools.export import (
    CAST_DTYPES,
    ExportedTensors,
    read_export,
    safetensors_metadata,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

WEIGHTS_FILE = "model.safetensors"
LINEAGE_FILE = "lineage.json"
ARTIFACT_FILES = frozenset({WEIGHTS_FILE, LINEAGE_FILE, signing.SIGNATURE_FILE})


def export_artifact(store: Store | str | os.PathLike[str], selector: str,
                    out_dir: str | os.PathLike[str], prefix: str = "model.",
                    dtype: str | None = None, *,
                    sign_with: str | os.PathLike[str] | None = None,
                    key_password: str | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Write version ``selector``'s tensors under ``prefix`` as an artifact directory.

    ``out_dir`` gets ``model.safetensors`` and ``lineage.json`` and, with
    ``sign_with`` (an ECDSA P-256/384/521 private key PEM file, decrypted with
    ``key_password``), ``model.sig``: an OpenSSF model-signing signature over both,
    which ``model_signing verify key`` accepts.  ``store``: a Store, a path or a URL.
    Returns a summary: version id, step, tensors, bytes, path, signed, the files.
    """
    from safetensors.torch import save_file  # missing: said before anything is read

    if dtype is not None and dtype not in CAST_DTYPES:
        raise InvalidInputError(f"dtype {dtype!r}: choose one of {', '.join(CAST_DTYPES)}")
    key = None
    if sign_with is not None:
        signing.require_model_signing()
        key = signing.load_signing_key(sign_with, key_password)
    out = Path(os.path.abspath(out_dir))
    _check_target(out, overwrite)
    exported, record = _read(store, selector, prefix, dtype, key)
    with _staging(out) as staged:
        save_file(exported.tensors, str(staged / WEIGHTS_FILE),
                  metadata=safetensors_metadata(exported.info))
        (staged / LINEAGE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if sign_with is not None and key is not None:
            signing.sign_directory(staged, sign_with, key_password, key)
        _sync_tree(staged)
        _move_into_place(staged, out, overwrite)
    info = exported.info
    return {"version": info.id, "step": info.step, "tensors": len(exported.tensors),
            "bytes": (out / WEIGHTS_FILE).stat().st_size, "path": str(out),
            "signed": key is not None, "files": sorted(p.name for p in out.iterdir())}


def _read(store: Store | str | os.PathLike[str], selector: str, prefix: str,
          dtype: str | None, key: ec.EllipticCurvePrivateKey | None
          ) -> tuple[ExportedTensors, dict[str, Any]]:
    """The version's tensors, and the lineage that describes them."""
    opened, owned = open_store(store, create=False)
    try:
        exported = read_export(opened, selector, prefix, dtype)
        parents = lineage.parent_chain(opened, exported.info)
        url = opened.url if "://" in opened.url else os.path.abspath(opened.url)
    finally:
        if owned:
            opened.close()
    described = signing.signature_description(key) if key is not None else None
    return exported, lineage.build_lineage(url, exported, parents, weights_file=WEIGHTS_FILE,
                                           prefix=prefix, dtype=dtype, signature=described)


def _check_target(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is read, an OUT that would land nowhere or clobber."""
    if not out.parent.is_dir():
        raise InvalidInputError(f"cannot write {out}: the directory {out.parent} does not"
                                " exist")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise InvalidInputError(f"{out} exists; pass --force (overwrite=True) to replace it")
    _check_replaceable(out)


def _check_replaceable(out: Path) -> None:
    if out.is_symlink() or not out.is_dir():
        return  # a file (or a link, itself replaced, never followed)
    others = sorted(p.name for p in out.iterdir() if p.name not in ARTIFACT_FILES)
    if others:
        raise InvalidInputError(
            f"{out} is a directory that holds more than an export artifact ({', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); --force replaces only an artifact: choose"
            " another OUT or remove it yourself")


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """``.NAME.export-XXXX/NAME`` beside ``out``, removed (with whatever it still holds)
    when the export ends, whether it succeeded or failed."""
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        staged = holder / out.name
        staged.mkdir()
        yield staged
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def _sync_tree(directory: Path) -> None:
    """Give the files the mode a plain open() would (safetensors writes 0600), and make
    them and their names durable."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)
        _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(staged: Path, out: Path, overwrite: bool) -> None:
    """Rename ``staged`` to ``out`` (see the module docstring, steps 4 and 5)."""
    replaced = staged.parent / ".replaced"
    if os.path.lexists(out):
        if not overwrite:  # appeared while exporting
            raise InvalidInputError(f"{out} appeared while exporting; pass --force"
                                    " (overwrite=True) to replace it")
        _check_replaceable(out)
        os.rename(out, replaced)
    try:
        # A directory put at OUT meanwhile fails the rename (it replaces only an empty one).
        os.rename(staged, out)
    except OSError as exc:
        if os.path.lexists(replaced):
            os.rename(replaced, out)  # the old artifact back where it was
        raise InvalidInputError(f"cannot move the artifact to {out}: {exc}") from None
    _fsync(out.parent)
