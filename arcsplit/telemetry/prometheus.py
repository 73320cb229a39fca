"""arcsplit's own state for Prometheus, through ``prometheus_client``: the group, each process, each card.

``families(status, telemetry)`` is pure (one ``status()`` and one telemetry sample in, metric families out);
``render`` is their text exposition; ``MetricsEndpoint`` serves them on ``serve --metrics-port``.
llama-server's own ``/metrics`` (tokens, requests) stays on the served URL; this is what only arcsplit knows.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import anyio
from anyio.from_thread import BlockingPortal
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric,
                                    StateSetMetricFamily)
from prometheus_client.registry import Collector

from ..decide.choice import RouteChoice
from ..errors import PortBusy
from ..samples import CardRow
from ..proc.states import GroupState, MemberState

# The states a group and a process go through (proc/states.py); a state not listed here still shows, so a new one is
# never hidden.
GROUP_STATES: tuple[str, ...] = tuple(GroupState)
PROCESS_STATES: tuple[str, ...] = tuple(MemberState)
# Per-card gauges: (CardSample field, metric name, help).
_CARD_METRICS = (("used", "card_used_bytes", "bytes our processes use on the card"),
                 ("total", "card_total_bytes", "card memory (a CPU card: its budget)"),
                 ("util", "card_utilisation_ratio", "busiest engine, 0-1"),
                 ("temp", "card_temperature_celsius", "card temperature"),
                 ("power", "card_power_watts", "card power"))


def _states(states: tuple[str, ...], current: str) -> dict[str, bool]:
    return {s: s == current for s in (*states, *(() if current in states else (current,)))}


def families(status: dict[str, Any], telemetry: dict[str, Any] | None = None) -> list[Metric]:
    """The metric families of one status() (and the latest telemetry sample, when there is one)."""
    out: list[Metric] = []
    state = str(status.get("state") or GroupState.NEW)
    info = InfoMetricFamily("arcsplit", "the served group", value={
        "mode": str(status.get("mode") or ""), "backend": str(status.get("backend") or ""),
        "url": str(status.get("url") or ""), "model": str((status.get("plan") or {}).get("model") or "")})
    group = StateSetMetricFamily("arcsplit_group_state", "state of the serving group",
                                 value=_states(GROUP_STATES, state))
    ready = GaugeMetricFamily("arcsplit_group_ready", "1 while the group answers /health",
                              value=1 if state == GroupState.READY else 0)
    failures = GaugeMetricFamily("arcsplit_group_failures", "consecutive failed starts of the group",
                                 value=status.get("failures") or 0)
    uptime = GaugeMetricFamily("arcsplit_group_uptime_seconds", "seconds since the group became ready (0 when not)",
                               value=status.get("uptime") or 0)
    generation = CounterMetricFamily("arcsplit_group_starts", "times the group was started",
                                     value=status.get("generation") or 0)
    out += [info, group, ready, failures, uptime, generation, *_route(status.get("choice")),
            *_routes(status.get("routes")), *_canary(status.get("canary")), *_failures(status)]

    procs: dict[str, dict[str, Any]] = status.get("processes") or {}
    pstate = StateSetMetricFamily("arcsplit_process_state", "state of each process", labels=["process", "role"])
    up = GaugeMetricFamily("arcsplit_process_up", "1 while the process runs", labels=["process", "role"])
    restarts = CounterMetricFamily("arcsplit_process_restarts", "restarts of the process", labels=["process"])
    puptime = GaugeMetricFamily("arcsplit_process_uptime_seconds", "seconds the process has run",
                                labels=["process"])
    for name, p in procs.items():
        role, current = str(p.get("role") or ""), str(p.get("state") or MemberState.NEW)
        pstate.add_metric([name, role], _states(PROCESS_STATES, current))
        up.add_metric([name, role], 1 if current in (MemberState.STARTING, MemberState.READY) else 0)
        restarts.add_metric([name], p.get("restarts") or 0)
        if p.get("uptime") is not None:
            puptime.add_metric([name], p["uptime"])
    tprocs = (telemetry or {}).get("processes") or {}
    cpu = GaugeMetricFamily("arcsplit_process_cpu_percent", "CPU use, percent of one core", labels=["process"])
    rss = GaugeMetricFamily("arcsplit_process_rss_bytes", "resident memory", labels=["process"])
    for name, t in tprocs.items():
        if t.get("cpu") is not None:
            cpu.add_metric([name], t["cpu"])
        if t.get("rss") is not None:
            rss.add_metric([name], t["rss"])
    out += [pstate, up, restarts, puptime, cpu, rss]

    labels = ["card", "device"]
    planned = GaugeMetricFamily("arcsplit_card_planned_bytes", "bytes the plan puts on the card", labels=labels)
    for i, c in enumerate((status.get("plan") or {}).get("cards") or []):
        total = (c.get("bytes") or {}).get("total")
        if total is not None:
            planned.add_metric([str(i), str(c.get("device") or "")], total)
    out.append(planned)
    rows = [CardRow.from_dict(c) for c in (telemetry or {}).get("cards") or []]
    for key, name, help_ in _CARD_METRICS:
        fam = GaugeMetricFamily(f"arcsplit_{name}", help_, labels=labels)
        for row in rows:
            value = getattr(row.sample, key)
            if value is not None:
                fam.add_metric([str(row.pos), str(row.device or "")], value)
        out.append(fam)
    return [m for m in out if m.samples]


def _failures(status: dict[str, Any]) -> list[Metric]:
    """Failed generations by cause this run (status's ``causes``: exit, hang, ...), and the last one: its cause, the
    member, card and host it names, and its line."""
    out: list[Metric] = []
    causes = status.get("causes") or {}
    if causes:
        by_cause = CounterMetricFamily("arcsplit_failures", "failed generations of the group by cause this run "
                                       "(a member exited, a hang, ...)", labels=["cause"])
        for cause, n in sorted(causes.items()):
            by_cause.add_metric([str(cause)], n)
        out.append(by_cause)
    last = status.get("last_failure") or {}
    if status.get("last_error") or last:
        value = {"error": str(status.get("last_error") or last.get("message") or "")}
        if last:
            value.update(cause=str(last.get("cause") or ""), member=str(last.get("who") or ""),
                         card=str(last.get("card") or ""), host=str(last.get("host") or ""))
        out.append(InfoMetricFamily("arcsplit_last_failure", "why the group last failed", value=value))
    return out


def _route(data: dict[str, Any] | None) -> list[Metric]:
    """How the route was chosen (status's ``choice``): by arcsplit tune, as asked, or the default order; a tuned
    route's measured figures beside it."""
    if not data:
        return []
    choice = RouteChoice.from_dict(data)
    info = InfoMetricFamily("arcsplit_route", "how the served route was chosen: tune, asked (--mode) or default",
                            value={"chosen_by": choice.by, "mode": choice.mode, "label": choice.label,
                                   "objective": choice.objective, "note": choice.note})
    if not choice.tuned:
        return [info]
    figs = GaugeMetricFamily("arcsplit_route_tuned_tokens_per_second", "what arcsplit tune measured for this route",
                             labels=["figure"])
    for name in ("decode", "prefill", "streams"):
        figs.add_metric([name], getattr(choice, name) or 0.0)
    out = [info, figs, GaugeMetricFamily("arcsplit_route_tuned_timestamp_seconds", "when arcsplit tune measured it",
                                         value=choice.tuned_at or 0.0)]
    if choice.ttft is not None:  # a choice kept before tune measured it has none
        out.append(GaugeMetricFamily("arcsplit_route_tuned_time_to_first_token_seconds",
                                     "arcsplit tune's time to first token for this route (a prompt, no prompt cache)",
                                     value=choice.ttft / 1000))
    return out


# Why a route is left (run/fallback.Leave): every reason shows, 0 until it happens, so an alert can rate() it.
LEAVE_REASONS = ("wrong", "multi_device", "load", "hang", "restarts")
CANARY_VERDICTS = ("pass", "reference", "wrong", "gave_way", "failed")


def _routes(data: dict[str, Any] | None) -> list[Metric]:
    """The route now among those decided at the start (status's ``routes``), and the moves down the list by reason."""
    if not data or not data.get("routes"):
        return []
    now = InfoMetricFamily("arcsplit_route_now", "the route the group runs now, of the list decided at the start",
                           value={"label": str(data.get("now") or ""), "position": str(int(data.get("index") or 0) + 1),
                                  "of": str(len(data["routes"]))})
    changes = CounterMetricFamily("arcsplit_route_changes", "moves to the next route, by why the route was left",
                                  labels=["reason"])
    moves = [str(m.get("reason")) for m in data.get("moves") or []]
    for reason in (*LEAVE_REASONS, *sorted(set(moves) - set(LEAVE_REASONS))):
        changes.add_metric([reason], moves.count(reason))
    return [now, changes]


def _canary(data: dict[str, Any] | None) -> list[Metric]:
    """The output canary's tries by verdict and the last one's wall time (status's ``canary``)."""
    if not data or not data.get("on"):
        return []
    counts = data.get("counts") or {}
    checks = CounterMetricFamily("arcsplit_canary_checks", "output canary tries, by verdict", labels=["verdict"])
    for verdict in (*CANARY_VERDICTS, *sorted(set(counts) - set(CANARY_VERDICTS))):
        checks.add_metric([verdict], counts.get(verdict, 0))
    last = data.get("last") or {}
    return [checks, GaugeMetricFamily("arcsplit_canary_last_seconds", "wall time of the output canary's last try",
                                      value=float(last.get("seconds") or 0.0))]


class _Source(Collector):
    """Collects whatever ``read()`` returns at scrape time."""

    def __init__(self, read: Callable[[], tuple[dict[str, Any], dict[str, Any] | None]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield from families(*self._read())


def _registry(read: Callable[[], tuple[dict[str, Any], dict[str, Any] | None]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Source(read))
    return registry


def render(status: dict[str, Any], telemetry: dict[str, Any] | None = None) -> str:
    """The Prometheus text exposition of one status() and telemetry sample."""
    return generate_latest(_registry(lambda: (status, telemetry))).decode()


class MetricsEndpoint:
    """``serve --metrics-port``: prometheus_client's HTTP server on its own thread, watching one run.

    The port is bound in the constructor, so a taken port fails before any process starts. Each scrape reads
    ``status()`` on the supervisor's event loop (through a portal: the supervisor is not thread-safe) and the
    latest telemetry event, which ``run`` follows; until ``run`` starts, and after it ends, a scrape answers 500.
    """

    def __init__(self, host: str, port: int) -> None:
        self._sup: Any = None
        self._portal: BlockingPortal | None = None
        self._telemetry: dict[str, Any] | None = None
        try:
            self._httpd, _thread = start_http_server(port, host, _registry(self._read))
        except OSError as exc:
            raise PortBusy(f"--metrics-port {port} on {host}: {exc.strerror or exc}",
                           "stop what uses it or pass another --metrics-port") from None
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self._httpd.server_port}/metrics"

    def _read(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        portal, sup = self._portal, self._sup
        if portal is None:
            raise RuntimeError("arcsplit is starting or stopping")
        return portal.call(sup.status), self._telemetry

    async def run(self, sup: Any) -> None:
        """A watcher of the run (run/instance.py): serve ``sup`` until cancelled, then close the port."""
        try:
            events = sup.subscribe(64)
            async with BlockingPortal() as portal:
                self._sup, self._portal = sup, portal
                try:
                    async for ev in events:
                        if ev.kind == "telemetry" and "cards" in ev.data:
                            self._telemetry = ev.data.to_dict()
                finally:
                    self._portal = None
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._httpd.shutdown)
            self._httpd.server_close()
