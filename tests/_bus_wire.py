"""Publish events through a real BusServer (ZeroMQ, in a run dir of its own) and read them back as a subscriber
sees them: the wire test's harness (test_event_records.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import zmq
from anyio.from_thread import start_blocking_portal

from arcsplit.run.bus import TOPIC_PREFIX, BusServer, Client
from arcsplit.run.events import Event, EventBus


class _Target:
    """The least a bus needs: a status, logs, an event stream."""

    def __init__(self) -> None:
        self.events = EventBus()

    def status(self) -> dict[str, Any]:
        return {"state": "ready"}

    def logs(self, name: str | None = None, n: int = 100) -> list[str]:
        return []

    def stop(self) -> None:
        self.events.close()

    def restart(self) -> None:
        pass

    def subscribe(self, max_buffer: int = 1000) -> Any:
        return self.events.subscribe(max_buffer)


def through_bus(events: Iterable[Event], run_dir: Path) -> list[dict[str, Any]]:
    """Each event as a subscriber receives it (``kind``, ``name``, ``time``, ``data``), in order."""
    target = _Target()
    events = list(events)
    with start_blocking_portal() as portal:
        server = BusServer(target, run_dir, "wire-test")
        future, info = portal.start_task(server.run)
        with Client(info, timeout=10) as client:
            sub = client._socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
            sub.connect(info.pub)
            client._sync(sub)  # the subscription is live: nothing published from here on is lost
            for ev in events:
                portal.call(target.events.publish, ev)
            got = []
            while len(got) < len(events):
                assert sub.poll(10_000), "the bus went quiet"
                msg = json.loads(sub.recv_multipart()[1])
                if msg["kind"] != "sync":
                    got.append(msg)
            sub.close(0)
        portal.call(target.stop)
        future.result(timeout=10)
    return [{k: m[k] for k in ("kind", "name", "time", "data")} for m in got]


def dumps(msgs: list[dict[str, Any]]) -> str:
    return json.dumps(msgs, indent=1, sort_keys=True) + "\n"
