"""Why a member failed, in words, with the log lines that show it; and the faults counted per card.

A failure is one line that names the cause ("rpc1 (SYCL1) lost its device", "llama-server ran out of memory on
CUDA0", "rpc0 exited with signal 9 (killed)") and quotes at most one log line, for the places that print one line
(the CLI's final error, systemd's STATUS, the Prometheus label); the lines that show it go beside it, for the
surfaces that print several (``arcsplit ps``, the dashboard, the serve terminal). The card faults a driver reports
(llama/logs.py FAULT_KINDS) name the cause the restart is counted under, and are counted per plan card: a card lost
RESET_AFTER times in one run is named as needing a driver reset, with how (llama/resets.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..decide.specs import ProcessSpec, ServeConfig
from ..llama import logs
from ..llama.resets import reset_advice
from ..proc.child import exit_words
from ..proc.states import Cause
from ..roles import Role

CAUSE_OF_KIND: Mapping[str, Cause] = {"device_lost": Cause.DEVICE_LOST, "device_error": Cause.DEVICE_LOST,
                                      "hang": Cause.HANG, "out_of_memory": Cause.OUT_OF_MEMORY}
# A card whose device is lost this many times in one run needs a driver reset. One loss is often transient: the
# driver resets the engine and the restarted member gets a working context. A second on the same card after that
# fresh start says the restart did not help (on xe the device may be wedged: every call fails until recovered),
# and it comes before the restart cap (RestartPolicy.max_failures, 5) gives up on the group.
RESET_AFTER = 2
# How each kind is said, {who} being the member and {card} its card: "{who} ({card}) ..." or "... on {card}".
_WORDS = {
    "device_lost": "{who}{on} lost its device",
    "device_error": "{who}{on} lost its CUDA context (a CUDA error that ends the process)",
    "hang": "{who}{on} hung: the driver stopped a kernel that ran too long",
    "out_of_memory": "{who} ran out of memory{at}",
    "alloc": "{who} could not allocate a buffer{at}",
}


@dataclass(frozen=True)
class Failure:
    """What ended a member: the one-line ``message``, the ``lines`` that show it, the log ``kind``
    (logs.failure_kind: what the fallback reads), the ``cause`` it is counted under and the ``card`` it was on."""

    message: str
    lines: tuple[str, ...]
    kind: str | None
    cause: Cause
    card: str | None


def who(spec: ProcessSpec) -> str:
    """How messages name a member: "llama-server", "rpc0"."""
    return "llama-server" if spec.role == Role.SERVER else spec.name


def fault_card(config: ServeConfig, spec: ProcessSpec | None, lines: Sequence[str] = ()) -> str | None:
    """The card a member's fault is on, by its own name ("SYCL1", not llama-server's "RPC1"): the one it holds, or of
    several the one the fault line names ("current device: 1"), else all of them ("SYCL0,SYCL1"); None for a member
    that holds none."""
    if spec is None:
        return None
    held = sorted(i for i in spec.cards if 0 <= i < len(config.plan.cards))
    if not held:
        return None
    names = [config.plan.cards[i].card.device for i in held]  # the card's own name: llama-server's may be "RPC1"
    pos = logs.fault_position(lines) if len(held) > 1 else None
    return names[pos] if pos is not None and pos < len(names) else ",".join(names)


def judge(config: ServeConfig, spec: ProcessSpec, lines: Sequence[str], rc: int | None, phase: str = "") -> Failure:
    """The failure of member ``spec`` that exited with ``rc``, from the lines it printed this generation. ``phase``:
    " while starting", " while llama-server was loading" or ""."""
    lines = list(lines)
    kind, fault = logs.failure_kind(lines), logs.fault_kind(lines)
    card = fault_card(config, spec, lines)
    said = fault or (kind if kind in _WORDS else None)
    if said is not None:
        head = _WORDS[said].format(who=who(spec), on=f" ({card})" if card else "", at=f" on {card}" if card else "")
    else:
        head = f"{who(spec)}{f' ({card})' if card else ''} {exit_words(rc)}"
    shown = tuple(logs.deciding_lines(lines, said or kind))
    quote = shown[0] if said is not None and shown else (logs.error_lines(lines, 1) or [""])[0]
    return Failure(message=head + phase + (f": {quote}" if quote else ""), lines=shown, kind=kind,
                   cause=CAUSE_OF_KIND.get(fault or "", Cause.EXIT), card=card)


def evidence(lines: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """For a failure that is no exit (a timeout): the lines to show, and ": <the last error line>" (if any) for its
    one line."""
    shown = tuple(logs.deciding_lines(lines, None))
    quote = (logs.error_lines(lines, 1) or [""])[0]
    return shown, f": {quote}" if quote else ""


def count(counts: dict[str, dict[str, int]], card: str | None, host: str | None, cause: Cause) -> None:
    """One more ``cause`` on ``card`` of ``host`` (None: this machine), keyed "SYCL1" or "SYCL1 on b"; a failure of no
    card is not counted."""
    if card:
        per = counts.setdefault(f"{card} on {host}" if host else card, {})
        per[str(cause)] = per.get(str(cause), 0) + 1


def resets(config: ServeConfig, counts: Mapping[str, Mapping[str, int]]) -> list[dict[str, Any]]:
    """The cards lost RESET_AFTER times or more, each {"card", "device_lost", "line"}: the line names the card, how
    often, and how to reset it (llama/resets.py), as ``arcsplit ps``, ``doctor`` and ``report`` print it."""
    out = []
    by_device = {c.card.device: c.card for c in config.plan.cards}
    for label, per in counts.items():
        n = per.get(str(Cause.DEVICE_LOST), 0)
        if n < RESET_AFTER:
            continue
        first = by_device.get(label.split(" on ")[0].split(",")[0])
        advice = reset_advice(config.backend, first.driver if first else None,
                              first.pci if first and "," not in label else None,
                              first.index if first else None, first.name if first else "")
        out.append({"card": label, "device_lost": n,
                    "line": f"{label} needs a driver reset (its device was lost {n} times in this run): {advice}"})
    return out
