"""A moto S3 server that starts with a local store's objects already in a bucket:
``python -m benchmarks.moto_filled --source DIR --bucket NAME -H 127.0.0.1 -p PORT``.

Uploading a store to moto over HTTP runs at 70-140 objects a second on a shared
2-core machine: a store of a million objects would take hours.  This server
inserts the objects straight into moto's in-memory S3 backend before it answers
(12.5 s for 104,101 objects, 160 s for 1,004,101 read from a cold disk), then
serves HTTP like ``python -m moto.server`` in a process of its own: whatever is
measured against it still goes over HTTP, through s3fs, and the benchmark's
request counting.

Each file of the store (every file under ``--source`` but its ``index`` and the
benchmark's ``done``/``ready`` marks, as :func:`benchmarks.bench_scale.store_files`
chooses them for an upload) becomes the key ``--prefix``/its relative path, with
the size, ETag (MD5) and bytes of the file: to chunkstore the bucket is the store
it would find after an upload.  To keep a million keys in memory (moto's own key
holds 3.5 KiB besides its bytes, 7.5 GiB for a million 4 KiB objects), a filled key
(:class:`FilledKey`) holds its name, size and ETag only (about 550 bytes a key with
moto's tables: the server held 613 MiB filled with a million) and reads its bytes from
the file when asked (the files must stay in place while the server runs); every
other attribute comes from one template key of moto's own.  Keys written over
HTTP afterwards are moto's own.

``--sorted-listing``: the bucket's key names are also held sorted
(:class:`SortedKeys`) and a ListObjectsV2 request walks only its page of them
(:func:`list_page`), as S3 answers it.  moto's own listing gathers and sorts every
key in the bucket for every page it returns (``S3Backend.list_objects``): its
listing times follow the bucket, not the page.  The pages are the same, in the same
order, with the same continuation (tests/test_bench_scale.py compares them); the
request counts do not depend on it either way.  What stays is moto's rendering of a
page: 0.7-0.9 s for 1,000 keys on the shared machine, so a full listing of a million
objects (1,004 pages) took 502 s there.

Once filled it writes one JSON line to ``--report`` (keys inserted, seconds, the
resident memory then), then serves until terminated.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hashlib
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import FakeDeleteMarker, FakeKey, S3Backend, s3_backends
from moto.s3.utils import _VersionedKeyStore
from moto.server import ThreadedMotoServer

from benchmarks.bench_scale import Location, store_files

REGION = "us-east-1"
#: Sorts after every character a key name holds: ``folder + END`` bounds a folder's keys.
END = "\U0010ffff"


class FilledKey(FakeKey):
    """A key the fill inserted: name, size and ETag of its own, its bytes read from its
    file (``root``/the name less ``prefix``) when asked, the rest from ``template``."""

    # moto files each model class under the second part of its module's name, which
    # ``python -m`` makes __main__.
    __module__ = "benchmarks.moto_filled"
    root: ClassVar[Path]
    prefix: ClassVar[str]
    template: ClassVar[FakeKey]

    def __init__(self, name: str, size: int, etag: str) -> None:
        # FakeKey.__init__ is not called: it buffers the bytes and builds an ACL, a
        # lock and a metadata dict for each key (3.5 KiB a key before its bytes).
        self.name, self.contentsize, self._etag = name, size, etag

    def __getattr__(self, attribute: str) -> Any:  # only what the key does not hold
        return getattr(FilledKey.template, attribute)

    @property
    def value(self) -> bytes:  # type: ignore[override]
        return (self.root / self.name[len(self.prefix):]).read_bytes()

    def dispose(self, garbage: bool = False) -> None:
        """Nothing to release (no buffer of its own)."""


class SortedKeys(_VersionedKeyStore):
    """moto's key store of a bucket, its names also held sorted (``names``) for
    :func:`list_page`."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.lock = threading.Lock()

    def __setitem__(self, key: str, value: Any) -> None:
        with self.lock:
            if not dict.__contains__(self, key):
                bisect.insort(self.names, key)
            super().__setitem__(key, value)

    def setlist(self, key: Any, list_: Any) -> Any:
        with self.lock:
            if not dict.__contains__(self, key):
                bisect.insort(self.names, key)
            return super().setlist(key, list_)

    def pop(self, key: str) -> None:  # type: ignore[override]
        with self.lock:
            super().pop(key)
            del self.names[bisect.bisect_left(self.names, key)]

    def __delitem__(self, key: str) -> None:
        with self.lock:
            super().__delitem__(key)
            del self.names[bisect.bisect_left(self.names, key)]


_moto_list_objects_v2 = S3Backend.list_objects_v2


