"""Typed events and status records the supervisor publishes, and an in-process fan-out that never blocks.

Every event's ``data`` is a frozen record of its kind (``StateData`` for ``state``, ``GroupData`` for ``group``,
...). A record reads like the JSON object it becomes on the bus (``ev.data["state"]``, ``ev.data.get("url")``), so
the Python API's callers see what they always saw; ``to_dict()`` is that object, and the one place its shape is
written (docs/bus.md lists the fields per kind).

Each subscriber gets a bounded memory stream; when it is full the event is dropped for that subscriber
(and counted), so a slow dashboard can never stall supervision. The ZeroMQ bus subscribes like anyone else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Iterator, Literal, Mapping, TypedDict

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..decide.choice import RouteChoice
from ..durations import format_s
from ..proc.states import Cause, GroupState, MemberState
from ..samples import CardRow, GpuReport

EventKind = Literal["state", "log", "plan", "buffers", "group", "progress", "verdict", "telemetry", "sync", "host",
                    "failure", "route", "canary"]


class Payload(Mapping[str, Any]):
    """The base of every event's record: read-only access by wire key, over ``to_dict()``."""

    kind: ClassVar[EventKind]

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def _fields(record: Any, *names: str) -> dict[str, Any]:
    return {n: getattr(record, n) for n in names}


@dataclass(frozen=True)
class Usage:
    """A process on another host as its node agent last reported it (this machine cannot sample it): CPU seconds
    so far, resident bytes, threads, and when the report arrived here (time.time())."""

    cpu_s: float
    rss: int | None
    threads: int | None
    at: float

    def to_dict(self) -> dict[str, Any]:
        return _fields(self, "cpu_s", "rss", "threads", "at")


@dataclass(frozen=True, eq=True)
class StateData(Payload):
    """``state`` events (and status's processes): one member after a change of state."""

    kind: ClassVar[EventKind] = "state"
    state: MemberState
    pid: int | None
    port: int
    endpoint: str
    returncode: int | None
    uptime: float | None
    argv: tuple[str, ...]
    paused: bool
    host: str  # the layout host it runs on ("" this machine; a link: the host it reaches); its pid is there
    usage: Usage | None = None  # a running process on another host: its agent's last report
    gpus: GpuReport | None = None  # the same, of its host's cards (the whole host's: telemetry picks the held ones)

    def to_dict(self) -> dict[str, Any]:
        out = {**_fields(self, "state", "pid", "port", "endpoint", "returncode", "uptime"), "argv": list(self.argv),
               "paused": self.paused, "host": self.host}
        if self.usage is not None:
            out["usage"] = self.usage.to_dict()
        if self.gpus is not None:
            out["gpus"] = self.gpus.to_dict()
        return out


def member_snapshot(member: Any, uptime: float | None) -> StateData:
    """A member's snapshot (launch.Member: state, pid, returncode, paused and its spec), whatever runs it."""
    spec = member.spec
    return StateData(state=member.state, pid=member.pid, port=spec.port, endpoint=spec.endpoint,
                     returncode=member.returncode, uptime=uptime, argv=tuple(spec.argv), paused=member.paused,
                     host=spec.node)


@dataclass(frozen=True)
class GroupData(Payload):
    """``group`` events: the group's new state (stopping, stopped: nothing else); the kinds below add what explains
    the others."""

    kind: ClassVar[EventKind] = "group"
    state: GroupState

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state}


@dataclass(frozen=True)
class GroupStarting(GroupData):
    state: GroupState = GroupState.STARTING
    generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "generation": self.generation}


@dataclass(frozen=True)
class GroupReady(GroupData):
    state: GroupState = GroupState.READY
    url: str = ""
    buffers: Mapping[str, Any] = field(default_factory=dict)  # as in Status.buffers
    notes: tuple[str, ...] = ()  # what works but slower than it should (Status.notes)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "url": self.url, "buffers": dict(self.buffers), "notes": list(self.notes)}


@dataclass(frozen=True)
class GroupBackoff(GroupData):
    state: GroupState = GroupState.BACKOFF
    delay: float = 0.0  # seconds until the next start
    failures: float = 0.0  # the failure count (RestartPolicy.count: decays with time ready)
    error: str | None = None  # the last error

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "delay": self.delay, "failures": self.failures, "error": self.error}


@dataclass(frozen=True)
class HostData(Payload):
    """``host`` events (name: the layout host): its node session opened for a generation. ``opened_s``: from
    starting its ssh to the agent's first message (the login and the agent's start: what a start across hosts
    adds; a slow login shows here first)."""

    kind: ClassVar[EventKind] = "host"
    ssh: str
    opened_s: float
    generation: int
    started_s: float | None  # of which the agent's own start there: from sshd's fork of the login shell to its
    # first answer (the shell's rc, Python, the agent's imports); None from an agent that does not say

    def to_dict(self) -> dict[str, Any]:
        return _fields(self, "ssh", "opened_s", "generation", "started_s")


