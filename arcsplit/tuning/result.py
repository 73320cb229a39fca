"""What ``arcsplit.tune()`` returns: a frozen view of one tune run (tuning/runner.py's TuneReport is its working
record, kept per fingerprint as it goes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..decide.choice import LEGEND, Measured, table
from ..objectives import gain


@dataclass(frozen=True)
class TuneResult:
    """One tune run: every candidate tried, in order, with its status (ok, wrong, failed, pruned, unchecked) and
    figures (t/s; time to first token in ms), the pick (the best correct one by ``objective``; None when none was
    correct) and the route the default order runs untuned. ``serve`` uses the pick for this rig from now on."""

    objective: str  # decode | prefill | streams | ttft
    candidates: tuple[Measured, ...]  # in the order tried (a pruned one has no figures, a wrong one its reason)
    pick: Measured | None
    default: Measured | None
    wall_s: float  # this run's own time, start-ups included
    reused: int  # results kept from an earlier run for this fingerprint instead of measured again
    not_tried: tuple[str, ...]  # candidate keys the budget left out
    fingerprint: str  # the digest results are kept under (cards, drivers, build, model, context, slots)

    @property
    def speedup(self) -> float | None:
        """How much better the pick is than the default order's route by ``objective`` (its rate over theirs; for
        ttft their time over its time), so above 1 is a gain either way; None where either is missing."""
        mine = self.pick.figure(self.objective) if self.pick else None
        theirs = self.default.figure(self.objective) if self.default else None
        if not (mine and theirs):
            return None
        return gain(self.objective, mine, theirs)

    def table(self) -> list[str]:
        """Every candidate in the order tried, as every surface shows tune's results (decide/choice.py table)."""
        return table(self.candidates, self.objective)

    legend: ClassVar[str] = LEGEND  # what the table's marks and its 2nd column mean

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "candidates": [c.to_dict() for c in self.candidates],
                "pick": self.pick.key if self.pick else None, "default": self.default.key if self.default else None,
                "wall_s": self.wall_s, "reused": self.reused, "not_tried": list(self.not_tried),
                "fingerprint": self.fingerprint}
