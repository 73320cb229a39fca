"""Typed events the supervisor publishes, and an in-process fan-out that never blocks the publisher.

Each subscriber gets a bounded memory stream; when it is full the event is dropped for that subscriber
(and counted), so a slow dashboard can never stall supervision. The ZeroMQ bus subscribes like anyone else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

@dataclass(frozen=True)
class Event:
    """kind: state (one process), group (the whole group), log (one line), plan, buffers, progress, verdict."""

    kind: str
    name: str  # process name ("rpc0", "server") or "group"
    data: dict[str, Any] = field(default_factory=dict)
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
