"""The command line of encrypted stores: ``init --encrypt``, the password's sources
(environment, ``--password-file``, a prompt on a real terminal), the wrong password's
exit code, and ``chunkstore key list|add|remove|passwd``."""

from __future__ import annotations

import json
import os
import pty
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.cli import EXIT_PASSWORD, EXIT_USAGE, cli
from chunkstore.errors import KeyObjectError, WrongPasswordError
from chunkstore.objects.keys import TEST_KDF_ENV
from tests.conftest import tree_snapshot

FIRST, SECOND, THIRD = "first password", "second password", "third password"


@pytest.fixture(autouse=True)
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KDF_ENV, "1")
    monkeypatch.delenv("CHUNKSTORE_PASSWORD", raising=False)
    monkeypatch.delenv("CHUNKSTORE_PASSWORD_FILE", raising=False)
    monkeypatch.delenv("CHUNKSTORE_NEW_PASSWORD", raising=False)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    assert run("init", "--encrypt", str(path), env={"CHUNKSTORE_PASSWORD": FIRST}).exit_code == 0
    with chunkstore.open(path, password=FIRST) as opened:
        with opened.new_version(run="r", step=1) as version:
            version.put("w", np.arange(1000, dtype=np.float32))
    return path


def test_init_encrypt_and_the_password_sources(store: Path, tmp_path: Path) -> None:
    config = json.loads((store / "chunkstore.json").read_bytes())
    assert config["encryption"]["cipher"] == "aes-256-gcm"
    ok = run("log", str(store), "--json", env={"CHUNKSTORE_PASSWORD": FIRST})
    assert ok.exit_code == 0 and FIRST not in ok.output
    assert [v["step"] for v in json.loads(ok.output)["versions"]] == [1]
    wrong = run("log", str(store), env={"CHUNKSTORE_PASSWORD": "nope"})
    assert wrong.exit_code == EXIT_PASSWORD and "wrong password" in wrong.output
    none = run("log", str(store))  # no terminal to ask on
    assert none.exit_code == EXIT_USAGE and "no password was given" in none.output
    secret = tmp_path / "password"
    secret.write_text(FIRST + "\n")
    # --password-file wins over a wrong $CHUNKSTORE_PASSWORD; a plain store ignores it.
    assert run("--password-file", str(secret), "log", str(store),
               env={"CHUNKSTORE_PASSWORD": "nope"}).exit_code == 0
    assert run("log", str(store), env={"CHUNKSTORE_PASSWORD_FILE": str(secret)}).exit_code == 0
    assert run("init", str(tmp_path / "plain")).exit_code == 0
    assert run("--password-file", str(secret), "log", str(tmp_path / "plain")).exit_code == 0
    assert run("--password-file", str(secret), "init", str(tmp_path / "plain2")).exit_code == 0
    assert "encryption" not in json.loads((tmp_path / "plain2" / "chunkstore.json").read_bytes())
    again = run("init", "--encrypt", str(store), env={"CHUNKSTORE_PASSWORD": FIRST})
    assert again.exit_code == EXIT_USAGE and "already a chunkstore store" in again.output


def test_verify_and_report_answer_without_the_password(store: Path) -> None:
    for command in (["verify", str(store), "--json"], ["report", str(store), "--json"],
                    ["key", "list", str(store), "--json"]):
        result = run(*command, env={"CHUNKSTORE_PASSWORD": FIRST})
        assert result.exit_code == 0, result.output
        assert FIRST not in result.output


def test_a_prompt_on_a_terminal_is_not_echoed(store: Path) -> None:
    """A real pseudo-terminal: the command asks, the password typed is not echoed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_PASSWORD")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on the terminal
        os.execve(sys.executable, [sys.executable, "-m", "chunkstore", "log", str(store)], env)
    output = b""
    deadline = time.monotonic() + 60
    while b"password for" not in output and time.monotonic() < deadline:
        output += os.read(fd, 1024)
    os.write(fd, FIRST.encode() + b"\n")
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # the terminal closed with the child
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "r@1" in text or "step" in text or "1 version" in text, text
    assert FIRST not in text, "the password was echoed"


def test_key_add_passwd_remove_then_open_with_each(store: Path, tmp_path: Path) -> None:
    env = {"CHUNKSTORE_PASSWORD": FIRST, "CHUNKSTORE_NEW_PASSWORD": SECOND}
    added = run("key", "add", str(store), "--json", env=env)
    assert added.exit_code == 0 and SECOND not in added.output
    second_id = json.loads(added.output)["added"]
    data_before = {k: v for k, v in tree_snapshot(store).items()
                   if not k.startswith(("keys", "audit/"))}
    for password in (FIRST, SECOND):
        with chunkstore.open(store, password=password) as opened:
            assert opened.open_version("r@1").get("w")[999] == 999
    new_file = tmp_path / "new"
    new_file.write_text(THIRD + "\n")
    changed = run("key", "passwd", str(store), "--new-password-file", str(new_file), "--json",
                  env={"CHUNKSTORE_PASSWORD": SECOND})
    assert changed.exit_code == 0
    assert json.loads(changed.output)["removed"] == second_id
    with pytest.raises(WrongPasswordError):
        chunkstore.open(store, password=SECOND)
    with chunkstore.open(store, password=THIRD) as opened:
        assert opened.open_version("r@1").get("w")[999] == 999
        listed = json.loads(run("key", "list", str(store), "--json",
                                env={"CHUNKSTORE_PASSWORD": THIRD}).output)["keys"]
        assert len(listed) == 2 and sum(k["current"] for k in listed) == 1
    first_id = next(k["id"] for k in listed if not k["current"])
    assert run("key", "remove", str(store), first_id,
               env={"CHUNKSTORE_PASSWORD": THIRD}).exit_code == 0
    with pytest.raises(WrongPasswordError):
        chunkstore.open(store, password=FIRST)
    # No data object was written, re-encrypted or removed by any of it (audit events
    # were added: test_audit checks them).
    assert {k: v for k, v in tree_snapshot(store).items()
            if not k.startswith(("keys", "audit/"))} == data_before


def test_the_last_key_is_never_removed(store: Path) -> None:
    before = tree_snapshot(store)
    (only,) = [p.name for p in (store / "keys").iterdir()]
    refused = run("key", "remove", str(store), only, env={"CHUNKSTORE_PASSWORD": FIRST})
    assert refused.exit_code == EXIT_USAGE and "last key" in refused.output
    unknown = run("key", "remove", str(store), "0" * 16, env={"CHUNKSTORE_PASSWORD": FIRST})
    assert unknown.exit_code == EXIT_USAGE and "no key" in unknown.output
    with chunkstore.open(store, password=FIRST) as opened, pytest.raises(KeyObjectError):
        from chunkstore.handle.encryption import remove_key
        remove_key(opened.url, opened.objects, only)
    assert tree_snapshot(store) == before


def test_key_commands_refuse_a_plain_store(tmp_path: Path) -> None:
    assert run("init", str(tmp_path / "plain")).exit_code == 0
    result = run("key", "list", str(tmp_path / "plain"))
    assert result.exit_code == EXIT_USAGE and "not encrypted" in result.output
