"""When the supervisor leaves a route for the next one of its list (decide/routes.py), and what it says when none is
left. The list is decided before the group starts; this only walks it. Pure but for the clock it is given.

A route is left:
- at once, when the canary finds it computing wrong (run/canary.py): every answer it gives is suspect;
- at once, when a one-context load fails the way hybrid avoids (logs.MULTI_DEVICE_KINDS: NEO's multi-device
  allocation failure, llama.cpp's pinned output copy): it fails the same way on every start;
- after ``load_failures`` (3) failed loads in a row: one retry covers a transient (a port taken meanwhile, a slow
  disk), a third failure of the same start is the route;
- after ``hangs`` (3) hangs within ``hang_window`` (30 min): the field reports hangs after 2-6 h of load on one
  route, which a restart clears; three in half an hour is a route that hangs, not a rare event, and each costs its
  detection and a restart (about a minute) of service;
- when the restart cap is reached on it (RestartPolicy): whatever keeps failing, another route may not.
With no route left, a mismatch or the cap stops the run with every route's reason; a load failure or a hang keeps
the last route restarting under the cap, as a group with one route always did.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..decide.routes import RouteEntry, RouteList
from ..llama.logs import MULTI_DEVICE_KINDS
from ..modes import Mode
from ..proc.states import Cause


class Leave(StrEnum):
    """Why a route was left (the ``reason`` label of arcsplit_route_changes_total)."""

    WRONG = "wrong"  # the output canary's answer differs from the reference
    MULTI_DEVICE = "multi_device"  # a one-context load failed the way hybrid avoids
    LOAD = "load"  # failed loads in a row
    HANG = "hang"  # hangs within the window
    RESTARTS = "restarts"  # the restart cap, reached on this route


@dataclass(frozen=True)
class FallbackPolicy:
    load_failures: int = 3
    hangs: int = 3
    hang_window: float = 1800.0


@dataclass(frozen=True)
class RouteMove:
    """One move down the list: the route ``left``, why (``reason`` and the failure's one-line ``message``), the route
    run now (``to``; None: the list ran out), and when (time.time())."""

    left: RouteEntry
    reason: Leave
    message: str
    to: RouteEntry | None
    at: float

    def line(self) -> str:
        """The one line serve says."""
        why = {Leave.WRONG: "computes wrong", Leave.MULTI_DEVICE: "fails to load in one context here",
               Leave.LOAD: "failed to load again and again", Leave.HANG: "hung again and again",
               Leave.RESTARTS: "kept failing (restart cap)"}[self.reason]
        now = f"now {self.to.label}" if self.to else "no route left"
        return f"route {self.left.label} {why} ({self.message[:200]}); {now}"

    def to_dict(self) -> dict[str, Any]:
        return {"left": self.left.label, "reason": self.reason, "message": self.message,
                "to": self.to.label if self.to else None, "at": self.at}


class RouteTracker:
    """Which route of ``routes`` runs, what each failure counts toward leaving it, and the moves so far."""

    def __init__(self, routes: RouteList, policy: FallbackPolicy = FallbackPolicy()) -> None:
        self.routes = routes
        self.policy = policy
        self.index = 0
        self.moves: list[RouteMove] = []
        self._loads = 0
        self._hangs: deque[float] = deque()

    @property
    def current(self) -> RouteEntry:
        return self.routes.routes[self.index]

    @property
    def next(self) -> RouteEntry | None:
        return self.routes.routes[self.index + 1] if self.index + 1 < len(self.routes.routes) else None

    def ready(self) -> None:
        """The group got ready: failed loads no longer run in a row."""
        self._loads = 0

    def why_leave(self, cause: Cause, kind: str | None, loaded: bool, now: float) -> Leave | None:
        """Whether this failure (its cause, its log kind, whether the group had been ready) leaves the route."""
        if cause is Cause.WRONG:
            return Leave.WRONG
        if kind in MULTI_DEVICE_KINDS and Mode(self.current.config.mode).one_context:
            return Leave.MULTI_DEVICE
        if not loaded:
            self._loads += 1
            if self._loads >= self.policy.load_failures:
                return Leave.LOAD
        if cause is Cause.HANG:
            self._hangs.append(now)
            while self._hangs and now - self._hangs[0] > self.policy.hang_window:
                self._hangs.popleft()
            if len(self._hangs) >= self.policy.hangs:
                return Leave.HANG
        return None

    def move(self, reason: Leave, message: str, now: float) -> RouteMove:
        """Leave the current route for the next (``to`` None where there is none: the route stays, the move is
        recorded only when it ends the run, see ``exhausted``)."""
        move = RouteMove(self.current, reason, message, self.next, now)
        self.moves.append(move)
        if move.to is not None:
            self.index += 1
            self._loads = 0
            self._hangs.clear()
        return move

    def exhausted(self, last: str) -> str:
        """The one-line reason the run stops: each route tried and why it was left (``last``: the current route's
        last error, when no move recorded it)."""
        tried = [f"{m.left.label}: {m.reason} ({m.message[:160]})" for m in self.moves]
        if not self.moves or self.moves[-1].to is not None:
            tried.append(f"{self.current.label}: {last[:160]}")
        return f"no route left ({len(tried)} tried): " + "; ".join(tried)

    def to_dict(self) -> dict[str, Any]:
        """status()["routes"]: the route now, the list, the moves (why each route was left), what was left out."""
        return {"now": self.current.label, "index": self.index, **self.routes.to_dict(),
                "moves": [m.to_dict() for m in self.moves]}


def route_lines(routes: dict[str, Any] | None, canary: dict[str, Any] | None) -> list[str]:
    """The route now among the routes decided at the start, why each earlier one was left, and the output canary's
    last word (status's ``routes`` and ``canary``; nothing from an instance too old to say)."""
    out = []
    if routes and routes.get("routes"):
        labels = [str(x.get("label")) for x in routes["routes"]]
        out.append(f"route now: {routes.get('now')} ({int(routes.get('index') or 0) + 1} of {len(labels)}: "
                   f"{', '.join(labels)})")
        out += [f"left {m.get('left')}: {m.get('reason')} ({str(m.get('message'))[:160]})"
                for m in routes.get("moves") or []]
        out += [f"left out {x.get('label')}: {str(x.get('why'))[:160]}" for x in routes.get("left_out") or []]
    if canary and canary.get("on"):
        last = canary.get("last") or {}
        counts = ", ".join(f"{k} {v}" for k, v in sorted((canary.get("counts") or {}).items())) or "none yet"
        out.append(f"output canary: every {float(canary.get('every') or 0):g} s while idle, reference "
                   f"{canary.get('reference') or 'not yet'}; checks: {counts}"
                   + (f"; last: {last.get('verdict')} in {float(last.get('seconds') or 0):.1f} s" if last else ""))
    elif canary is not None:
        out.append("output canary: off")
    return out
