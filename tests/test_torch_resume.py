"""Kill-and-resume equivalence: a real subprocess, SIGKILLed, resumed bit for bit; the
demo's kill points (drawn from a seed, reported as what they hit) and its output."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch_bridge import Checkpointer, PartialRestoreWarning  # noqa: E402
from torch_bridge.tools import training  # noqa: E402
from torch_bridge.tools.demo import DEMO_CONFIG  # noqa: E402
from torch_bridge.tools.kill import (  # noqa: E402
    AFTER_STEP,
    DURING_SAVE,
    MOMENTS,
    KillOutcome,
    choose_kill_point,
    new_seed,
    run_child,
)

REPO = Path(__file__).resolve().parent.parent
CONFIG = training.TrainConfig(steps=24, save_every=2)
#: The first seed that draws a kill during a save, and its kill point (a save step).
SEED_IN_FLIGHT = next(s for s in range(100) if choose_kill_point(s, CONFIG).moment == DURING_SAVE)
KILL = choose_kill_point(SEED_IN_FLIGHT, CONFIG)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The uninterrupted run, trained to the end without checkpoints."""
    with training.deterministic():
        job = training.build(CONFIG)
        training.train(job, CONFIG.steps)
        return training.snapshot(job)


@pytest.fixture(scope="module")
def killed_mid_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, KillOutcome]:
    """A store whose writer was SIGKILLed at the kill point ``SEED_IN_FLIGHT`` draws:
    while its background save was in flight, and what the kill was reported to hit.

    Every storage write of the child waits 50 ms, so up to 5 ms after ``save(KILL.step)``
    returns the background write of that step is certainly still running.
    """
    store = tmp_path_factory.mktemp("killed") / "store"
    log = run_child(str(store), CONFIG, KILL, save_delay=0.05)
    assert log.last_returned == KILL.step
    with Checkpointer(store, run="demo", read_only=True) as ckpt:
        return store, KillOutcome.of(log, ckpt.latest_step())


def _resume_and_finish(store: Path, step: int | None = None,
                       without: frozenset[str] = frozenset(), save: bool = True
                       ) -> tuple[int | None, dict[str, Any]]:
    with training.deterministic(), Checkpointer(store, run="demo", async_save=True) as ckpt:
        job = training.build(CONFIG)
        restored = training.resume(job, ckpt, step, without)
        training.train(job, CONFIG.steps, ckpt if save else None)
        return restored, training.snapshot(job)


def test_a_run_killed_during_a_background_save_resumes_bit_exactly(
        killed_mid_save: tuple[Path, KillOutcome], reference: dict[str, Any]) -> None:
    store, outcome = killed_mid_save
    # The save in flight was never published, and the report says so; the one before
    # it was complete.
    assert outcome.case == "save in flight" and outcome.in_flight == KILL.step
    assert outcome.published == KILL.step - CONFIG.save_every
    assert f"while the save of step {KILL.step} was in flight" in outcome.describe()
    restored, resumed = _resume_and_finish(store, save=False)
    assert restored == outcome.published
    assert training.differences(reference, resumed) == []
    assert len(resumed["losses"]) == CONFIG.steps
    assert len({i for batch in resumed["ids"] for i in batch}) == CONFIG.examples


