"""How serve's route was chosen: measured by ``arcsplit tune`` on these cards, asked for with ``--mode``, or the
fixed default order. One frozen value made where serve decides (decide/prepare.py; tuning/picks.tuned for a tuned
pick), carried in the supervisor's status, its state file and its ``plan`` event; the surfaces (the dashboard,
``arcsplit ps``, the metrics endpoint) only render it. ``to_dict`` is its wire form, ``from_dict`` reads it back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Mapping


class ChosenBy(StrEnum):
    TUNE = "tune"  # arcsplit tune measured it fastest and correct on these cards
    ASKED = "asked"  # the user named the mode (--mode), or a layout's other hosts (tune measures this machine only)
    DEFAULT = "default"  # the fixed default order (one context > debug key > hybrid > all-RPC)


class Outcome(StrEnum):
    """A candidate's result, kept as its plain value in the results JSON (a later run reads it back)."""

    OK = "ok"  # correct output (against the reference), measured
    WRONG = "wrong"  # loads but computes wrong: never measured, never picked
    FAILED = "failed"  # did not start or answer
    PRUNED = "pruned"  # the planner's memory bounds refuse it: never started
    UNCHECKED = "unchecked"  # ran, no reference yet (settled by the routes' agreement)


@dataclass(frozen=True)
class Measured:
    """One candidate tune measured: its label, verdict and figures (t/s; ``ttft`` in ms; None where it was not
    measured: a result kept before tune measured time to first token has none)."""

    label: str
    status: Outcome
    decode: float | None = None
    prefill: float | None = None
    streams: float | None = None
    reason: str = ""
    pick: bool = False
    default: bool = False  # what the default order runs untuned
    key: str = ""  # the candidate's key in tune's results ("cpu:rpc:defaults")
    second: float | None = None  # the objective's figure in the second round (the fastest and the default, again)
    ttft: float | None = None  # ms, client clock: tune's prefill request (a prompt, one token, no prompt cache)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "status": self.status, "decode": self.decode,
                "prefill": self.prefill, "streams": self.streams, "ttft": self.ttft, "reason": self.reason,
                "pick": self.pick, "default": self.default, "second": self.second}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Measured":
        return cls(str(d.get("label", "")), _outcome(d.get("status")), _num(d.get("decode")), _num(d.get("prefill")),
                   _num(d.get("streams")), str(d.get("reason") or ""), bool(d.get("pick")), bool(d.get("default")),
                   str(d.get("key") or ""), _num(d.get("second")), _num(d.get("ttft")))

    def figure(self, objective: str) -> float | None:
        """Its figure by ``objective``: t/s for decode, prefill or streams, ms for ttft."""
        figures = {"decode": self.decode, "prefill": self.prefill, "streams": self.streams, "ttft": self.ttft}
        return figures.get(objective)


