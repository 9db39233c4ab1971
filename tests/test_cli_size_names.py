"""One name for one quantity: each size column of ``log``, ``show`` and ``report`` is
named as its ``--json`` key (the column ``NEW`` is ``new_bytes``; it was ``NEW RAW``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli

SIZE_COLUMNS = ("LOGICAL", "NEW", "NEW STORED")


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def key_of(column: str) -> str:
    return column.lower().replace(" ", "_") + "_bytes"


def table(text: str) -> list[dict[str, str]]:
    """The rows of the first table in ``text`` (cells are two or more spaces apart)."""
    lines = [line for line in text.splitlines()]
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = []
    for line in lines[1:]:
        if not line.strip():
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=False)))
    return rows


def test_every_size_column_is_named_as_its_json_key(tmp_path: Path) -> None:
    store_path = str(tmp_path / "s")
    with chunkstore.open(store_path, create=True) as store:
        for step in (1, 2):  # sizes under 1 KiB print exactly, as "N B"
            with store.new_version("r", step) as version:
                version.put("w", np.arange(step, step + 40, dtype=np.int16))
    listed = {v["id"][:12]: v for v in json.loads(run("log", store_path, "--json"))["versions"]}
    reported = {v["id"][:12]: v for v in
                json.loads(run("report", store_path, "--json"))["versions"]}

    for command, documents in (("log", listed), ("report", reported)):
        rows = table(run(command, store_path))
        assert len(rows) == 2
        for row in rows:
            doc = documents[row["ID"]]
            for column in SIZE_COLUMNS:
                assert f"{doc[key_of(column)]} B" == row[column], (command, column)

    shown = json.loads(run("show", store_path, "r@2", "--json"))["version"]
    names = {}
    for line in run("show", store_path, "r@2").splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 3 and cells[0].upper() in SIZE_COLUMNS:
            names[cells[0].upper()] = cells[1]
    assert set(names) == set(SIZE_COLUMNS)
    for column, size in names.items():
        assert f"{shown[key_of(column)]} B" == size, column
