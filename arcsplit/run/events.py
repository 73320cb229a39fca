"""Typed events and status records the supervisor publishes, and an in-process fan-out that never blocks.

Each subscriber gets a bounded memory stream; when it is full the event is dropped for that subscriber
(and counted), so a slow dashboard can never stall supervision. The ZeroMQ bus subscribes like anyone else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, NotRequired, Required, TypedDict

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..proc.states import GroupState, MemberState

EventKind = Literal["state", "log", "plan", "buffers", "group", "progress", "verdict", "telemetry", "sync", "host"]


# -- what each kind carries in ``data`` (docs/bus.md); on the wire these are plain JSON objects ------------------

class Usage(TypedDict):
    """A process on another host as its node agent last reported it (this machine cannot sample it): CPU seconds
    so far, resident bytes, threads, and when the report arrived here (time.time())."""

    cpu_s: float
    rss: int | None
    threads: int | None
    at: float


class GpuReport(TypedDict):
    """Another host's cards as its node agent last sampled them (this machine cannot read them): each card's row as
    the local samplers give it, with memory counted for that agent's processes only; every card there of the
    group's sampler kind, so plan cards match them as local ones do. ``intel``: by PCI address; ``cuda``: by CUDA
    index as a string (JSON keys); ``at``: when the report arrived here (time.time()), one a second."""

    intel: dict[str, dict[str, Any]]
    cuda: dict[str, dict[str, Any]]
    at: float


class MemberSnapshot(TypedDict):
    """``state`` events: one member after a change of state."""

    state: MemberState
    pid: int | None
    port: int
    endpoint: str
    returncode: int | None
    uptime: float | None
    argv: list[str]
    paused: bool
    host: str  # the layout host it runs on ("" this machine; a link: the host it reaches); its pid is there
    usage: NotRequired[Usage]  # a running process on another host: its agent's last report
    gpus: NotRequired[GpuReport]  # the same, of its host's cards (the whole host's: telemetry picks the held ones)


class GroupData(TypedDict, total=False):
    """``group`` events: the group's new state, with what explains it."""

    state: Required[GroupState]
    generation: int  # starting
    url: str  # ready
    buffers: dict[str, Any]  # ready: as in Status.buffers
    notes: list[str]  # ready: what works but slower than it should (Status.notes)
    delay: float  # backoff: seconds until the next start
    failures: int  # backoff: failures in a row
    error: str | None  # backoff: the last error


class HostData(TypedDict):
    """``host`` events (name: the layout host): its node session opened for a generation. ``opened_s``: from
    starting its ssh to the agent's first message (the login and the agent's start: what a start across hosts
    adds; a slow login shows here first)."""

    ssh: str
    opened_s: float
    generation: int
    started_s: float | None  # of which the agent's own start there: from sshd's fork of the login shell to its
    # first answer (the shell's rc, Python, the agent's imports); None from an agent that does not say


class LogData(TypedDict):
    line: str


class CardLoad(TypedDict):
    card: int | None  # plan card position; None: host memory that is no card
    done: int  # model bytes loaded so far
    total: int  # model bytes of this card (llama-server's buffer lines)


class ProgressData(TypedDict):
    stage: str | None
    value: float  # 0..1 of llama-server's model load
    cards: list[CardLoad]  # per card, in plan order (logs.load_progress); empty before the buffer lines


class VerdictData(TypedDict):
    """A one-context load failed with the multi-device allocation signature; the group falls back."""

    failed_mode: str
    kind: str
    message: str
    fallback: str


class PlanData(TypedDict):
    plan: dict[str, Any]  # Plan.to_dict()
    mode: str


def member_snapshot(member: Any, uptime: float | None) -> MemberSnapshot:
    """A member's snapshot (launch.Member: state, pid, returncode, paused and its spec), whatever runs it."""
    spec = member.spec
    return {"state": member.state, "pid": member.pid, "port": spec.port, "endpoint": spec.endpoint,
            "returncode": member.returncode, "uptime": uptime, "argv": list(spec.argv), "paused": member.paused,
            "host": spec.node}


class MemberStatus(MemberSnapshot):
    """One entry of Status.processes."""

    restarts: int
    role: str  # "rpc" | "link" (an ssh forward to a host's rpc-server) | "server"


class Status(TypedDict):
    """``Supervisor.status()``, the bus's ``status`` and the snapshot's ``status``."""

    state: GroupState
    mode: str
    backend: str
    url: str
    generation: int
    failures: int
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
    events_dropped: int


@dataclass(frozen=True)
class Event:
    """One thing that happened; ``data`` is the record of its kind (MemberSnapshot for state, GroupData, ...)."""

    kind: EventKind
    name: str  # process name ("rpc0", "server") or "group"
    data: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind, "name": self.name, "data": self.data}


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
