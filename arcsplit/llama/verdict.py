"""Known good / known bad / unknown, from versions alone, with the rule and its sources.

The rules live in ``arcsplit/data/known_runtimes.toml`` so a new runtime report is one table entry, not code.
A verdict is a prior: the probe (probe.py) is the ground truth on the machine itself.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ArcsplitError
from .facts import Facts, parse_kernel_release

STATUSES = ("good", "bad", "unknown")
_CONDITIONS = {"backend", "neo_build_min", "neo_build_max", "kernel_min", "kernel_below", "kernel_pattern",
               "move_notify", "neo_known", "xe_backport"}
_RESULTS = {"id", "status", "affects", "summary", "sources", "workaround_env"}


@dataclass(frozen=True)
class Rule:
    id: str
    status: str
    affects: str
    summary: str
    sources: tuple[str, ...]
    conditions: tuple[tuple[str, Any], ...]
    workaround_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Verdict:
    """What the versions say; ``workaround_env`` is the env to try for a multi-device failure."""

    status: str
    rule: str
    summary: str
    sources: tuple[str, ...]
    affects: str = "multi-device"
    workaround_env: tuple[tuple[str, str], ...] = ()
    inputs: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def env(self) -> dict[str, str]:
        return dict(self.workaround_env)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "rule": self.rule, "summary": self.summary, "sources": list(self.sources),
                "affects": self.affects, "workaround_env": self.env, "inputs": dict(self.inputs)}


def parse_rules(text: str, origin: str = "known_runtimes.toml") -> tuple[Rule, ...]:
    """Validate the table strictly: a typo in a condition would otherwise silently match everything."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ArcsplitError(f"{origin} is not valid TOML ({exc})", "fix the rule table") from None
    rules = []
    for i, raw in enumerate(data.get("rule", [])):
        unknown = set(raw) - _CONDITIONS - _RESULTS
        if unknown:
            raise ArcsplitError(f"{origin}: rule {i} has unknown keys {sorted(unknown)}", "use the keys listed in its header")
        if raw.get("status") not in STATUSES or not raw.get("id") or not raw.get("summary"):
            raise ArcsplitError(f"{origin}: rule {i} needs id, summary and status in {STATUSES}", "complete the rule")
        for key in ("kernel_min", "kernel_below"):
            if key in raw and parse_kernel_release(str(raw[key])) is None:
                raise ArcsplitError(f"{origin}: rule {raw['id']}: {key} {raw[key]!r} is not a version", "write it like \"7.1\"")
        rules.append(Rule(
            id=raw["id"], status=raw["status"], affects=raw.get("affects", "multi-device"), summary=raw["summary"],
            sources=tuple(raw.get("sources", ())),
            conditions=tuple((k, v) for k, v in raw.items() if k in _CONDITIONS),
            workaround_env=tuple((str(k), str(v)) for k, v in raw.get("workaround_env", {}).items()),
        ))
    return tuple(rules)


@lru_cache(maxsize=1)
def known_rules() -> tuple[Rule, ...]:
    # By path, not importlib.resources: an editable install can hand back a MultiplexedPath that cannot read it.
    text = (Path(__file__).resolve().parent.parent / "data" / "known_runtimes.toml").read_text(encoding="utf-8")
    return parse_rules(text)


def _matches(rule: Rule, backend: str, neo_build: int | None, kernel_release: str | None,
             move_notify: bool | None, xe_backport: bool | None = None) -> bool:
    kernel = parse_kernel_release(kernel_release) if kernel_release else None
    for key, want in rule.conditions:
        if key == "backend" and backend != want:
            return False
        if key == "neo_known" and (neo_build is not None) != bool(want):
            return False
        if key == "neo_build_min" and (neo_build is None or neo_build < want):
            return False
        if key == "neo_build_max" and (neo_build is None or neo_build > want):
            return False
        if key == "kernel_min" and (kernel is None or kernel < (parse_kernel_release(want) or ())):
            return False
        if key == "kernel_below" and (kernel is None or kernel >= (parse_kernel_release(want) or ())):
            return False
        if key == "kernel_pattern" and (kernel_release is None or not re.search(want, kernel_release)):
            return False
        if key == "move_notify" and move_notify is not want:
            return False
        if key == "xe_backport" and xe_backport is not want:
            return False
    return True


def judge(backend: str, neo_build: int | None, kernel_release: str | None, move_notify: bool | None,
          rules: tuple[Rule, ...] | None = None, xe_backport: bool | None = None) -> Verdict:
    """The first matching rule's verdict; no rule matching is itself an honest "unknown"."""
    inputs = (("backend", backend), ("neo_build", str(neo_build)), ("kernel", str(kernel_release)),
              ("dmabuf_move_notify", str(move_notify)), ("xe_backport", str(xe_backport)))
    for rule in rules if rules is not None else known_rules():
        if _matches(rule, backend, neo_build, kernel_release, move_notify, xe_backport):
            return Verdict(rule.status, rule.id, rule.summary, rule.sources, rule.affects, rule.workaround_env, inputs)
    return Verdict("unknown", "no-rule", "no known-runtime rule covers these versions", (), inputs=inputs)


def verdict_for(backend: str, facts: Facts) -> Verdict:
    return judge(backend, facts.neo.build if facts.neo else None, facts.kernel.release, facts.kernel.move_notify,
                 xe_backport=facts.kernel.xe_backport)
