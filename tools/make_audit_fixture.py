"""Build the frozen store that pins docs/format.md §16, audit events
(``tests/data/audit-v1``).

A plain store of store format 9, through the real operations: two saves of one run,
a tag, a removal of the first version and a GC at grace 0, so that it holds publish,
tag, rm (intent and done) and gc (intent and done) events.  ``who`` and ``process`` are
fixed (no real user or host in the repository); times are real, so a second run writes
other events: the test reads the frozen copy back; it never rebuilds it.  Never
regenerate an existing fixture after a format change: build ``--name audit-v2``.

``audit-v1.expected.json`` records each event's id, op and phase, the version ids,
and the BLAKE3 of every stored file.

Usage (from the repository root)::

    python tools/make_audit_fixture.py [--name audit-v1] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.protocol import audit

# tools/ is no package: its own folder on the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from frozen import freeze, fresh_fixture, run_builder

WHO = "fixture-user@fixture-audit.invalid"
PROCESS = "pid 4242 make_audit_fixture.py"


def build(name: str, force: bool) -> Path:
    out = fresh_fixture(name, force)
    audit.who_am_i = lambda: WHO  # type: ignore[assignment]
    audit.this_process = lambda: PROCESS  # type: ignore[assignment]
    ids = []
    with chunkstore.open(out, create=True, chunk_size=64 * 1024) as store:
        for step in (1, 2):
            with store.new_version("aud", step, meta={"note": "audit fixture"}) as v:
                v.put("w", np.arange(1000, dtype=np.float32) * step)
            ids.append(v.info.id)
        store.tag("aud@2", "best")
        store.delete("aud@1")
        store.gc(grace=0)
        events = [{"id": e.id, "op": e.op, "phase": e.phase} for e in store.audit()]
    freeze(out, {"run": "aud", "versions": ids, "events": events, "who": WHO,
                 "process": PROCESS, "audit_format_version": audit.AUDIT_FORMAT})
    return out


def main() -> None:
    run_builder(build, "audit-v1", __doc__)


if __name__ == "__main__":
    main()
