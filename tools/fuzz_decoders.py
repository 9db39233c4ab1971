"""Fuzz every chunkstore decoder for as long as asked; print the number of inputs tried.

    python tools/fuzz_decoders.py --seconds 600 [--seed N]

Runs the targets and mutations of ``tests/test_fuzz_decoders.py`` (config, tag,
commit record, tree node, data node, plain data, chunk object, each codec, delta
chunk objects decoded against their bases) in
turn with a seeded random generator.  Every input must either raise a
``chunkstore.errors`` type or decode to something that round-trips, without
allocating more than a bound proportional to the input.  The first failure is
printed with its input and the run exits 1; otherwise it exits 0.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_fuzz_decoders import TARGETS, FuzzFailure, check, mutate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rnd = random.Random(seed)
    deadline = time.monotonic() + args.seconds
    tried = dict.fromkeys((t.name for t in TARGETS), 0)
    try:
        while time.monotonic() < deadline:
            for target in TARGETS:
                for _ in range(50):
                    check(target, *mutate(target, rnd))
                    tried[target.name] += 1
    except FuzzFailure as exc:
        print(f"FAILED after {sum(tried.values())} inputs (seed {seed}): {exc}")
        return 1
    per_target = ", ".join(f"{name} {count}" for name, count in tried.items())
    print(f"{sum(tried.values())} inputs tried in {args.seconds:g} s (seed {seed}), no failure:"
          f" {per_target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
