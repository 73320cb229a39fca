"""The ZeroMQ bus: a running supervisor's events go out on PUB, control requests come in on ROUTER.

Wire format (schema version 1, documented in docs/bus.md):

- PUB frames ``[topic, json]``; topic ``arcsplit.<kind>.<name>``; json
  ``{"v": 1, "seq": n, "time": t, "kind": k, "name": process, "data": {...}}``. ``seq`` grows by one per event.
- ROUTER request ``{"v": 1, "id": "...", "cmd": "...", "args": {...}}``, reply
  ``{"v": 1, "id": "...", "ok": true, "result": ...}`` or ``{"v": 1, "id": "...", "ok": false, "error": "..."}``.
  Commands: ``ping``, ``status``, ``snapshot``, ``logs`` (``name``, ``n``), ``restart``, ``stop`` (both with
  ``by`` and ``pid``: who asks, said on the serving terminal), ``sync`` (publishes a ``sync`` event carrying
  ``args.token``: a subscriber uses it to know its subscription is live).

A late subscriber subscribes, syncs, then asks for a snapshot (which carries the ``seq`` it reflects) and
applies only events with a larger ``seq``. PUB drops messages for a subscriber past its high-water mark, so a
stalled subscriber never slows the supervisor.

By default both sockets are ``ipc://`` files in the user's runtime dir (0700, sockets 0600). ``tcp://`` is used
only when asked, and then with CURVE: the server key pair and one authorised client key pair are written to a
0600 file in the run dir, so only the user who can read it can connect.
"""

from __future__ import annotations

import inspect
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import anyio
import psutil
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from .._dirs import runtime_dir
from ..errors import BadInput, NotRunning, RunError
from ..netaddr import bus_address
from ..proc.rundir import runs_root, same_process, since_boot
from ..proc.states import GroupState
from .events import SyncData

SCHEMA_VERSION = 1
INFO_FILE = "bus.json"
KEYS_FILE = "bus-keys.json"
TOPIC_PREFIX = b"arcsplit."
FLUSH_MS = 1000  # at close, how long the last queued events may take to leave
ASKED = {"stop": "stopping llama-server, then the rpc-servers", "restart": "restarting the group in order"}


class Controllable(Protocol):
    """What the bus needs from a supervisor."""

    def status(self) -> Mapping[str, Any]: ...

    def logs(self, name: str | None = None, n: int = 100, verbose: bool = True) -> list[str]: ...

    def stop(self) -> None: ...

    def restart(self) -> Any: ...

    def subscribe(self, max_buffer: int = 1000) -> Any: ...


@dataclass(frozen=True)
class BusInfo:
    """How to reach one running instance; written to ``<run dir>/bus.json``."""

    run_id: str
    run_dir: str
    pub: str
    ctl: str
    pid: int
    create_time: float
    started: float
    url: str | None = None
    model: str | None = None
    keys: str | None = None
    since_boot: float | None = None  # the writer's start, since boot (rundir.since_boot): a clock step leaves it

    def alive(self) -> bool:
        """Still the process that wrote this file (a reused pid is not)."""
        return same_process(self.pid, self.create_time, started=self.since_boot) is not None

    @classmethod
    def read(cls, path: Path) -> "BusInfo":
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


def _write_private(path: Path, text: str) -> None:
    """Create with 0600 from the start (no window where another user could read it), then rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    tmp.replace(path)


def _tcp_endpoints(tcp: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> PUB on PORT, ROUTER on PORT+1."""
    host, p = bus_address(tcp)
    return f"tcp://{host}:{p}", f"tcp://{host}:{p + 1}"


