"""How often to checkpoint: Young's and Daly's optimum interval (no torch needed).

With save cost C (seconds the job pauses per save) and mean time between
failures M, a failure loses on average half an interval of work plus the
restart, and every save costs C.  Young (1974): T = sqrt(2 C M).  Daly (2006),
to higher order: T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C
for C < 2M, else T = M.

Both assume a save is short against the time between failures.  When it is
not, no interval helps: even the best one leaves the job spending as much
time on saves and redone work as on progress (expected overhead of 100% or
more), so the plan says so instead of recommending an interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import InvalidInputError

#: At or above this expected overhead (saves plus redone work, as a fraction of
#: run time) checkpointing at any interval costs the job more than it gets done.
MAX_SENSIBLE_OVERHEAD = 1.0


@dataclass(frozen=True)
class Plan:
    save_seconds: float
    mtbf_seconds: float
    young_seconds: float
    daly_seconds: float
    step_seconds: float | None = None

    @property
    def overhead(self) -> float:
        """Expected fraction of time lost to saves and re-done work at Daly's interval."""
        interval = self.daly_seconds
        return self.save_seconds / interval + (interval + self.save_seconds) / (
            2 * self.mtbf_seconds)

    @property
    def sensible(self) -> bool:
        """Whether any interval makes sense: a save well short of the time between
        failures, and the best interval's overhead below :data:`MAX_SENSIBLE_OVERHEAD`."""
        return (self.save_seconds < 2 * self.mtbf_seconds
                and self.overhead < MAX_SENSIBLE_OVERHEAD)

    @property
    def warning(self) -> str | None:
        """Why no interval makes sense, or None when one does."""
        if self.sensible:
            return None
        return (f"no save interval makes sense: a save pauses the job {self.save_seconds:g} s"
                f" and it fails every {self.mtbf_seconds:g} s on average; at Young/Daly's"
                f" interval ({self.daly_seconds:.1f} s) it would lose"
                f" {100 * self.overhead:.0f}% of its run time to saves and redone work, and"
                " no interval does much better. Make saves cheaper (async saves pause only"
                " for the copy to host memory) or the job more reliable")

    @property
    def steps(self) -> int | None:
        if self.step_seconds is None:
            return None
        return max(1, round(self.daly_seconds / self.step_seconds))

    def to_json(self) -> dict[str, Any]:
        """The plan; ``interval_seconds`` and ``interval_steps`` are null when no
        interval makes sense (``sensible`` false, ``warning`` says why)."""
        sensible = self.sensible
        return {"save_seconds": self.save_seconds, "mtbf_seconds": self.mtbf_seconds,
                "sensible": sensible, "warning": self.warning,
                "interval_seconds": round(self.daly_seconds, 3) if sensible else None,
                "young_interval_seconds": round(self.young_seconds, 3),
                "interval_steps": self.steps if sensible else None,
                "expected_overhead": round(self.overhead, 6)}


def plan(save_seconds: float, mtbf_hours: float, step_seconds: float | None = None) -> Plan:
    """The interval between saves that minimises pause cost plus expected lost work."""
    if not (save_seconds > 0 and math.isfinite(save_seconds)):
        raise InvalidInputError(f"save seconds must be a positive number, got {save_seconds}")
    if not (mtbf_hours > 0 and math.isfinite(mtbf_hours)):
        raise InvalidInputError(f"MTBF must be a positive number of hours, got {mtbf_hours}")
    if step_seconds is not None and not (step_seconds > 0 and math.isfinite(step_seconds)):
        raise InvalidInputError(f"step seconds must be a positive number, got {step_seconds}")
    cost, mtbf = save_seconds, mtbf_hours * 3600.0
    young = math.sqrt(2 * cost * mtbf)
    if cost < 2 * mtbf:
        ratio = cost / (2 * mtbf)
        daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    else:
        daly = mtbf
    return Plan(cost, mtbf, young, daly, step_seconds)
