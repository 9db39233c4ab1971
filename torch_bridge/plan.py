"""How often to checkpoint: Young's and Daly's optimum interval (no torch needed).

With save cost C (seconds the job pauses per save) and mean time between
failures M, a failure loses on average half an interval of work plus the
restart, and every save costs C.  Young (1974): T = sqrt(2 C M).  Daly (2006),
to higher order: T = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C
for C < 2M, else T = M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import InvalidInputError


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
    def steps(self) -> int | None:
        if self.step_seconds is None:
            return None
        return max(1, round(self.daly_seconds / self.step_seconds))

    def to_json(self) -> dict[str, Any]:
        return {"save_seconds": self.save_seconds, "mtbf_seconds": self.mtbf_seconds,
                "interval_seconds": round(self.daly_seconds, 3),
                "young_interval_seconds": round(self.young_seconds, 3),
                "interval_steps": self.steps, "expected_overhead": round(self.overhead, 6)}


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
