"""``drill``: prove that a store restores, and measure how long recovery takes.

1. The selector (default: the newest version) is resolved here first, so a bad one
   is a typed error before anything runs or is written.
2. The restore runs in a fresh process (``python -m chunkstore drill-restore``, or
   ``python -m torch_bridge.tools.drill`` to materialize torch tensors when
   torch_bridge is importable: this package never imports torch), as a resuming job
   would, and reports its phases (:mod:`.drillrestore`); the interpreter's start and
   imports are the ``startup`` phase.
3. With ``then``, a command (the job itself, or a smoke test) is started with the
   restored version named in its environment; the time until it prints
   ``CHUNKSTORE-DRILL-READY`` on a line of its own, or exits 0, is the
   ``first_update`` phase.  The command is then stopped (SIGTERM to its process
   group).
4. Each fault scenario copies the target version, and the run's version before
   it, into a scratch store in a temporary directory (``chunkstore.sync``), damages
   the copy, runs the same restore on it, and checks the outcome: the damaged
   version is refused with the scenario's typed error and the restore falls back
   to the earlier version (or, with none to fall back to, fails with that error).
   The live store is never damaged; the scratch copy is deleted.
5. A drill record (``drills/<UTC time>-<random>``, docs/format.md §12) is stored
   last, pass or fail, so ``report`` can show each run's last successful drill and
   the drills that failed since (:mod:`.drillhistory`).

The drill names its target (the newest version, or the selector's) before the
restore starts, and passes only if the target itself comes back: a restore that
had to fall back to an earlier version proves that the earlier one restores, and
that the target does not.  Such a drill is recorded as failed, with what the
fallback restored and how long it took, and names the command that rewrites the
damaged objects from another copy (``chunkstore repair``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.errors import InvalidInputError, InvalidSettingError, SelectorError
from chunkstore.format.digest import Digest
from chunkstore.format.drills import DrillRecord, ScenarioOutcome, new_drill_id
from chunkstore.format.records import RECORD_FORMAT_VERSION
from chunkstore.handle.versions import VersionInfo
from chunkstore.maintenance.drillrestore import stored_objects
from chunkstore.maintenance.retention import parse_duration
from chunkstore.maintenance.sync import Opener, sync_locations
from chunkstore.objects.kinds import CHUNKS, DRILLS, VERSIONS
from chunkstore.read.reader import VersionReader

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: The fault scenarios and the error a restore must name for each.
SCENARIOS = {"missing-chunk": "MissingChunkError", "truncated-object": "CorruptChunkError",
             "incompatible-version": "FormatVersionError"}
#: The line a ``then`` command prints once it has made its first successful update.
READY_LINE = "CHUNKSTORE-DRILL-READY"
MATERIALIZE = ("auto", "numpy", "torch")
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the package


@dataclass
class DrillResult:
    """The stored record, the restore process's own report and the drill's id;
    ``repair``: the command that mends the target when it was refused (else None)."""

    record: DrillRecord
    drill_id: str | None
    restore: dict[str, Any] = field(default_factory=dict)
    then_detail: str | None = None
    repair: str | None = None

    @property
    def ok(self) -> bool:
        return self.record.ok

    def to_json(self) -> dict[str, Any]:
        return {"drill_id": self.drill_id, **self.record.to_json(), "restore": self.restore,
                "then": self.then_detail, "repair": self.repair}


@dataclass(frozen=True)
class ChildRun:
    report: dict[str, Any]
    wall: float
    problem: str | None  # why there is no report (the process failed to run)


def check_timeout(value: object, name: str) -> float:
    """A drill's timeout in seconds (a number, a timedelta or text such as ``10m``):
    :class:`InvalidSettingError` unless it is finite and above zero."""
    try:
        seconds = parse_duration(value)
    except InvalidSettingError as exc:
        raise InvalidSettingError(f"{name}: {exc}") from None
    if seconds <= 0:
        raise InvalidSettingError(f"{name} {value!r} must be above zero")
    return seconds


def repair_command(location: str, run: str | None, step: int | None) -> str:
    """The command that rewrites what a refused target lacks from another copy of the
    store (OTHER: a mirror, a `chunkstore sync` destination)."""
    return f"chunkstore repair {location} --from OTHER {run}@{step}"


def uses_torch(materialize: str) -> bool:
    if materialize not in MATERIALIZE:
        raise InvalidInputError(f"materialize {materialize!r}: one of {', '.join(MATERIALIZE)}")
    return materialize == "torch" or (materialize == "auto" and all(
        importlib.util.find_spec(name) is not None for name in ("torch", "torch_bridge")))


def child_command(location: str, selector: str | None, torch: bool) -> list[str]:
    module = ["torch_bridge.tools.drill"] if torch else ["chunkstore", "drill-restore"]
    return [sys.executable, "-m", *module, location, *([selector] if selector else [])]


def run_child(command: list[str], timeout: float,
              child_env: Mapping[str, str] | None = None) -> ChildRun:
    """Run the restore process (with ``child_env`` added to this process's environment);
    its report is the last line of its stdout."""
    env = {**os.environ, **(child_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        return ChildRun({}, time.monotonic() - started, f"no result in {timeout:g} s")
    wall = time.monotonic() - started
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        return ChildRun({}, wall, f"the restore process exited {done.returncode}: {tail}")
    return ChildRun(report, wall, None)


# --- the first update of a command ----------------------------------------------------------


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def first_update(command: str, env: dict[str, str], timeout: float) -> tuple[bool, float, str]:
    """Run ``command`` (a shell line) until it prints :data:`READY_LINE` or exits;
    (ready, seconds, what happened).  Its other output goes to stderr."""
    started = time.monotonic()
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while True:
            left = started + timeout - time.monotonic()
            try:
                line = lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                return False, time.monotonic() - started, f"no {READY_LINE} in {timeout:g} s"
            if line is None:
                code = proc.wait()
                seconds = time.monotonic() - started
                return code == 0, seconds, f"exited {code} without {READY_LINE}"
            if line.strip() == READY_LINE:
                return True, time.monotonic() - started, f"printed {READY_LINE}"
            sys.stderr.write(line)
    finally:
        if proc.poll() is None:
            _stop(proc)
        reader.join(timeout=5)  # the group is gone, so its pipe ends
        if not reader.is_alive() and proc.stdout is not None:
            proc.stdout.close()


# --- fault scenarios ------------------------------------------------------------------------


def previous_version(store: StoreHandle, target: VersionInfo) -> VersionInfo | None:
    earlier = [v for v in store.versions(target.run) if v.step < target.step]
    return earlier[-1] if earlier else None


def _victim(copy: StoreHandle, target: str, previous: str | None) -> tuple[Digest, bool]:
    """A stored object the target needs, the previous version not if there is one;
    and whether the previous version still reads without it."""
    needed = stored_objects(copy, VersionReader(copy, copy.resolve(target)))
    if previous is not None:
        unique = needed - stored_objects(copy, VersionReader(copy, copy.resolve(previous)))
        if unique:
            return min(unique, key=lambda d: d.raw), True
    return min(needed, key=lambda d: d.raw), False


def _future_record(copy: StoreHandle, target: VersionInfo) -> str:
    """Store a commit record a newer release could have written: the target's, one
    step on, with the next record format version.  Its id, for the outcome."""
    obj = json.loads(copy.objects.get(VERSIONS, target.id))
    obj.update(format_version=RECORD_FORMAT_VERSION + 1, step=target.step + 1,
               parent=target.id, created=time.time())
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    version_id = Digest.of(data).hex
    copy.objects.put_if_absent(VERSIONS, version_id, data)
    return version_id


def inject(copy: StoreHandle, name: str, target: VersionInfo, previous: VersionInfo | None
           ) -> tuple[str, VersionInfo | None, str]:
    """Damage the scratch copy: (the version that must be refused, the one the restore
    must fall back to (None: it must fail), what was done)."""
    if name == "incompatible-version":
        future = _future_record(copy, target)
        return future, target, (f"stored a commit record of format version"
                                f" {RECORD_FORMAT_VERSION + 1} ({future[:12]}), one step on")
    victim, spares_previous = _victim(copy, target.id, previous.id if previous else None)
    if name == "missing-chunk":
        copy.objects.delete(CHUNKS, victim)
        what = f"deleted chunk object {victim.short()}"
    else:
        data = copy.objects.get(CHUNKS, victim)
        copy.objects.put(CHUNKS, victim, data[:len(data) // 2])
        what = f"truncated chunk object {victim.short()} to {len(data) // 2} of {len(data)} bytes"
    return target.id, previous if spares_previous else None, what


def judge(name: str, child: ChildRun, refused: str, fallback: VersionInfo | None,
          what: str) -> ScenarioOutcome:
    """The scenario's outcome from the restore's report."""
    expected = SCENARIOS[name]
    if child.problem is not None:
        return ScenarioOutcome(name, False, "error", f"{what}; {child.problem}", child.wall)
    failed = {a["version"]: a["error"] for a in child.report.get("attempts", ())}
    restored = child.report.get("version")
    took = f"in {child.wall:.2f} s ({child.report.get('fallback_seconds', 0):.2f} s on refusal)"
    if refused not in failed:
        outcome, ok = ("undetected" if restored == refused else "wrong-version"), False
        detail = f"{refused[:12]} was not refused; restored {str(restored)[:12]}"
    elif failed[refused] != expected:
        outcome, ok = "wrong-error", False
        detail = f"{refused[:12]} refused with {failed[refused]}, not {expected}"
    elif fallback is None:
        outcome, ok = "failed-typed", restored is None
        detail = (f"{refused[:12]} refused with {expected}; no earlier version to fall back"
                  f" to, the restore failed {took}")
    elif restored == fallback.id:
        outcome, ok = "fell-back", True
        detail = (f"{refused[:12]} refused with {expected}; restored {fallback.id[:12]}"
                  f" ({fallback.run}@{fallback.step}) {took}")
    else:
        outcome, ok = "wrong-version", False
        detail = f"restored {str(restored)[:12]}, not {fallback.id[:12]}"
    return ScenarioOutcome(name, ok, outcome, f"{what}; {detail}", child.wall)


def run_scenario(store: StoreHandle, name: str, target: VersionInfo, *, opener: Opener,
                 torch: bool, timeout: float) -> ScenarioOutcome:
    previous = previous_version(store, target)
    copied = [target.id] if previous is None or name == "incompatible-version" else [
        target.id, previous.id]
    with tempfile.TemporaryDirectory(prefix="chunkstore-drill-") as scratch:
        location = os.path.join(scratch, "store")
        sync_locations(store, location, copied, opener=opener)
        copy = opener(location)
        try:
            refused, fallback, what = inject(copy, name, target, previous)
        finally:
            copy.close()
        child = run_child(child_command(location, None, torch), timeout)
    return judge(name, child, refused, fallback, what)


# --- the drill ------------------------------------------------------------------------------


def _phases(child: ChildRun, then_seconds: float | None) -> dict[str, float | None]:
    phases: dict[str, float | None] = dict.fromkeys(
        ("startup", "discovery", "download", "validation", "materialization"))
    if child.problem is None and child.report.get("ok"):
        phases.update(child.report.get("phases", {}))
        phases["startup"] = max(child.wall - float(child.report.get("seconds", 0.0)), 0.0)
    phases["first_update"] = then_seconds
    return phases


def _record(when: float, child: ChildRun, target: VersionInfo, selector: str | None,
            then_seconds: float | None, then_ok: bool, outcomes: tuple[ScenarioOutcome, ...],
            torch: bool) -> DrillRecord:
    """The drill record: it passes only if the target itself restored."""
    restored = child.problem is None and bool(child.report.get("ok"))
    attempts = child.report.get("attempts", [])
    refused = {a["version"]: a["error"] for a in attempts}
    if child.problem is not None:
        error: str | None = child.problem
    elif target.id in refused:
        error = refused[target.id]
    elif not restored:
        error = attempts[-1]["error"] if attempts else "no version restored"
    else:
        error = None
    target_ok = restored and child.report.get("version") == target.id
    return DrillRecord(
        when, target_ok and then_ok and all(o.ok for o in outcomes), restored,
        child.report.get("version"), child.report.get("run"), child.report.get("step"),
        selector, child.wall + (then_seconds or 0.0), _phases(child, then_seconds),
        int(child.report.get("bytes_downloaded", 0)),
        str(child.report.get("materialized_as", "torch" if torch else "numpy")),
        tuple(a["version"] for a in attempts), error, outcomes,
        target.id, target.run, target.step)


def drill(store: StoreHandle, selector: str | None = None, *, scenarios: Sequence[str] = (),
          then: str | None = None, then_timeout: float = 600.0, materialize: str = "auto",
          opener: Opener, record: bool = True, timeout: float = 3600.0,
          clock: Callable[[], float] = time.time,
          child_env: Mapping[str, str] | None = None) -> DrillResult:
    """Restore ``selector``'s version (default: the newest) in a fresh process, then
    the fault ``scenarios``; store and return the record.

    The drill passes only if that version itself restores: when it is refused and
    the restore falls back to an earlier one, the record is a failure that names
    both (``DrillResult.repair`` says how to mend the target).  ``timeout`` (each
    restore process) and ``then_timeout`` are seconds, a timedelta or text such as
    ``10m``, above zero: anything else is :class:`InvalidSettingError`, before
    anything runs.

    The restore process opens the store by its URL alone: ``child_env`` is added to
    its environment (and to ``then``'s), which is how the CLI hands it the storage
    options it was given (``CHUNKSTORE_STORAGE_OPTIONS``).  The scenarios' processes
    restore local scratch copies and need none."""
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise InvalidInputError(f"unknown drill scenario {unknown[0]!r}: one of"
                                f" {', '.join(SCENARIOS)}")
    timeout = check_timeout(timeout, "timeout")
    then_timeout = check_timeout(then_timeout, "then_timeout")
    torch = uses_torch(materialize)
    target = store.resolve(selector) if selector is not None else store.latest()
    if target is None:
        raise SelectorError("latest", "the store has no version to drill")
    when = clock()
    child = run_child(child_command(store.url, selector, torch), timeout, child_env)
    then_seconds, then_ok, then_detail = None, True, None
    if then is not None and child.problem is None and child.report.get("ok"):
        env = {**(child_env or {}), "CHUNKSTORE_DRILL_STORE": store.url,
               "CHUNKSTORE_DRILL_VERSION": str(child.report["version"]),
               "CHUNKSTORE_DRILL_RUN": str(child.report["run"]),
               "CHUNKSTORE_DRILL_STEP": str(child.report["step"])}
        then_ok, then_seconds, then_detail = first_update(then, env, then_timeout)
    outcomes = tuple(run_scenario(store, name, target, opener=opener, torch=torch,
                                  timeout=timeout) for name in scenarios)
    result = _record(when, child, target, selector, then_seconds, then_ok, outcomes, torch)
    drill_id = new_drill_id(when) if record else None
    if drill_id is not None:
        store.objects.put(DRILLS, drill_id, result.encode())
    repair = (repair_command(store.url, target.run, target.step) if result.target_failed
              else None)
    return DrillResult(result, drill_id, child.report, then_detail, repair)