@dataclass(frozen=True)
class LogData(Payload):
    kind: ClassVar[EventKind] = "log"
    line: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line}


@dataclass(frozen=True)
class CardLoad:
    card: int | None  # plan card position; None: host memory that is no card
    done: int  # model bytes loaded so far
    total: int  # model bytes of this card (llama-server's buffer lines)

    def to_dict(self) -> dict[str, Any]:
        return _fields(self, "card", "done", "total")


@dataclass(frozen=True)
class ProgressData(Payload):
    kind: ClassVar[EventKind] = "progress"
    stage: str | None
    value: float  # 0..1 of llama-server's model load
    cards: tuple[CardLoad, ...]  # per card, in plan order (logs.load_progress); empty before the buffer lines

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "value": self.value, "cards": [c.to_dict() for c in self.cards]}


@dataclass(frozen=True)
class VerdictData(Payload):
    """A one-context load failed with the multi-device allocation signature; the group falls back."""

    kind: ClassVar[EventKind] = "verdict"
    failed_mode: str
    failure: str  # the failure's kind (logs.MULTI_DEVICE_KINDS); "kind" on the wire
    message: str
    fallback: str

    def to_dict(self) -> dict[str, Any]:
        return {"failed_mode": self.failed_mode, "kind": self.failure, "message": self.message,
                "fallback": self.fallback}


@dataclass(frozen=True)
class FailureData(Payload):
    """A generation of the group failed and will be restarted (or the route changed, or the supervisor gives up):
    why (``cause``), which member (``who``: its process name, "group" or a host), where (``host``: None for this
    machine; ``card``: the plan card it holds, if one), the one-line ``message``, and the count by cause so far."""

    kind: ClassVar[EventKind] = "failure"
    cause: Cause
    who: str
    message: str
    host: str | None = None
    card: str | None = None
    count: int = 1  # failures of this cause in this run, this one included
    lines: tuple[str, ...] = ()  # the log lines that show it, for surfaces that print several (run/faults.py)

    def to_dict(self) -> dict[str, Any]:
        return {**_fields(self, "cause", "who", "message", "host", "card", "count"), "lines": list(self.lines)}


@dataclass(frozen=True)
class RouteData(Payload):
    """The group left a route of its list (decide/routes.py) for the next one, or found none left (``to`` None: the
    run stops, or the last route keeps restarting under the cap). ``reason``: run/fallback.Leave."""

    kind: ClassVar[EventKind] = "route"
    left: str  # the route's label
    reason: str
    message: str  # the failure that decided it, one line
    to: str | None
    mode: str | None  # the mode now (None: unchanged)

    def to_dict(self) -> dict[str, Any]:
        return _fields(self, "left", "reason", "message", "to", "mode")


@dataclass(frozen=True)
class CanaryData(Payload):
    """One try of the output canary (run/canary.py): ``verdict`` pass, reference, wrong, gave_way or failed, its wall
    ``seconds``, the prompts answered, ``reason``; a mismatch carries its ``evidence``."""

    kind: ClassVar[EventKind] = "canary"
    verdict: str
    seconds: float
    prompts: int
    reason: str
    evidence: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = _fields(self, "verdict", "seconds", "prompts", "reason")
        return out | {"evidence": dict(self.evidence)} if self.evidence is not None else out


def failure_line(last: Mapping[str, Any], causes: Mapping[str, int] | None = None, now: float | None = None) -> str:
    """status's ``last_failure`` in one line for ``arcsplit ps`` and the dashboard: its cause, the member and where
    it runs, how long ago, and the counts by cause this run ("hang: rpc1 (card CPU1, host b), 2 min ago; this run:
    exit 2, hang 1")."""
    where = ", ".join(x for x in (f"card {last['card']}" if last.get("card") else "",
                                  f"host {last['host']}" if last.get("host") else "") if x)
    who = str(last.get("who") or "group") + (f" ({where})" if where else "")
    ago = ""
    if isinstance(last.get("time"), (int, float)):
        secs = max(0, round((now or time.time()) - float(last["time"])))
        ago = f", {format_s(secs if secs < 120 else 60 * round(secs / 60))} ago"  # whole minutes past two
    counts = ", ".join(f"{c} {n}" for c, n in sorted((causes or {}).items()))
    return f"{last.get('cause')}: {who}{ago}" + (f"; this run: {counts}" if counts else "")


@dataclass(frozen=True)
class PlanData(Payload):
    kind: ClassVar[EventKind] = "plan"
    plan: Mapping[str, Any]  # Plan.to_dict()
    mode: str
    choice: RouteChoice | None = None  # how the route was chosen: tuned (with its figures), asked, the default order

    def to_dict(self) -> dict[str, Any]:
        out = {"plan": dict(self.plan), "mode": self.mode}
        return out | {"choice": self.choice.to_dict()} if self.choice is not None else out