def list_page(backend: S3Backend, bucket: Any, prefix: str | None, delimiter: str | None,
              continuation_token: str | None, start_after: str | None, max_keys: int
              ) -> tuple[list[Any], bool, str | None]:
    """``S3Backend.list_objects_v2`` for a bucket of :class:`SortedKeys`: the keys and
    folders (common prefixes) after the continuation, up to ``max_keys``, found by
    bisection instead of a sort of the whole bucket; other buckets as moto lists them."""
    keys = bucket.keys
    if not isinstance(keys, SortedKeys):
        return _moto_list_objects_v2(backend, bucket, prefix, delimiter, continuation_token,
                                     start_after, max_keys)
    if max_keys == 0:
        return [], False, None
    after = (backend._pagination_tokens.get(continuation_token) if continuation_token
             else start_after)
    prefix = prefix or ""
    found: list[Any] = []
    with keys.lock:
        names = keys.names
        at = bisect.bisect_left(names, prefix)
        if after:
            at = max(at, bisect.bisect_right(names, after))
        while at < len(names) and len(found) <= max_keys:
            name = names[at]
            if not name.startswith(prefix):
                break
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                folder = prefix + rest.split(delimiter, 1)[0] + delimiter
                if not after or folder > after:
                    found.append(folder)
                at = bisect.bisect_left(names, folder + END)
                continue
            key = keys[name]
            if not isinstance(key, FakeDeleteMarker):
                found.append(key)
            at += 1
    truncated = len(found) > max_keys
    found = found[:max_keys]
    token = None
    if truncated:
        last = found[-1] if isinstance(found[-1], str) else found[-1].name
        token = hashlib.md5(last.encode()).hexdigest()
        backend._pagination_tokens[token] = last
    return found, truncated, token


def fill(source: Path, bucket_name: str, prefix: str, sorted_listing: bool) -> int:
    """A bucket named ``bucket_name`` holding ``source``'s files under ``prefix``."""
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    bucket = backend.create_bucket(bucket_name, REGION)
    if sorted_listing:
        bucket.keys = SortedKeys()
    FilledKey.root, FilledKey.prefix = source, f"{prefix}/"
    FilledKey.template = FakeKey(f"{prefix}/template", b"", DEFAULT_ACCOUNT_ID, REGION,
                                 bucket_name=bucket_name)
    files = store_files(source)
    for path in files:
        data = path.read_bytes()
        name = f"{prefix}/{path.relative_to(source).as_posix()}"
        bucket.keys[name] = FilledKey(name, len(data), hashlib.md5(data).hexdigest())
    return len(files)


def resident_mib(field: str = "VmRSS", pid: int | str = "self") -> float:
    """A process's resident memory now (``VmRSS``) or at its peak (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


#: Seconds a filled server may take to answer: the fill comes first (about 30 s a
#: million objects on a quiet machine).
FILL_TIMEOUT = 900.0


@contextlib.contextmanager
def filled_bucket(source: Path, sorted_listing: bool = False
                  ) -> Iterator[tuple[Location, dict[str, Any]]]:
    """A server of this module's in a process of its own, filled with ``source``'s store:
    the store's :class:`~benchmarks.bench_scale.Location` on it (with a copy of the
    store's index, removed afterwards) and the fill's figures.  Before it is yielded a
    listing of the store over HTTP must count every key inserted; once the block is
    done the figures gain the server's peak resident memory (``server_peak_rss_mib``)."""
    import s3fs

    from tests.s3server import _moto_process, storage_options
    scratch = Path(tempfile.mkdtemp(prefix="bench-scale-filled-"))
    bucket = f"filled-{uuid.uuid4().hex[:16]}"
    arguments = ["-m", "benchmarks.moto_filled", "--source", str(source), "--bucket", bucket,
                 "--report", str(scratch / "fill.json")]
    try:
        with _moto_process(arguments + ["--sorted-listing"] * sorted_listing,
                           FILL_TIMEOUT) as (endpoint, process):
            found = json.loads((scratch / "fill.json").read_text())
            options = storage_options(endpoint)
            started = time.perf_counter()
            found["listed"] = listed(s3fs.S3FileSystem(**options), bucket, "store/")
            found["list_seconds"] = round(time.perf_counter() - started, 1)
            if found["listed"] != found["inserted"]:
                raise RuntimeError(f"a listing of the filled bucket found {found['listed']}"
                                   f" objects, not the {found['inserted']} inserted")
            shutil.copytree(source / "index", scratch / "index")
            yield Location(f"s3://{bucket}/store", options, str(scratch / "index")), found
            found["server_peak_rss_mib"] = resident_mib("VmHWM", process.pid)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def listed(fs: Any, bucket: str, prefix: str) -> int:
    """How many keys a listing of ``prefix`` over HTTP counts, page by page."""
    count, token = 0, None
    while True:
        answer = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix,
                            **({"ContinuationToken": token} if token else {}))
        count += answer.get("KeyCount", 0)
        if not answer.get("IsTruncated"):
            return count
        token = answer["NextContinuationToken"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="the local store's root")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", default="store", help="the store's root in the bucket")
    parser.add_argument("--sorted-listing", action="store_true")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.sorted_listing:
        S3Backend.list_objects_v2 = list_page  # type: ignore[method-assign,assignment]
    before = resident_mib()
    started = time.perf_counter()
    inserted = fill(args.source, args.bucket, args.prefix, args.sorted_listing)
    args.report.write_text(json.dumps({
        "inserted": inserted, "seconds": round(time.perf_counter() - started, 1),
        "rss_before_mib": before, "rss_filled_mib": resident_mib()}) + "\n")
    server = ThreadedMotoServer(ip_address=args.host, port=args.port, verbose=False)
    server.start()
    threading.Event().wait()  # until terminated


if __name__ == "__main__":
    main()
