"""The routes serve may run, decided once before anything starts: an ordered list the supervisor moves down.

The first route is what serve runs; the others are what it moves to when that one keeps failing to load, hangs
again and again, or computes wrong (run/fallback.py says when). Where the list comes from:

- ``arcsplit tune``'s ranking of the routes it found correct on this rig (tuning/picks.tuned), the pick first;
- else the default order (modes.AUTO_ORDER as llama/mode.py applies it): auto's choice first, then every slower
  mode it would accept here. A mode the runtime verdict, the probe, a recorded failure or a kept "computes wrong"
  rules out is left out, with why;
- ``--mode X``: the user asked for one route, and the list is that route alone.

Each route is planned completely here (its ServeConfig), so the supervisor never plans while it runs. Pure
records: decide/prepare.py builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..llama.mode import ModeDecision
from .choice import RouteChoice
from .specs import ServeConfig


@dataclass(frozen=True)
class RouteEntry:
    """One route of the list: its ``label`` (the mode, or tune's label of the route), the complete config, why this
    mode (``decision``), how it was chosen (``choice``), and ``key``: tune's key for it, where tune measured it."""

    label: str
    config: ServeConfig
    decision: ModeDecision
    choice: RouteChoice
    why: str
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "mode": self.config.mode, "why": self.why, "key": self.key}


@dataclass(frozen=True)
class RouteList:
    """The routes in the order serve tries them, and those ``left_out`` (label, why). ``asked``: ``--mode`` named
    the one route, so there is nothing to move to."""

    routes: tuple[RouteEntry, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    asked: bool = False

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("a route list holds at least one route")

    @property
    def first(self) -> RouteEntry:
        return self.routes[0]

    @classmethod
    def one(cls, entry: RouteEntry, asked: bool = False) -> "RouteList":
        return cls((entry,), (), asked)

    def to_dict(self) -> dict[str, Any]:
        return {"routes": [r.to_dict() for r in self.routes],
                "left_out": [{"label": label, "why": why} for label, why in self.left_out], "asked": self.asked}

    def lines(self) -> list[str]:
        """What serve says before the group starts: the order, and what was left out and why."""
        if self.asked:
            return [f"routes: {self.first.label} only (--mode names one route: if it keeps failing or computes "
                    "wrong, serve stops rather than move to another)"]
        out = [f"routes, in order: {', '.join(r.label for r in self.routes)}"
               + (" (the next is run if the one before keeps failing, hangs or computes wrong)"
                  if len(self.routes) > 1 else " (no other route here)")]
        out += [f"route {label} left out: {why}" for label, why in self.left_out]
        return out


def entry(config: ServeConfig, decision: ModeDecision, choice: RouteChoice, why: str, label: str = "",
          key: str = "") -> RouteEntry:
    """A route of the list, labelled by its mode unless tune named it."""
    return RouteEntry(label or str(config.mode), config, decision, choice, why, key)
