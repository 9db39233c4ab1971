"""The writer's group commit of chunk claims."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import chunkstore
from chunkstore.digest import Digest
from chunkstore.index import Claim
from chunkstore.writer import GroupClaims


def test_concurrent_claims_share_transactions_and_each_gets_its_own_answer() -> None:
    calls: list[list[Digest]] = []

    def claim_many(digests: list[Digest]) -> dict[Digest, Claim]:
        calls.append(digests)
        time.sleep(0.01)  # an index commit: claims arriving meanwhile queue up
        return {d: Claim.WRITE if d.raw[0] % 2 else Claim.DEDUP for d in digests}

    group = GroupClaims(claim_many)
    digests = [Digest.of(str(i).encode()) for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(group.claim, digests))
    assert answers == [Claim.WRITE if d.raw[0] % 2 else Claim.DEDUP for d in digests]
    assert sorted(d.raw for batch in calls for d in batch) == sorted(d.raw for d in digests)
    assert len(calls) < len(digests) / 2  # grouped, not one commit per claim


def test_an_index_error_reaches_every_claim_of_its_batch_and_the_next_batch_still_runs() -> None:
    failing = threading.Event()
    failing.set()

    def claim_many(digests: list[Digest]) -> dict[Digest, Claim]:
        if failing.is_set():
            failing.clear()
            raise OSError("index full (injected)")
        return dict.fromkeys(digests, Claim.DEDUP)

    group = GroupClaims(claim_many)
    with pytest.raises(OSError, match="injected"):
        group.claim(Digest.of(b"a"))
    assert group.claim(Digest.of(b"b")) == Claim.DEDUP


def test_a_runs_versions_are_ordered_by_step_whatever_order_they_were_committed(
        store: chunkstore.Store) -> None:
    import numpy as np

    for step in (5, 3, 4):  # e.g. saved by machines whose clocks disagree
        with store.new_version("r", step) as v:
            v.put("w", np.full(10, step, dtype=np.int32))
    assert [v.step for v in store.versions("r")] == [3, 4, 5]
    assert store.resolve("r@latest").step == 5
    assert store.open_version("r@latest").get("w")[0] == 5