class BusServer:
    """Publishes a Controllable's events and answers control requests, in the supervisor's event loop."""

    def __init__(self, target: Controllable, run_dir: Path, run_id: str, *, tcp: str | None = None,
                 hwm: int = 10_000, url: str | None = None, model: str | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.target = target
        self.say = say  # the serving terminal: who asked for a stop or a restart
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.tcp = tcp
        self.hwm = hwm
        self.url = url
        self.model = model
        self.seq = 0
        self.info: BusInfo | None = None

    def _endpoints(self) -> tuple[str, str, list[Path]]:
        if self.tcp:
            pub, ctl = _tcp_endpoints(self.tcp)
            return pub, ctl, []
        base = runtime_dir()
        files = [base / f"{self.run_id}.pub", base / f"{self.run_id}.ctl"]
        return f"ipc://{files[0]}", f"ipc://{files[1]}", files

    def _curve(self, ctx: zmq.asyncio.Context, sockets: list[zmq.asyncio.Socket]) -> tuple[str, Any]:
        from zmq.auth.asyncio import AsyncioAuthenticator  # start-up: only for a bus on TCP (--bus-tcp)

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        keys = self.run_dir / KEYS_FILE
        _write_private(keys, json.dumps({
            "server_public": server_public.decode(),
            "client_public": client_public.decode(),
            "client_secret": client_secret.decode(),
        }))
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_AllowOnly(client_public))
        for s in sockets:
            s.curve_secretkey = server_secret
            s.curve_publickey = server_public
            s.curve_server = True
        return str(keys), auth

    async def run(self, *, task_status: TaskStatus[BusInfo] = anyio.TASK_STATUS_IGNORED) -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        ctl = ctx.socket(zmq.ROUTER)
        auth = None
        pub_ep, ctl_ep, files = self._endpoints()
        info_path = self.run_dir / INFO_FILE
        events = self.target.subscribe(max_buffer=10_000)
        try:
            for s in (pub, ctl):
                s.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            keys = None
            if self.tcp:
                keys, auth = self._curve(ctx, [pub, ctl])
            for sock, ep in ((pub, pub_ep), (ctl, ctl_ep)):
                try:
                    sock.bind(ep)
                except zmq.ZMQError as exc:
                    if keys:
                        Path(keys).unlink(missing_ok=True)
                    raise BadInput(f"cannot bind the bus at {ep}: {exc}",
                                   "pick another --bus address (it uses PORT and PORT+1)" if self.tcp
                                   else "check the runtime dir's permissions") from None
            for f in files:
                f.chmod(0o600)
            me = psutil.Process()
            self.info = BusInfo(run_id=self.run_id, run_dir=str(self.run_dir), pub=pub_ep, ctl=ctl_ep,
                                pid=me.pid, create_time=me.create_time(), started=time.time(),
                                url=self.url, model=self.model, keys=keys, since_boot=since_boot(me.pid))
            _write_private(info_path, json.dumps(asdict(self.info), indent=1))
            task_status.started(self.info)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve, ctl, pub)
                # Until the supervisor closes its stream, i.e. after its last event ("stopped"): a `stop` over
                # the bus is answered at once, yet the bus stays up through the ordered shutdown, so subscribers
                # see "stopping" and "stopped" and `ps` lists the run while its processes still exist.
                await self._forward(pub, events)
                tg.cancel_scope.cancel()
        finally:
            info_path.unlink(missing_ok=True)
            pub.close(FLUSH_MS)  # the last events still reach connected subscribers
            ctl.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            for f in files:
                f.unlink(missing_ok=True)

    async def _send(self, pub: zmq.asyncio.Socket, kind: str, name: str, data: dict[str, Any],
                    when: float | None = None) -> None:
        self.seq += 1
        msg = {"v": SCHEMA_VERSION, "seq": self.seq, "time": when or time.time(), "kind": kind, "name": name,
               "data": data}
        topic = TOPIC_PREFIX + f"{kind}.{name}".encode()
        try:
            await pub.send_multipart([topic, json.dumps(msg, default=str).encode()], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # every subscriber is past its high-water mark: drop, never block

    async def _forward(self, pub: zmq.asyncio.Socket, events: Any) -> None:
        async for ev in events:
            await self._send(pub, ev.kind, ev.name, ev.data.to_dict(), ev.time)

    async def _serve(self, ctl: zmq.asyncio.Socket, pub: zmq.asyncio.Socket) -> None:
        """Answer requests until cancelled; a ``stop`` is answered first, then passed on."""
        while True:
            frames = await ctl.recv_multipart()
            ident, payload = frames[0], frames[-1]
            stop_after = False
            try:
                req = json.loads(payload)
                if not isinstance(req, dict):
                    raise ValueError("request is not a JSON object")
                rid = req.get("id")
                cmd = req.get("cmd")
                args = req.get("args") or {}
                result = await self._handle(cmd, args, pub)
                reply = {"v": SCHEMA_VERSION, "id": rid, "ok": True, "result": result}
                stop_after = cmd == "stop"
            except Exception as exc:  # a bad request must never take the supervisor down
                reply = {"v": SCHEMA_VERSION, "id": _rid(payload), "ok": False,
                         "error": str(exc) or type(exc).__name__}
            await ctl.send_multipart([ident, json.dumps(reply, default=str).encode()])
            if stop_after:
                self.target.stop()

    async def _handle(self, cmd: Any, args: dict[str, Any], pub: zmq.asyncio.Socket) -> Any:
        if cmd == "ping":
            return {"pong": True, "run_id": self.run_id, "pid": os.getpid()}
        if cmd == "status":
            return self.target.status()
        if cmd == "snapshot":
            return {"seq": self.seq, "status": self.target.status(),
                    "logs": self.target.logs(None, int(args.get("n", 200)))}
        if cmd == "logs":
            return self.target.logs(args.get("name"), int(args.get("n", 100)), bool(args.get("verbose", True)))
        if cmd in ASKED and self.say is not None:
            self.say(asked_line(cmd, args))
        if cmd == "restart":
            out = self.target.restart()
            if inspect.isawaitable(out):
                await out
            return {"restarting": True}
        if cmd == "stop":
            return {"stopping": True}
        if cmd == "sync":
            await self._send(pub, "sync", "bus", SyncData(str(args.get("token", ""))).to_dict())
            return {"seq": self.seq}
        raise ValueError(f"unknown command {cmd!r}")


def asked_line(cmd: str, args: Mapping[str, Any]) -> str:
    """What the serving terminal says when a client asks for ``cmd``: who (as the client names itself, one short
    printable line) and its pid."""
    by = "".join(ch for ch in str(args.get("by") or "a bus client") if ch.isprintable())[:60] or "a bus client"
    pid = args.get("pid")
    return f"{cmd} asked by {by}{f' (pid {pid})' if isinstance(pid, int) else ''}: {ASKED[cmd]}"


def is_final(msg: dict[str, Any]) -> bool:
    """The group's last event: nothing follows "stopped", and the bus closes after it."""
    return msg.get("kind") == "group" and (msg.get("data") or {}).get("state") == GroupState.STOPPED


def _rid(payload: bytes) -> Any:
    try:
        return json.loads(payload).get("id")
    except Exception:
        return None


class _AllowOnly:
    """ZAP credentials check: only the client key written to the private keys file may connect."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


# -- discovery and the client ------------------------------------------------------------------------------


def list_runs() -> list[BusInfo]:
    """Running instances (newest first): a bus.json whose supervisor process is still the one that wrote it."""
    found = []
    root = runs_root()
    try:
        if not root.is_dir():
            return []
        paths = list(root.glob(f"*/{INFO_FILE}"))
    except PermissionError as exc:  # e.g. a runs/ folder made by a `sudo -E arcsplit serve`
        raise BadInput(f"cannot read arcsplit's state folder {exc.filename or root}: permission denied",
                       f"give it back to this user (sudo chown -R {os.getuid()} {root.parent}), or set "
                       "ARCSPLIT_STATE_DIR to a folder of your own") from None
    for info_path in paths:
        try:
            info = BusInfo.read(info_path)
        except (OSError, ValueError, TypeError):
            continue
        if info.alive():
            found.append(info)
    return sorted(found, key=lambda i: i.started, reverse=True)


def find_run(run: str | None = None) -> BusInfo:
    """The instance named by ``run`` (a run id or a unique prefix), or the newest one."""
    runs = list_runs()
    if not runs:
        raise NotRunning("no arcsplit instance is running", "start one with `arcsplit serve MODEL --gpus 0,1`")
    if run is None:
        return runs[0]
    matches = [r for r in runs if r.run_id == run] or [r for r in runs if r.run_id.startswith(run)]
    if not matches:
        known = ", ".join(r.run_id for r in runs)
        raise NotRunning(f"no running arcsplit instance is called {run!r}", f"pick one of: {known}")
    if len(matches) > 1:
        raise BadInput(f"{run!r} matches {len(matches)} running instances", "give more of the run id")
    return matches[0]


class Client:
    """A synchronous client of one running instance: control requests, and its event stream."""

    def __init__(self, info: BusInfo, timeout: float = 10.0) -> None:
        self.info = info
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._keys = self._read_keys()
        self._dealer = self._socket(zmq.DEALER)
        self._dealer.connect(info.ctl)

    def _read_keys(self) -> dict[str, str] | None:
        if not self.info.keys:
            return None
        try:
            return json.loads(Path(self.info.keys).read_text(encoding="utf-8"))
        except OSError as exc:
            raise NotRunning(f"cannot read the bus keys of run {self.info.run_id}: {exc.strerror}",
                             "attach as the user who started it") from None

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if self._keys:
            s.curve_serverkey = self._keys["server_public"].encode()
            s.curve_publickey = self._keys["client_public"].encode()
            s.curve_secretkey = self._keys["client_secret"].encode()
        return s

    def request(self, cmd: str, **args: Any) -> Any:
        rid = uuid.uuid4().hex
        self._dealer.send(json.dumps({"v": SCHEMA_VERSION, "id": rid, "cmd": cmd, "args": args}).encode())
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._dealer.poll(int(left * 1000)):
                raise NotRunning(f"arcsplit run {self.info.run_id} did not answer {cmd!r} in {self.timeout:.0f} s",
                                 "check it with `arcsplit ps`")
            reply = json.loads(self._dealer.recv())
            if reply.get("id") != rid:
                continue  # a late answer to an earlier request that timed out
            if not reply.get("ok"):
                raise RunError(f"arcsplit run {self.info.run_id} refused {cmd!r}: {reply.get('error')}")
            return reply.get("result")

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def logs(self, name: str | None = None, n: int = 100, verbose: bool = True) -> list[str]:
        return self.request("logs", name=name, n=n, verbose=verbose)

    def restart(self, by: str = "a Python client") -> None:
        """Restart the group; ``by`` names the asker on the serving terminal (`arcsplit restart`, the dashboard)."""
        self.request("restart", by=by, pid=os.getpid())

    def stop(self, by: str = "a Python client") -> None:
        """Stop the instance; ``by`` names the asker on the serving terminal."""
        self.request("stop", by=by, pid=os.getpid())

    def snapshot(self) -> dict[str, Any]:
        return self.request("snapshot")

    def events(self, kinds: tuple[str, ...] | None = None, timeout: float | None = None,
               snapshot: bool = True, idle: float | None = None) -> Iterator[dict[str, Any]]:
        """A snapshot event first, then every later event in order, until the group has stopped (its last event),
        ``timeout`` s after the call (the whole stream: a running group is never silent for long, telemetry comes
        every 2 s), or after ``idle`` s without an event of ``kinds``."""
        end = None if timeout is None else time.monotonic() + timeout
        sub = self._socket(zmq.SUB)
        try:
            prefixes = [TOPIC_PREFIX + k.encode() + b"." for k in kinds] if kinds else [TOPIC_PREFIX]
            for p in prefixes + [TOPIC_PREFIX + b"sync.", TOPIC_PREFIX + b"group."]:
                sub.setsockopt(zmq.SUBSCRIBE, p)
            sub.connect(self.info.pub)
            self._sync(sub)
            after = 0
            if snapshot:
                snap = self.snapshot()
                after = snap["seq"]
                yield {"v": SCHEMA_VERSION, "seq": after, "time": time.time(), "kind": "snapshot",
                       "name": "group", "data": snap}
            while True:
                waits = [w for w in (idle, None if end is None else end - time.monotonic()) if w is not None]
                if waits and min(waits) <= 0:
                    return
                if not sub.poll(int(min(waits) * 1000) if waits else None):
                    return
                _topic, payload = sub.recv_multipart()
                msg = json.loads(payload)
                if msg["seq"] <= after or msg["kind"] == "sync":
                    continue
                if not kinds or msg["kind"] in kinds:
                    yield msg
                if is_final(msg):
                    return
        finally:
            sub.close(0)

    def _sync(self, sub: zmq.Socket) -> None:
        """Wait until our subscription is live, so the snapshot + later events leave no gap."""
        token = uuid.uuid4().hex
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.request("sync", token=token)
            if sub.poll(100):
                while sub.poll(0):
                    _topic, payload = sub.recv_multipart()
                    msg = json.loads(payload)
                    if msg["kind"] == "sync" and msg["data"].get("token") == token:
                        return
        raise NotRunning(f"could not subscribe to arcsplit run {self.info.run_id}", "check it with `arcsplit ps`")

    def close(self) -> None:
        # destroy, not term: an events() generator not yet finalised still holds a SUB socket, and term()
        # would wait for it forever.
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attach(run: str | None = None, timeout: float = 10.0) -> Client:
    """Connect to a running instance (the newest when ``run`` is None)."""
    return Client(find_run(run), timeout=timeout)