def test_a_run_killed_at_full_speed_at_a_random_point_resumes_bit_exactly(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """A fresh seed each run (named on failure): wherever the kill lands, the report
    matches the store and the resume is exact."""
    seed = new_seed()
    kill = choose_kill_point(seed, CONFIG)
    store = tmp_path / "store"
    log = run_child(str(store), CONFIG, kill)
    with Checkpointer(store, run="demo", read_only=True) as ckpt:
        outcome = KillOutcome.of(log, ckpt.latest_step())
    assert outcome.after_step >= kill.step, (seed, kill, outcome)
    restored, resumed = _resume_and_finish(store)
    assert restored == outcome.published, (seed, kill, outcome)
    assert training.differences(reference, resumed) == [], (seed, kill, outcome)
    with Checkpointer(store, run="demo") as ckpt:
        assert ckpt.latest_step() == CONFIG.steps
        assert ckpt.store.verify().ok


def test_the_kill_point_varies_with_the_seed() -> None:
    """Seeds draw different kill points, all in the second half of training, at every
    moment (one of them during an in-flight save); a seed draws the same point again."""
    points = {seed: choose_kill_point(seed, DEMO_CONFIG) for seed in range(60)}
    assert points[SEED_IN_FLIGHT] == choose_kill_point(SEED_IN_FLIGHT, DEMO_CONFIG)
    in_flight = next(s for s, p in points.items() if p.moment == DURING_SAVE)
    other = next(s for s, p in points.items() if p != points[in_flight])
    assert points[in_flight] != points[other]
    assert 0 < points[in_flight].delay < 0.005
    assert {p.moment for p in points.values()} == set(MOMENTS)
    assert len({p.step for p in points.values()}) > 10
    for point in points.values():
        assert DEMO_CONFIG.steps // 2 < point.step < DEMO_CONFIG.steps
        if point.moment != AFTER_STEP:  # tied to a save, and never the last
            assert point.step % DEMO_CONFIG.save_every == 0


@pytest.mark.parametrize("piece", training.STATE_PIECES)
def test_leaving_out_any_piece_of_state_breaks_the_equivalence(
        piece: str, killed_mid_save: tuple[Path, KillOutcome], reference: dict[str, Any]
) -> None:
    """Proof the equivalence test can fail: each of the five pieces is necessary."""
    store = killed_mid_save[0]
    step = KILL.step - CONFIG.save_every
    # Leaving a saved state out warns, naming it (rng=False is asked for by name: quiet).
    with (contextlib.nullcontext() if piece == "rng"
          else pytest.warns(PartialRestoreWarning, match="which were not restored")):
        restored, resumed = _resume_and_finish(store, step, frozenset({piece}), save=False)
    assert restored == step
    assert training.differences(reference, resumed) != []
    complete = _resume_and_finish(store, step, save=False)[1]
    assert training.differences(reference, complete) == []


def test_demo_command_resumes_bit_exactly_and_says_what_it_measured(tmp_path: Path) -> None:
    """The demo at the seed's kill point: its lines say where the kill was drawn and what
    it hit, what the state holds, and both storage figures, frozen base and dense, as
    its JSON (on stdout) has them."""
    from click.testing import CliRunner

    from torch_bridge.tools.cli import demo

    seed = SEED_IN_FLIGHT
    result = CliRunner().invoke(demo, [str(tmp_path / "store"), "--seed", str(seed), "--json"])
    assert result.exit_code == 0, result.output
    text, report = result.stderr, json.loads(result.stdout)
    assert "IDENTICAL" in text and "verify ok" in text
    kill = choose_kill_point(seed, DEMO_CONFIG)
    assert f"kill point: {kill.describe()} (seed {seed};" in text
    assert report["kill_point"] == {"step": kill.step, "moment": kill.moment,
                                    "delay": kill.delay}
    outcome = report["kill"]
    assert outcome["case"] in ("save in flight", "inside a save call", "between saves")
    assert f"training subprocess: async save every 2 steps, {outcome['described']}" in text
    assert f"resumed from step {report['restored_step']}," in text
    # save(K) returned only once the save before it was published
    assert report["restored_step"] == outcome["published"] >= kill.step - 2
    state = report["state"]
    assert state["frozen"] == 1024 * 1024 * 4 + 1024 * 4  # the backbone's weight and bias
    assert "state per checkpoint: 4.8 MiB = 4.0 MiB frozen backbone" in text
    frozen, dense = report["frozen_base"], report["dense"]
    assert re.search(r"frozen-base model \(this job: the best case\): 30 checkpoints.*"
                     + f": {_ratio(frozen)} less", text)
    assert re.search(r"dense model \(every weight trains\): 8 checkpoints.*"
                     + f": {_ratio(dense)} less", text)
    assert frozen["ratio"] > 3 and frozen["dedup"] > 3
    assert dense["ratio"] < 1.5 and dense["dedup"] < 1.05  # no chunk repeats


def _ratio(figure: dict[str, Any]) -> str:
    """A storage figure's ratio as the demo prints it."""
    return f"{figure['torch_save_bytes'] / figure['stored_bytes']:.2f}x"


def test_the_readme_demo_figures_come_from_the_results_file() -> None:
    """Every figure the README's demo section quotes (ratios, sizes, the kill it
    describes) is one of benchmarks/results/demo.json, written by the command the
    section names."""
    from chunkstore.cli import format_size

    section = (REPO / "README.md").read_text().split("## Two commands", 1)[1]
    section = " ".join(section.split("### Set-up", 1)[0].split())
    results = json.loads((REPO / "benchmarks/results/demo.json").read_text())
    assert results["matched"] and results["verify_ok"]
    command = f"chunkstore demo --seed {results['seed']} --json > benchmarks/results/demo.json"
    assert command in section
    assert results["kill"]["described"] in section
    assert f"resumed from step {results['restored_step']}" in section
    for case in ("frozen_base", "dense"):
        assert f"{results[case]['versions']} checkpoints" in section
    figures = {"ratio": _ratio, "dedup": lambda f: f"{f['dedup']:.2f}x",
               "compression": lambda f: f"{f['compression']:.2f}x",
               "torch.save": lambda f: format_size(f["torch_save_bytes"]),
               "stored": lambda f: format_size(f["stored_bytes"])}
    known = {show(results[k]) for k in ("frozen_base", "dense") for show in figures.values()}
    known |= {format_size(n) for n in results["state"].values()}
    quoted = re.findall(r"\d+\.\d+(?:x| [KM]iB)", section)
    assert len(quoted) >= 12
    assert [f for f in quoted if f not in known] == []
