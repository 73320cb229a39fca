"""The node agent's first moments, before it has imported anyio: ping, hello, ports and start answered at once.

Over SSH the agent starts after the login, and everything on that host waits for it: on a small machine anyio,
asyncio and psutil take 0.2-0.3 s to import, longer than the rest of the agent's start. So ``--stdio`` begins
here, with the standard library and arcsplit's light modules: it answers the first ops with node/ops.py (the
agent's own code for them) and starts each rpc-server with proc/spawn.py's ``popen`` (the same shim, environment
and session as every child). The heavy imports run in a thread once the started rpc-servers listen (at most
``IMPORT_WAIT`` s after the first start), or once no op has come for ``IDLE_IMPORT`` s (a client planning a big
model): not while hello, ports and start are on their way, nor while a started rpc-server comes up, which is where a
start over SSH waits on this host (begun at the start, the imports' extension loading held the interpreter lock
long enough that this loop saw the rpc-server listen 20-40 ms late in most starts on 2 cores). An import thread then holds the interpreter lock and one of a
small host's cores for ~0.25 s, and the answers waited on both (an earlier version began it after ``IDLE`` s of
quiet, so a hello arriving just after the agent was up found it importing). While it runs the interpreter switches
threads every ``SWITCH`` s instead of 5 ms, so an op still gets an answer at once. Meanwhile this loop probes each
started rpc-server and says ``ready`` as the agent would. When the imports are done, node/agent.py takes over
(``Handover``): its Children adopt the processes, and it handles whatever this loop did not: every other op, and
anything unusual (an error is reported by the agent, once).
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import sys
import threading
import time
from typing import Any, Callable

from ..proc.ports import owns_port
from ..proc import wire
from ..proc.spawn import popen
from ..proc.spec import ProcessSpec
from .ops import (Handover, Inventory, Started, answering, greet, hello_args, hello_events, pick_ports, rpc_process,
                  started_events, write_state)

IDLE = 0.02  # s without an op before the hello's inventory is read (the client is still planning)
IDLE_IMPORT = 0.5  # s without an op before the heavy imports start though no rpc-server was asked for
IMPORT_WAIT = 0.2  # s after the first start at most: the heavy imports wait for the started rpc-servers to listen
POLL = 0.005  # s between probes of a started rpc-server while the imports run
SWITCH = 0.0005  # s: the interpreter's thread switch interval while the imports run (Python's default: 0.005)
HEAVY = "arcsplit.node.agent"  # anyio, psutil and the Child supervision it needs

Emit = Callable[[dict[str, Any]], None]


def first_ops(fd: int, emit: Emit, *, allow_bind: tuple[str, ...], inventory: Inventory,
              load: Callable[[], object] = lambda: importlib.import_module(HEAVY)) -> Handover:
    """Answer the ops this module knows from ``fd`` until ``load`` has run (in a thread) or input ends."""
    h = Handover()
    prefetched = _Prefetched(inventory)
    loader: threading.Thread | None = None
    deferred = False  # a line was left to the agent: read nothing more, keep the order
    heard = time.monotonic()  # the last input
    read = False  # the hello's inventory was read while idle
    first_start: float | None = None  # when the first rpc-server was started
    switch = sys.getswitchinterval()

    def begin() -> None:
        nonlocal loader
        if loader is None:
            loader = threading.Thread(target=load, name="imports", daemon=True)
            sys.setswitchinterval(SWITCH)
            loader.start()

    try:
        while loader is None or loader.is_alive():
            for s in h.started:
                # its own process listening (not another user's listener on that port), asked of /proc, not by
                # connecting: an rpc-server logs each connection and serves one client at a time
                if not s.ready and s.popen.poll() is None and owns_port(s.popen.pid, s.spec.port, s.spec.host):
                    s.ready = True
                    emit(wire.ready(s.spec.name))
            if h.eof and not h.started and not h.lines:
                return h  # the client left: nothing to stop, nothing to answer, no reason to import the rest
            if deferred or h.eof:
                begin()
                time.sleep(POLL)
                continue
            coming = [s for s in h.started if not s.ready and s.popen.poll() is None]
            if first_start is not None and (not coming or time.monotonic() - first_start >= IMPORT_WAIT):
                begin()  # the started rpc-servers listen (or are taking long): import while the client goes on
            if loader is not None or coming:
                wait = POLL
            elif h.run_dir is None and not read:
                wait = IDLE
            else:
                wait = max(0.001, heard + IDLE_IMPORT - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                if loader is None:
                    if h.run_dir is None and not read:  # idle before the hello: read this host's build and cards
                        prefetched.fetch()
                        inventory, read = prefetched, True
                    elif time.monotonic() - heard >= IDLE_IMPORT:
                        begin()  # the client is busy for a while (planning a big model): import meanwhile
                continue
            heard = time.monotonic()
            chunk = os.read(fd, 65536)
            if not chunk:
                h.eof = True
                continue
            *lines, h.rest = (h.rest + chunk).split(b"\n")
            for raw in lines:
                if not raw.strip():
                    continue
                if deferred or not _handle(raw, h, emit, allow_bind, inventory):
                    deferred = True
                    h.lines.append(raw)
            if h.started and first_start is None:
                first_start = time.monotonic()
        return h
    finally:
        sys.setswitchinterval(switch)


class _Prefetched:
    """The hello's inventory read while the client is still planning (it takes ~20 ms: llama.cpp's build info and
    the cards), kept for a hello that asks for the backend it resolved to; any other hello reads its own."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.got: dict[str, Any] | None = None

    def fetch(self) -> None:
        try:
            self.got = self.inventory(None)
        except Exception:  # noqa: BLE001 - the hello reads it again and reports what is wrong
            self.got = None

    def __call__(self, backend: str | None) -> dict[str, Any]:
        got, self.got = self.got, None
        if got is not None and (backend is None or (got.get("llama") or {}).get("backend") == backend):
            return got
        return self.inventory(backend)


