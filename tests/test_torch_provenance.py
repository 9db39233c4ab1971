"""Provenance: a version says which code made it, or says plainly that nobody knows."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_bridge import Checkpointer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _meta(store: Path, **kwargs: object) -> dict[str, object]:
    with Checkpointer(store, run="r", **kwargs) as ckpt:
        info = ckpt.save(1, model=torch.nn.Linear(2, 2))
    assert info is not None
    return dict(info.meta)


def _outside_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory git will not find a checkout above."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return work


def test_inside_git_the_revision_is_recorded(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    meta = _meta(tmp_path / "s")
    assert meta["code_rev"] == head and isinstance(meta["code_dirty"], bool)
    assert "code_rev_unknown" not in meta


def test_outside_git_the_revision_is_recorded_as_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = _outside_git(tmp_path, monkeypatch)
    meta = _meta(tmp_path / "s")
    assert meta["code_rev"] is None and meta["code_dirty"] is None
    reason = str(meta["code_rev_unknown"])
    assert "not a git repository" in reason and str(work) in reason and "meta=" in reason


def test_without_git_installed_the_reason_says_so(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _outside_git(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    meta = _meta(tmp_path / "s")
    assert meta["code_rev"] is None
    assert "git could not run" in str(meta["code_rev_unknown"])


def test_a_revision_passed_in_meta_replaces_the_unknown_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _outside_git(tmp_path, monkeypatch)
    meta = _meta(tmp_path / "s", meta={"code_rev": "v1.2-abc123", "code_dirty": False})
    assert meta["code_rev"] == "v1.2-abc123" and meta["code_dirty"] is False
    assert "code_rev_unknown" not in meta


def test_the_functional_save_asks_git_once_per_directory_and_merges_meta_per_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_bridge import save
    from torch_bridge.capture import provenance
    calls: list[str] = []
    real_git = provenance._git

    def counting_git(*args: str) -> tuple[str | None, str]:
        calls.append(args[0])
        return real_git(*args)

    monkeypatch.setattr(provenance, "_git", counting_git)
    monkeypatch.setattr(provenance, "_REVISIONS", {})
    monkeypatch.chdir(REPO)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    state = {"model": torch.nn.Linear(2, 2)}
    first = save(tmp_path / "s", state, run="r", step=1, meta={"note": "a"})
    second = save(tmp_path / "s", state, run="r", step=2, meta={"code_rev": "mine"})
    third = save(tmp_path / "s", state, run="r", step=3)
    assert calls == ["rev-parse", "status"]  # once for the three saves
    assert first.meta["code_rev"] == head and first.meta["note"] == "a"
    assert second.meta["code_rev"] == "mine" and "note" not in second.meta
    assert third.meta["code_rev"] == head and "note" not in third.meta

    _outside_git(tmp_path, monkeypatch)  # another directory: git is asked there
    outside = save(tmp_path / "s", state, run="r", step=4)
    assert calls == ["rev-parse", "status", "rev-parse"]
    assert outside.meta["code_rev"] is None and "code_rev_unknown" in outside.meta
    overridden = save(tmp_path / "s", state, run="r", step=5, meta={"code_rev": "v2"})
    assert overridden.meta["code_rev"] == "v2" and "code_rev_unknown" not in overridden.meta
    again = save(tmp_path / "s", state, run="r", step=6)
    assert "code_rev_unknown" in again.meta  # the override changed no cached answer
    assert calls == ["rev-parse", "status", "rev-parse"]