@dataclass(frozen=True)
class BuffersData(Payload):
    """``buffers`` events (and Status.buffers): actual bytes per plan card beside the plan's prediction."""

    kind: ClassVar[EventKind] = "buffers"
    cards: tuple[Mapping[str, Any], ...]  # {"device", "plan": {kind: bytes}, "actual": {kind: bytes}}
    host: Mapping[str, int]  # what llama-server's own CPU holds that no card does
    plan_host: int

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [dict(c) for c in self.cards], "host": dict(self.host), "plan_host": self.plan_host}


@dataclass(frozen=True)
class TelemetryData(Payload):
    """``telemetry`` events: one sample (telemetry/__init__.py)."""

    kind: ClassVar[EventKind] = "telemetry"
    time: float
    cards: tuple[CardRow, ...]
    processes: Mapping[str, Mapping[str, Any]]  # name -> {pid, cpu, rss, threads[, host]}
    server: Mapping[str, Any] | None  # llama-server's /metrics and /slots, once it serves

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "cards": [c.to_dict() for c in self.cards],
                "processes": {k: dict(v) for k, v in self.processes.items()}, "server": self.server}


@dataclass(frozen=True)
class TelemetryError(Payload):
    """A ``telemetry`` event whose sample failed (telemetry never takes supervision down)."""

    kind: ClassVar[EventKind] = "telemetry"
    time: float
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "error": self.error}


@dataclass(frozen=True)
class SyncData(Payload):
    """The bus's own ``sync`` answer: a subscriber sees its token once its subscription is live."""

    kind: ClassVar[EventKind] = "sync"
    token: str

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token}


def with_remote(snap: StateData, usage: Usage | None, gpus: GpuReport | None) -> StateData:
    """A remote member's snapshot with its agent's last reports."""
    return replace(snap, usage=usage, gpus=gpus)


MemberStatus = dict[str, Any]  # one entry of Status.processes: StateData.to_dict() with "restarts" and "role"


class Status(TypedDict):
    """``Supervisor.status()``, the bus's ``status`` and the snapshot's ``status``."""

    state: GroupState
    mode: str
    backend: str
    url: str
    generation: int
    failures: float
    uptime: float | None
    processes: dict[str, MemberStatus]
    progress: dict[str, Any]  # ProgressData once llama-server reports it
    buffers: dict[str, Any]  # {"cards": [{"device", "plan", "actual"}], "host", "plan_host"}
    last_error: str | None
    notes: list[str]  # this generation's: what works but slower than it should (a link on TCP: its cause, the fix)
    run_dir: str | None
    plan: dict[str, Any]  # Plan.to_dict()
    route: dict[str, Any]  # Route.to_dict(): each card's holder, device name and visibility
    decision: dict[str, Any]  # {"mode", "reasons"}
    choice: dict[str, Any]  # RouteChoice.to_dict(): chosen by tune (its figures, the alternatives), asked, default
    events_dropped: int
    causes: dict[str, int]  # failures by Cause this run: {"hang": 1, "exit": 2}
    last_error_lines: list[str]  # the log lines that show last_error (one line), for multi-line surfaces
    card_faults: dict[str, dict[str, int]]  # failures by plan card and Cause this run: {"SYCL1": {"device_lost": 2}}
    resets: list[dict[str, Any]]  # cards lost often enough to need a driver reset: {"card", "device_lost", "line"}
    routes: dict[str, Any]  # run/fallback.RouteTracker.to_dict(): the route now, the list, the moves, left out
    canary: dict[str, Any]  # run/canary.Canary.to_dict(), or {"on": False}
    last_failure: dict[str, Any] | None  # the last FailureData.to_dict() with its "time" (time.time()); None: none
    watchdog: dict[str, Any]  # the progress watchdog: {"hang_after", "bound", "longest_pause", "idle_checks"}


@dataclass(frozen=True)
class Event:
    """One thing that happened; ``data`` is the record of its kind (StateData for state, GroupData, ...)."""

    kind: EventKind
    name: str  # process name ("rpc0", "server") or "group"
    data: Payload
    time: float = field(default_factory=time.time)

    @classmethod
    def of(cls, name: str, data: Payload) -> "Event":
        """The event that carries ``data`` (its kind is the record's)."""
        return cls(data.kind, name, data)

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind, "name": self.name, "data": self.data.to_dict()}


class EventBus:
    """Fan-out to subscribers; publish() is synchronous and O(subscribers)."""

    def __init__(self) -> None:
        self._subs: list[MemoryObjectSendStream[Event]] = []
        self.dropped = 0

    def subscribe(self, max_buffer: int = 1000) -> MemoryObjectReceiveStream[Event]:
        send, receive = anyio.create_memory_object_stream[Event](max_buffer)
        self._subs.append(send)
        return receive

    def publish(self, event: Event) -> None:
        for send in list(self._subs):
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                self.dropped += 1
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subs.remove(send)

    def close(self) -> None:
        for send in self._subs:
            send.close()
        self._subs.clear()