def _handle(raw: bytes, h: Handover, emit: Emit, allow_bind: tuple[str, ...], inventory: Inventory) -> bool:
    """One op on the happy path; False leaves it (and all after it) to the agent, which also reports errors."""
    try:
        return wire.dispatch(wire.decode(raw), _Early(h, emit, allow_bind, inventory))
    except Exception:  # noqa: BLE001 - nothing was started: the agent handles the line again and says what is wrong
        return False


class _Early:
    """The ops this loop answers itself (a wire.Handler: True handled, False left to the agent): ping, hello,
    ports, and start of a new rpc-server; everything else, and any op before hello, goes to the agent."""

    def __init__(self, h: Handover, emit: Emit, allow_bind: tuple[str, ...], inventory: Inventory) -> None:
        self.h, self.emit, self.allow_bind, self.inventory = h, emit, allow_bind, inventory

    @property
    def greeted(self) -> bool:
        return self.h.run_dir is not None

    def ping(self, op: wire.Ping) -> bool:
        answering()
        self.emit(wire.pong())
        return True

    def hello(self, op: wire.Hello) -> bool:
        run, backend = hello_args(op)
        killed: list[int] = []
        if self.h.run_dir is None:
            self.h.run_dir, self.h.inventory, killed = greet(run, backend, self.inventory)
        self.h.backend = backend
        for event in hello_events(self.h.inventory, killed):
            self.emit(event)
        return True

    def ports(self, op: wire.Ports) -> bool:
        self.emit(wire.ports(pick_ports(op, self.allow_bind)))
        return True

    def start(self, op: wire.Start) -> bool:
        if op.spec is None or any(s.spec.name == op.name for s in self.h.started):
            return False
        spec, dropped = rpc_process(op.spec, self.h.inventory, self.allow_bind)
        _start(spec, dropped, self.h, self.emit)
        return True

    def stop(self, op: wire.Stop) -> bool:
        return False

    def refuse(self, op: object, why: str, fix: str) -> bool:
        return False


def _start(spec: ProcessSpec, notes: list[str], h: Handover, emit: Emit) -> None:
    """Spawn, then say ``started`` as the agent would (OSError: nothing started)."""
    started = Started(spec, popen(spec))
    h.started.append(started)
    import psutil  # start-up: after the spawn, so the rpc-server starts meanwhile

    try:
        started.create_time = psutil.Process(started.popen.pid).create_time()
    except psutil.Error:
        pass
    assert h.run_dir is not None  # recorded before it is announced: a next agent's sweep can find it from then on
    write_state(h.run_dir, [(s.spec, s.popen.pid, s.create_time) for s in h.started if s.popen.poll() is None])
    for event in started_events(spec, started.popen.pid, started.create_time, notes):
        emit(event)


def run_stdio(*, heartbeat: float, allow_bind: tuple[str, ...], inventory: Inventory) -> int:
    """The ``--stdio`` agent: JSON lines on stdin/stdout until EOF or ``heartbeat`` seconds without a message."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # a stray print anywhere goes to stderr, never into the message stream
    lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        try:
            with lock:
                out.write(wire.encode(event).decode())
        except (BrokenPipeError, OSError):
            pass  # the client is gone: stdin's EOF ends the loop

    if os.environ.get("ARCSPLIT_NODE_QUICK", "1") == "0":  # off: the agent does everything (bench/node_start.py)
        h = Handover()
    else:  # the first phase imports the agent's stack: no cyclic collections over what the imports make (cli.main)
        gc.disable()
        try:
            h = first_ops(0, emit, allow_bind=allow_bind, inventory=inventory)
        finally:
            gc.freeze()
            gc.enable()
    if h.eof and not h.started and not h.lines:
        return 0  # the client left before asking for anything this agent would have to stop
    from .agent import serve_stdio  # start-up: anyio and psutil, imported by first_ops's thread by now

    return serve_stdio(emit, h, heartbeat=heartbeat, allow_bind=allow_bind, inventory=inventory)
