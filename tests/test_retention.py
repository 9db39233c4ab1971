"""Retention policies against hand-worked expected sets."""

from __future__ import annotations

import datetime as dt

import pytest

from chunkstore.errors import InvalidSettingError
from chunkstore.maintenance.retention import (
    Candidate,
    Policy,
    UnknownMetricError,
    check_metric,
    decide,
    parse_duration,
    recorded_metrics,
)

HOUR = 3600.0
NOW = 1_000_000.0


def run_of(steps: list[int], **extra: dict[int, object]) -> list[Candidate]:
    """Versions at ``steps``, one hour apart, the last one saved at NOW."""
    out = []
    for i, step in enumerate(steps):
        meta = {"metrics": {"loss": extra["loss"][step]}} if step in extra.get("loss", {}) else {}
        tags = tuple(extra.get("tags", {}).get(step, ()))  # type: ignore[call-overload]
        out.append(Candidate(f"v{step:04d}", step, NOW - (len(steps) - 1 - i) * HOUR, meta, tags))
    return out


def kept(versions: list[Candidate], policy: Policy, newest_good: str | None = None) -> list[int]:
    decision = decide(versions, policy, NOW, newest_good)
    assert set(decision.keep) | set(decision.drop) == {v.id for v in versions}
    return sorted(int(i[1:]) for i in decision.keep)


STEPS = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]


def test_keep_last() -> None:
    assert kept(run_of(STEPS), Policy(keep_last=3)) == [800, 900, 1000]


def test_keep_last_one_still_keeps_the_previous_known_good() -> None:
    assert kept(run_of(STEPS), Policy(keep_last=1)) == [900, 1000]
    assert kept(run_of(STEPS), Policy(keep_last=1, min_previous=0)) == [1000]
    assert kept(run_of(STEPS), Policy(keep_last=1, min_previous=2)) == [800, 900, 1000]


def test_keep_every_k_steps_plus_the_safety_pair() -> None:
    assert kept(run_of(STEPS), Policy(keep_every=300)) == [300, 600, 900, 1000]


def test_keep_within_a_duration() -> None:
    # versions at NOW-9h .. NOW; within 2.5h: NOW-2h, NOW-1h, NOW
    assert kept(run_of(STEPS), Policy(keep_within="2.5h")) == [800, 900, 1000]
    assert kept(run_of(STEPS), Policy(keep_within=dt.timedelta(hours=2))) == [800, 900, 1000]


def test_keep_best_by_a_recorded_metric() -> None:
    loss = {100: 0.9, 200: 0.5, 300: 0.7, 400: 0.2, 500: 0.6, 600: 0.3, 700: 0.8}
    versions = run_of(STEPS, loss=loss)  # 800-1000 recorded no metric
    assert kept(versions, Policy(keep_best=("loss", 2), min_previous=0)) == [400, 600, 1000]
    assert kept(versions, Policy(keep_best=("loss", 2, "max"), min_previous=0)) == [100, 700,
                                                                                    1000]


def test_policies_compose_by_union_and_tags_pin() -> None:
    versions = run_of(STEPS, tags={200: ["paper"]})
    policy = Policy(keep_last=2, keep_every=500)
    assert kept(versions, policy) == [200, 500, 900, 1000]


def test_a_damaged_newest_version_keeps_the_newest_good_one_and_its_predecessor() -> None:
    versions = run_of(STEPS)
    # v1000 failed to verify: v900 is the newest good one; v800 its known-good predecessor;
    # v1000 is kept too (newer than the newest verified: never drop what might be repaired).
    assert kept(versions, Policy(keep_last=1), newest_good="v0900") == [800, 900, 1000]


def test_no_versions() -> None:
    decision = decide([], Policy(keep_last=1), NOW)
    assert decision.keep == {} and decision.drop == []


def test_reasons_are_reported() -> None:
    decision = decide(run_of([1, 2, 3]), Policy(keep_last=1), NOW)
    assert decision.keep["v0003"] == ["newest verified version", "keep_last=1"]
    assert decision.keep["v0002"] == ["previous known-good version"]
    assert decision.drop == ["v0001"]


@pytest.mark.parametrize("kwargs", [
    {"keep_last": 0}, {"keep_last": -1}, {"keep_last": True}, {"keep_every": 1.5},
    {"keep_within": "soon"}, {"keep_within": -5}, {"keep_best": ("loss",)},
    {"keep_best": ("loss", 0)}, {"keep_best": ("loss", 2, "median")}, {"min_previous": -1},
])
def test_bad_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidSettingError):
        Policy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), (90, 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("1w", 604800),
    ("0", 0), ("1.5h", 5400), (dt.timedelta(minutes=5), 300),
])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_the_previous_known_good_version_is_one_that_verified() -> None:
    versions = run_of(STEPS)
    # v1000 verified; v900 did not; v800 did: v800 is the known-good predecessor kept.
    decision = decide(versions, Policy(keep_last=1), NOW, "v1000", previous_good=["v0800"])
    assert sorted(decision.keep) == ["v0800", "v1000"]
    assert decision.keep["v0800"] == ["previous known-good version (verified)"]


def test_a_metric_no_version_records_is_refused_with_the_ones_that_exist() -> None:
    metas: list[dict[str, object]] = [{"metrics": {"loss": 0.5, "acc": 0.9}, "lr": 0.1},
                                      {"loss": 0.4, "note": "text", "flag": True}]
    with pytest.raises(UnknownMetricError) as caught:
        check_metric("val_loss", "exp1", metas)
    assert isinstance(caught.value, InvalidSettingError)  # exit 2 on the command line
    assert caught.value.metric == "val_loss" and caught.value.run == "exp1"
    assert caught.value.recorded == ["acc", "loss", "lr"]  # numbers only
    assert "'val_loss'" in str(caught.value) and "acc, loss, lr" in str(caught.value)


def test_a_metric_some_versions_record_is_a_warning() -> None:
    metas: list[dict[str, object]] = [{"loss": 0.5}, {}, {"metrics": {"loss": 0.3}}]
    warning = check_metric("loss", "exp1", metas)
    assert warning is not None and "only 2 of the 3 versions" in warning
    assert check_metric("loss", "exp1", [{"loss": 1}]) is None
    assert check_metric("loss", "exp1", []) is None  # an empty run has nothing to rank
    assert recorded_metrics([]) == []
