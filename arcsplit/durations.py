"""Durations as people type them: ``90``, ``90s``, ``5m``, ``1h``, ``1h30m``, ``1.5m``, ``250ms``.

One owner for every flag and API field that takes a duration (``--budget``, ``--per-candidate``, ``--heartbeat``,
timeouts, the output canary's interval): plain numbers are seconds, as before. ``parse`` returns seconds as a float;
``argtype`` makes an argparse ``type=`` that turns a bad value into the CLI's one-line usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

from .errors import BadInput

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
HELP = "seconds, or with a unit: 90s, 5m, 1h"
# serve --canary-every (ServeRequest.canary_every): 1 s (a check then runs back to back: tests) to 7 days (next to
# never); decide/prepare.py's CANARY_EVERY_S is the default and says why.
CANARY_MIN_S, CANARY_MAX_S = 1.0, 7 * 86400.0
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?", re.IGNORECASE)


def parse(text: str | float | int, *, flag: str = "duration", minimum: float = 0.0, maximum: float = 30 * 86400.0,
          allow_zero: bool = False) -> float:
    """Seconds in ``text``; BadInput naming ``flag`` and the fix for anything else (negative, nan, inf, zero unless
    ``allow_zero``, outside ``minimum``..``maximum``, an unknown unit)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        seconds = 0.0
        pos = 0
        while pos < len(s):
            m = _PART.match(s, pos)
            if m is None or (m.group(2) is None and m.end() != len(s)) or (m.group(2) is None and pos > 0):
                raise BadInput(f"{flag} {text!r} is not a duration", f"give {HELP}")
            seconds += float(m.group(1)) * UNITS[(m.group(2) or "s").lower()]
            pos = m.end()
        if not s:
            raise BadInput(f"{flag} is empty", f"give {HELP}")
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise BadInput(f"{flag} {text!r} is not a duration", f"give {HELP}")
    if seconds == 0 and allow_zero:
        return 0.0
    if seconds == 0 or seconds < minimum:
        low = f"at least {minimum:g} s" if minimum else "more than 0"
        raise BadInput(f"{flag} {text!r} is too short", f"give {low} ({HELP})")
    if seconds > maximum:
        raise BadInput(f"{flag} {text!r} is too long", f"give at most {format_s(maximum)} ({HELP})")
    return seconds


def argtype(flag: str, **limits: float | bool) -> Callable[[str], float]:
    """An argparse ``type=`` for a duration flag: the CLI's one-line usage error and exit 2 on a bad value."""

    def convert(text: str) -> float:
        try:
            return parse(text, flag=flag, **limits)  # type: ignore[arg-type]
        except BadInput as exc:  # argparse says "argument --budget: " before the message: the flag once
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    convert.__name__ = "duration"  # argparse names the type in its message: "invalid duration value"
    return convert


def format_s(seconds: float) -> str:
    """A duration the way a person reads it: 45 s, 5 min, 1 h 30 min."""
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200:
        return f"{seconds / 60:g} min"
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h} h {rest // 60} min" if rest >= 60 else f"{h} h"