def _outcome(v: Any) -> Outcome:
    try:
        return Outcome(str(v))
    except ValueError:  # a results file from a newer arcsplit: shown as not measured
        return Outcome.FAILED


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class RouteChoice:
    """Why this route runs. ``by`` TUNE: ``label`` is the pick, its figures measured by ``objective`` at
    ``tuned_at`` (time.time()), ``alternatives`` every candidate measured (the pick first). Otherwise ``note`` says
    why no tuned result applies ("not tuned", "--no-tune", "--mode rpc")."""

    by: ChosenBy
    mode: str
    label: str = ""
    objective: str = ""
    tuned_at: float | None = None
    decode: float | None = None
    prefill: float | None = None
    streams: float | None = None
    alternatives: tuple[Measured, ...] = ()
    note: str = ""
    key: str = ""  # tune's key for the route ("cpu:rpc:defaults"), where tune measured it
    ttft: float | None = None  # ms: tune's time to first token (None in a choice kept before tune measured it)

    @classmethod
    def untuned(cls, mode: str, asked: bool, note: str = "") -> "RouteChoice":
        """The choice of a run no tuned result drives: the user's ``--mode``, else the default order."""
        if asked:
            return cls(ChosenBy.ASKED, mode, note=note or f"--mode {mode}")
        return cls(ChosenBy.DEFAULT, mode, note=note or "not tuned")

    def to_dict(self) -> dict[str, Any]:
        return {"by": self.by, "mode": self.mode, "label": self.label, "objective": self.objective,
                "tuned_at": self.tuned_at, "decode": self.decode, "prefill": self.prefill, "streams": self.streams,
                "ttft": self.ttft, "alternatives": [a.to_dict() for a in self.alternatives], "note": self.note,
                "key": self.key}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RouteChoice":
        try:
            by = ChosenBy(str(d.get("by")))
        except ValueError:  # a newer arcsplit's reason: shown as the default order rather than not at all
            by = ChosenBy.DEFAULT
        at = d.get("tuned_at")
        return cls(by, str(d.get("mode", "")), str(d.get("label") or ""), str(d.get("objective") or ""),
                   None if at is None else float(at), _num(d.get("decode")), _num(d.get("prefill")),
                   _num(d.get("streams")), tuple(Measured.from_dict(a) for a in d.get("alternatives") or ()),
                   str(d.get("note") or ""), str(d.get("key") or ""), _num(d.get("ttft")))

    @property
    def tuned(self) -> bool:
        return self.by is ChosenBy.TUNE

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.tuned_at)) if self.tuned_at else "?"

    def line(self) -> str:
        """The one line every surface shows."""
        if self.by is ChosenBy.TUNE:
            ttft = f", first token {self.ttft:.1f} ms" if self.ttft is not None else ""
            return (f"route: {self.label}, chosen by arcsplit tune ({self.objective}, {self.when()}): decode "
                    f"{self.decode or 0:.1f} t/s, prefill {self.prefill or 0:.1f} t/s, streams {self.streams or 0:.1f} "
                    f"t/s{ttft}, output checked")
        if self.by is ChosenBy.ASKED:
            return f"route: {self.mode}, as asked ({self.note}; not tuned)"
        return f"route: {self.mode} by the default order ({self.note})"

    def table(self) -> list[str]:
        return table(self.alternatives, self.objective)


LEGEND = ("* the pick, d the default order's route; 2nd: a second round of the fastest and the default, back to "
          "back (the default stays unless the fastest wins it too)")


def table(alternatives: tuple[Measured, ...], objective: str) -> list[str]:
    """The candidates tune measured: a header, then one line each, marked as LEGEND says, with the first round's
    figures (t/s; time to first token in ms), the second round's by ``objective`` where it ran (a faster-looking
    candidate that lost it is not the pick), and the note whole."""
    def fig(v: float | None, width: int) -> str:
        return f"{v:>{width}.1f}" if v is not None else f"{'-':>{width}}"

    out = [f"{'':2} {'route [settings]':<40} {'status':<9} {'prefill':>8} {'decode':>7} {'streams':>8} "
           f"{'ttft ms':>8} {'2nd ' + objective:>11}  note"]
    for a in alternatives:
        mark = ("*" if a.pick else "") + ("d" if a.default else "")  # "*d": the pick is the default's route
        second = fig(a.second, 11) if a.second is not None else f"{'':>11}"
        out.append(f"{mark:>2} {a.label:<40} {a.status:<9} {fig(a.prefill, 8)} {fig(a.decode, 7)} {fig(a.streams, 8)} "
                   f"{fig(a.ttft, 8)} {second}  {a.reason}".rstrip())
    return out


@dataclass(frozen=True)
class RuledOut:
    """A route that evidence kept for this rig rules out of serve's list: ``mode``'s default-order route (or a
    tuned route, by ``label``) computed wrong here (``arcsplit tune``, ``doctor --verify`` or the output canary of
    an earlier run), with ``why``."""

    mode: str
    label: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "label": self.label, "why": self.why}
