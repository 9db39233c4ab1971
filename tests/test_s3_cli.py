"""Pointing the CLI at an S3-compatible server: ``--storage-option``, the
``CHUNKSTORE_STORAGE_OPTIONS`` variable and the standard ``AWS_ENDPOINT_URL``, against
the moto server CI runs (docs/s3.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.cli import cli
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[str]:
    name = create_bucket(s3_endpoint)
    try:
        yield name
    finally:
        remove_bucket(s3_endpoint, name)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def steps(result: Result) -> list[int]:
    assert result.exit_code == 0, result.output
    return sorted(v["step"] for v in json.loads(result.output)["versions"])


def test_the_cli_reaches_s3_three_ways(s3_endpoint: str, bucket: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{bucket}/ckpts"
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    made = run("--storage-option", f"endpoint_url={s3_endpoint}", "init", url)
    assert made.exit_code == 0, made.output
    with chunkstore.open(url, storage_options=storage_options(s3_endpoint),
                         index_dir=str(tmp_path / "writer")) as store:
        for step in (1, 2):
            with store.new_version(run="exp", step=step) as version:
                version.put("w", np.arange(1000, dtype=np.float32) * step)
    # 1. an option on the command line (a dotted key nests)
    assert steps(run("--storage-option", f"client_kwargs.endpoint_url={s3_endpoint}",
                     "log", "--json", url)) == [1, 2]
    # 2. the environment variable, a JSON object
    env_options = json.dumps({"endpoint_url": s3_endpoint})
    assert steps(run("log", "--json", url,
                     env={"CHUNKSTORE_STORAGE_OPTIONS": env_options})) == [1, 2]
    # 3. the standard AWS variable, read by botocore itself
    assert steps(run("log", "--json", url, env={"AWS_ENDPOINT_URL": s3_endpoint})) == [1, 2]
    # sync to a local directory takes the options for the URL side only
    local = tmp_path / "copy"
    copied = run("--storage-option", f"endpoint_url={s3_endpoint}", "sync", "--json", url,
                 str(local))
    assert copied.exit_code == 0, copied.output
    assert steps(run("log", "--json", str(local))) == [1, 2]


@pytest.mark.parametrize(("option", "env", "message"), [
    ("endpoint_url", None, "expected KEY=VALUE"),
    ("=x", None, "expected KEY=VALUE"),
    ("a..b=1", None, "expected KEY=VALUE"),
    (None, "{not json", "is not JSON"),
    (None, "[1, 2]", "must be a JSON object"),
])
def test_bad_storage_options_are_usage_errors(tmp_path: Path, option: str | None,
                                              env: str | None, message: str) -> None:
    args = ["--storage-option", option] if option else []
    result = CliRunner().invoke(
        cli, [*args, "log", str(tmp_path / "none")],
        env={"CHUNKSTORE_STORAGE_OPTIONS": env} if env else None)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "none").exists()
