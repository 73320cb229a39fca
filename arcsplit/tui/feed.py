"""The dashboard's connection to an instance: the bus Client for requests, and an asyncio event stream.

``Client.events()`` blocks a thread in ``poll`` that nothing can interrupt, so a dashboard could not quit
promptly; this is the same protocol (subscribe, sync, snapshot, then events with a larger ``seq``) on a
``zmq.asyncio`` SUB socket that a cancelled task closes at once. Requests go through the Client in a worker
thread, one at a time (a ZeroMQ socket belongs to one thread at a time).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import zmq
import zmq.asyncio

from ..errors import NotRunning
from ..run.bus import SCHEMA_VERSION, TOPIC_PREFIX, Client, is_final


class Feed:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()

    @property
    def run_id(self) -> str:
        return self.client.info.run_id

    def _request_sync(self, cmd: str, args: dict[str, Any]) -> Any:
        with self._lock:
            return self.client.request(cmd, **args)

    async def request(self, cmd: str, **args: Any) -> Any:
        return await anyio.to_thread.run_sync(self._request_sync, cmd, args)

    def _sub(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        keys_path = self.client.info.keys
        if keys_path:
            keys = json.loads(Path(keys_path).read_text(encoding="utf-8"))
            s.curve_serverkey = keys["server_public"].encode()
            s.curve_publickey = keys["client_public"].encode()
            s.curve_secretkey = keys["client_secret"].encode()
        return s

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """A snapshot message first, then every later event in order, up to the group's "stopped" (as
        Client.events, but cancellable)."""
        ctx = zmq.asyncio.Context()
        sub = self._sub(ctx)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
            sub.connect(self.client.info.pub)
            await self._sync(sub)
            snap = await self.request("snapshot")
            after = snap["seq"]
            yield {"v": SCHEMA_VERSION, "seq": after, "time": time.time(), "kind": "snapshot", "name": "group",
                   "data": snap}
            while True:
                _topic, payload = await sub.recv_multipart()
                msg = json.loads(payload)
                if msg.get("seq", 0) <= after or msg.get("kind") == "sync":
                    continue
                yield msg
                if is_final(msg):
                    return
        finally:
            sub.close(0)
            ctx.term()

    async def _sync(self, sub: zmq.asyncio.Socket) -> None:
        token = uuid.uuid4().hex
        deadline = time.monotonic() + self.client.timeout
        while time.monotonic() < deadline:
            await self.request("sync", token=token)
            with anyio.move_on_after(0.2):
                while True:
                    _topic, payload = await sub.recv_multipart()
                    msg = json.loads(payload)
                    if msg.get("kind") == "sync" and (msg.get("data") or {}).get("token") == token:
                        return
        raise NotRunning(f"could not subscribe to arcsplit run {self.run_id}", "check it with `arcsplit ps`")

    def close(self) -> None:
        with self._lock:
            self.client.close()
