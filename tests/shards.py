"""Split a pytest run into shards of about equal time: ``pytest --shard K/N``.

`./dev test` runs the suite as four pytest processes side by side, the modules of
``--shard 1/4`` to ``4/4``.  Many tests wait on subprocesses, sleeps and locks (one pytest
process keeps under a core busy), so more processes than cores keep the two cores of the
reference machine busy.  A shard is a set of whole modules (a module's
fixtures and order stay as they are), assigned longest first to the shard with the
least time so far, from the seconds each module took in a recorded run
(``tests/durations.json``); a module not recorded there counts :data:`UNKNOWN_S`.
The assignment depends only on the modules selected and the file, so the shards of
one selection never overlap and together hold every test.

``python -m tests.shards --modules K/N`` prints shard K's modules (./dev test names them
to each pytest, which then collects only those).

Record the times again after the suite changes much::

    pytest -q --durations=0 > all.log
    python -m tests.shards all.log      # rewrites tests/durations.json
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / "durations.json"
#: The seconds a module not in the recorded run counts for.
UNKNOWN_S = 0.5
_LINE = re.compile(r"([0-9.]+)s (?:call|setup|teardown)\s+tests/([^:/]+)::")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only shard K of N of the selected tests (whole modules,"
                          " balanced by tests/durations.json)")


def parse(value: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {value!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {value!r}: K must be between 1 and N")
    return k, n


def assign(weights: dict[str, float], n: int) -> dict[str, int]:
    """Each module's shard (1..n): longest first, to the least loaded shard."""
    load = [0.0] * n
    shard_of = {}
    for module in sorted(weights, key=lambda m: (-weights[m], m)):
        shard = min(range(n), key=lambda s: (load[s], s))
        shard_of[module] = shard + 1
        load[shard] += weights[module]
    return shard_of


def recorded() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


class Shards:
    """The plugin tests/conftest.py registers: keeps the selected shard's tests."""

    @pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` deselected what they do
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        value = config.getoption("--shard")
        if value is None:
            return
        k, n = parse(value)
        times = recorded()
        shard_of = assign({m: times.get(m, UNKNOWN_S) for m in {i.path.name for i in items}},
                          n)
        left = [item for item in items if shard_of[item.path.name] != k]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if shard_of[item.path.name] == k]


def modules(k: int, n: int) -> list[str]:
    """The test modules (paths from the repository root) of shard ``k`` of ``n`` of the
    whole suite: what ``--shard K/N`` keeps of a run of every module, which ./dev test
    names to each pytest so that it imports (collects) only its own."""
    times = recorded()
    names = sorted(p.name for p in DURATIONS.parent.glob("test_*.py"))
    shard_of = assign({m: times.get(m, UNKNOWN_S) for m in names}, n)
    return [f"tests/{m}" for m in names if shard_of[m] == k]


def main(logs: list[str]) -> None:
    """Rewrite tests/durations.json from ``pytest --durations=0`` outputs."""
    seconds: Counter[str] = Counter()
    for log in logs:
        for line in Path(log).read_text().splitlines():
            if match := _LINE.match(line):
                seconds[match.group(2)] += float(match.group(1))
    if not seconds:  # a log of a run without --durations=0 would empty the file
        sys.exit(f"no test durations in {', '.join(logs)}: run pytest with --durations=0"
                 " (PYTEST_ADDOPTS=--durations=0 ./dev test > all.log)")
    DURATIONS.write_text(json.dumps({m: round(s, 1) for m, s in sorted(seconds.items())},
                                    indent=0) + "\n")
    print(f"wrote {DURATIONS} ({len(seconds)} modules, {sum(seconds.values()):.0f} s)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--modules"]:
        print("\n".join(modules(*parse(sys.argv[2]))))
    else:
        main(sys.argv[1:])
