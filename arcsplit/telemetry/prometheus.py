"""arcsplit's own view as a Prometheus text exposition: per card, per process, restarts.

``render(status, telemetry)`` is pure; serving it (e.g. on a --metrics-port) is left to the caller.
"""

from __future__ import annotations

from typing import Any, Iterable


def _labels(**kv: Any) -> str:
    def esc(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kv.items()) + "}"


def render(status: dict[str, Any], telemetry: dict[str, Any] | None = None) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[str, Any]]) -> None:
        rows = [(labels, v) for labels, v in samples if v is not None]
        if not rows:
            return
        lines.append(f"# HELP arcsplit_{name} {help_}")
        lines.append(f"# TYPE arcsplit_{name} {kind}")
        lines.extend(f"arcsplit_{name}{labels} {float(v):g}" for labels, v in rows)

    procs = status.get("processes") or {}
    plan_cards = (status.get("plan") or {}).get("cards") or []
    metric("group_ready", "gauge", "1 when the serving group answers /health",
           [(_labels(mode=status.get("mode", "")), 1 if status.get("state") == "ready" else 0)])
    metric("group_failures", "gauge", "consecutive failures of the group", [("", status.get("failures"))])
    metric("process_up", "gauge", "1 when the process is running",
           [(_labels(process=n, role=p.get("role", "")), 1 if p.get("state") in ("ready", "starting") else 0)
            for n, p in procs.items()])
    metric("process_restarts_total", "counter", "restarts of the process",
           [(_labels(process=n), p.get("restarts", 0)) for n, p in procs.items()])
    metric("card_planned_bytes", "gauge", "bytes the plan puts on the card",
           [(_labels(card=i, device=c.get("device", "")), (c.get("bytes") or {}).get("total"))
            for i, c in enumerate(plan_cards)])
    tel = telemetry or {}
    cards = tel.get("cards") or []
    metric("card_used_bytes", "gauge", "bytes our processes use on the card",
           [(_labels(card=c["pos"], device=c.get("device", "")), c.get("used")) for c in cards])
    metric("card_total_bytes", "gauge", "card memory",
           [(_labels(card=c["pos"], device=c.get("device", "")), c.get("total")) for c in cards])
    metric("card_utilisation_ratio", "gauge", "busiest engine, 0-1",
           [(_labels(card=c["pos"], device=c.get("device", "")), c.get("util")) for c in cards])
    metric("card_temperature_celsius", "gauge", "card temperature",
           [(_labels(card=c["pos"], device=c.get("device", "")), c.get("temp")) for c in cards])
    metric("card_power_watts", "gauge", "card power",
           [(_labels(card=c["pos"], device=c.get("device", "")), c.get("power")) for c in cards])
    tprocs = tel.get("processes") or {}
    metric("process_cpu_percent", "gauge", "CPU use, percent of one core",
           [(_labels(process=n), p.get("cpu")) for n, p in tprocs.items()])
    metric("process_rss_bytes", "gauge", "resident memory",
           [(_labels(process=n), p.get("rss")) for n, p in tprocs.items()])
    return "\n".join(lines) + "\n"
