"""The dev/CI environment is the locked one: the CPU build of torch, every package as pinned."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LOCK = Path(__file__).resolve().parent.parent / "requirements-dev.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HINT = "the environment is not the one requirements-dev.lock describes: run ./dev to update it"


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins[match.group(1)] = match.group(2)
    return pins


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__}: {HINT}"
    assert _pins()["torch"] == torch.__version__


def test_lock_pins_the_cpu_build_of_torch() -> None:
    assert _pins()["torch"].endswith("+cpu")  # plain 2.13.0 would also match the CUDA build


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the lock is made for CPython 3.11")
def test_every_locked_package_is_installed_as_pinned() -> None:
    pins = _pins()
    assert len(pins) > 50
    wrong = {}
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed != version:
            wrong[name] = f"{installed} instead of {version}"
    assert not wrong, f"{HINT}: {wrong}"
