"""What the dashboard knows about one instance, built only from bus messages. Pure: no I/O, no widgets.

``apply(msg)`` folds one bus message in and says which panels changed, so the app redraws only those.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..llama.logs import QuietFilter
from ..proc.states import MemberState

PANELS = ("header", "cards", "layers", "procs", "server", "logs", "plan")
HISTORY = 60  # sparkline samples


@dataclass
class DashState:
    log_lines: int = 5000
    status: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    received: float = 0.0  # when status was last refreshed
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    gen_tps: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    prompt_tps: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    connected: bool = False
    error: str | None = None
    clock: Callable[[], float] = time.monotonic  # tests freeze it so uptimes render the same every run
    verbose: bool = False  # keep the lines `arcsplit logs` hides without --verbose (llama/logs.py QuietFilter)

    def __post_init__(self) -> None:
        self.logs: deque[tuple[str, str]] = deque(maxlen=self.log_lines)  # (process, line), arrival order
        self.pending_logs: list[tuple[str, str]] = []  # appended since the log panel last took them
        self.log_total = 0  # every line received, the hidden ones included
        self.log_hidden = 0
        self._quiet = QuietFilter()

    # -- folding messages in ----------------------------------------------------------------------------

    def apply(self, msg: dict[str, Any]) -> set[str]:
        kind, name, data = msg.get("kind"), msg.get("name", ""), msg.get("data") or {}
        if kind == "snapshot":
            self.connected = True
            self.set_status(data.get("status") or {})
            for line in data.get("logs") or []:
                self._log(*split_prefixed(line))
            return set(PANELS)
        if kind == "status":
            self.set_status(data)
            return set(PANELS) - {"logs"}
        if kind == "log":
            self._log(name, str(data.get("line", "")))
            return {"logs"}
        if kind == "state":
            procs = self.status.setdefault("processes", {})
            procs.setdefault(name, {}).update(data, _at=self.clock())
            return {"procs", "header"}
        if kind == "group":
            self.status["state"] = data.get("state", self.status.get("state"))
            if "buffers" in data:
                self.status["buffers"] = data["buffers"]
            if data.get("error"):
                self.status["last_error"] = data["error"]
            return {"header", "cards", "plan", "procs"}
        if kind == "buffers":
            self.status["buffers"] = data
            return {"cards"}
        if kind == "plan":
            if "plan" in data:
                self.status["plan"] = data["plan"]
            if "mode" in data:
                self.status["mode"] = data["mode"]
            if "choice" in data:
                self.status["choice"] = data["choice"]
            return {"header", "cards", "layers", "plan"}
        if kind == "progress":
            self.status["progress"] = data
            return {"header"}
        if kind == "verdict":
            self.verdicts.append(data)
            return {"plan", "header"}
        if kind == "failure":  # why a generation ended, with its log lines (run/faults.py); status() has the counts
            self.status["last_error"] = data.get("message")
            self.status["last_error_lines"] = list(data.get("lines") or [])
            self.status["last_failure"] = {**data, "time": msg.get("time")}
            causes = self.status.setdefault("causes", {})
            causes[str(data.get("cause"))] = data.get("count", causes.get(str(data.get("cause")), 0) + 1)
            return {"plan", "header"}
        if kind == "route":  # a move down the route list: the route now, and why the last one was left
            routes = self.status.setdefault("routes", {})
            routes.setdefault("moves", []).append(dict(data))
            if data.get("to"):
                routes["now"], routes["index"] = data["to"], int(routes.get("index") or 0) + 1
            return {"plan", "header"}
        if kind == "canary":
            canary = self.status.setdefault("canary", {"on": True})
            counts = canary.setdefault("counts", {})
            counts[str(data.get("verdict"))] = counts.get(str(data.get("verdict")), 0) + 1
            canary["last"] = dict(data)
            return {"plan"}
        if kind == "telemetry":
            self.telemetry = data
            server = data.get("server") or {}
            if server:
                self.gen_tps.append(float(server.get("gen_tps") or 0.0))
                self.prompt_tps.append(float(server.get("prompt_tps") or 0.0))
            return {"cards", "procs", "server"}
        return set()

    def set_status(self, status: dict[str, Any]) -> None:
        self.status = status
        self.received = self.clock()
        for p in (status.get("processes") or {}).values():
            p["_at"] = self.received

    def _log(self, name: str, line: str) -> None:
        self.log_total += 1
        if not self.verbose and self._quiet.hides(name, line):
            self.log_hidden += 1
            return
        self.logs.append((name, line))
        self.pending_logs.append((name, line))
        if len(self.pending_logs) > self.log_lines:
            del self.pending_logs[: len(self.pending_logs) - self.log_lines]

    def take_pending_logs(self) -> list[tuple[str, str]]:
        out, self.pending_logs = self.pending_logs, []
        return out

    # -- views ------------------------------------------------------------------------------------------

    @property
    def process_names(self) -> list[str]:
        return list((self.status.get("processes") or {}).keys())

    def process_uptime(self, name: str, now: float | None = None) -> float | None:
        """Uptime as of now: the value from the last status/state message plus the time since it came."""
        p = (self.status.get("processes") or {}).get(name) or {}
        up = p.get("uptime")
        if up is None or p.get("state") not in (MemberState.READY, MemberState.STARTING):
            return None
        return float(up) + ((now or self.clock()) - p.get("_at", self.received))


def split_prefixed(line: str) -> tuple[str, str]:
    """``[rpc0] text`` (the supervisor's all-process log form) -> ("rpc0", "text")."""
    if line.startswith("[") and "] " in line:
        name, _, rest = line[1:].partition("] ")
        return name, rest
    return "", line
