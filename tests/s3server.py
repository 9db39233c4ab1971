"""A real S3 server for tests: the one CI names, or a moto server started here.

Import the ``s3_endpoint`` fixture into a test module.  With
``CHUNKSTORE_TEST_S3_ENDPOINT`` set, tests use that server; otherwise a
``moto.server`` subprocess is started on a free loopback port for the test
session and stopped at its end.  :func:`create_bucket` / :func:`remove_bucket`
give each test its own bucket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from typing import IO, Any

import pytest

ENDPOINT_ENV_VAR = "CHUNKSTORE_TEST_S3_ENDPOINT"
_DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never probe the EC2 metadata service for credentials (slow off-cloud).
    "AWS_EC2_METADATA_DISABLED": "true",
}
_STARTUP_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Yield the endpoint URL of a running S3 server, with credentials in the environment."""
    external = os.environ.get(ENDPOINT_ENV_VAR)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _DUMMY_CREDENTIALS.items():
            if external is None or name not in os.environ:
                # A local moto server must never receive a developer's real keys.
                patch.setenv(name, value)
        if external:
            yield external
            return
        with _moto_server() as endpoint:
            yield endpoint


def storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec storage options that point s3fs at ``endpoint``."""
    return {"client_kwargs": {"endpoint_url": endpoint}}


def unreachable_backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """An S3 backend whose endpoint is a loopback port nothing listens on (credentials
    faked, one try of each request, a 1 s connect timeout): every request fails."""
    from chunkstore.backends.fsspec_backend import FsspecBackend
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    return FsspecBackend("s3://no-bucket/ckpts",
                         client_kwargs={"endpoint_url": f"http://127.0.0.1:{_free_port()}"},
                         config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})


def create_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh unique name and return the name."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:20]}"
    s3fs.S3FileSystem(**storage_options(endpoint)).mkdir(name)
    return name


def remove_bucket(endpoint: str, name: str) -> None:
    """Delete a bucket and everything in it."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(endpoint))
    fs.rm(name, recursive=True)


@contextlib.contextmanager
def two_indexes(endpoint: str, folder: Any) -> Iterator[tuple[Any, Any]]:
    """Two handles on one store in a fresh bucket, each through an index of its own
    (``folder``/a and ``folder``/b: two machines); the bucket goes afterwards."""
    import chunkstore

    bucket = create_bucket(endpoint)
    url, options = f"s3://{bucket}/store", storage_options(endpoint)
    try:
        with chunkstore.open(url, create=True, index_dir=str(folder / "a"),
                             storage_options=options) as a, \
                chunkstore.open(url, create=True, index_dir=str(folder / "b"),
                                storage_options=options) as b:
            yield a, b
    finally:
        remove_bucket(endpoint, bucket)


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    """Run ``python -m moto.server`` on a free loopback port; yield its endpoint."""
    with _moto_process() as (endpoint, _):
        yield endpoint


@contextlib.contextmanager
def _moto_process(
    arguments: Sequence[str] = ("-m", "moto.server"), startup_timeout: float = _STARTUP_TIMEOUT_S
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``python ARGUMENTS -H 127.0.0.1 -p PORT`` (a moto server, or one that starts
    filled: benchmarks/moto_filled.py) on a free loopback port; yield its endpoint
    and process once it answers."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, *arguments, "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_until_answering(endpoint, process, log, startup_timeout)
            yield endpoint, process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_answering(
    endpoint: str, process: subprocess.Popen[bytes], log: IO[bytes],
    timeout: float = _STARTUP_TIMEOUT_S,
) -> None:
    """Poll until the server answers HTTP; fail with its output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            output = log.read().decode(errors="replace")
            raise RuntimeError(f"moto server exited with {process.returncode}:\n{output}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {endpoint} did not answer within {timeout} s")
