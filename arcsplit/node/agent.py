"""The agent's loop: read ops, run rpc-servers as Child processes, write events; stop everything on EOF or silence.

Every rpc-server is a proc/child.Child (own process group, parent-death signal, confined environment from its spec),
so the agent dying by SIGKILL still takes its rpc-servers with it. Its state file (pids, create times, argv) lives
in its own run dir under ``state_dir()/nodes/<run id>`` and the next agent's hello sweeps what a dead one left
(proc/rundir.sweep, the same check of pid + create time + argv as the supervisor's).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import anyio
import psutil
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import backends
from ..errors import BadInput
from ..proc import wire
from ..proc.child import Child
from ..proc.popen import PopenProcess
from ..proc.ports import owns_port
from ..proc.rundir import RunDir
from .ops import (Handover, Inventory, answering, check_rpc_argv, drop_missing_seeds, greet, hello_args,
                  hello_events, nodes_root, pick_ports, rpc_process, started_events, write_state)

if TYPE_CHECKING:
    from ..samples import CardSampler

__all__ = ["Agent", "GpuReporter", "check_rpc_argv", "drop_missing_seeds", "nodes_root", "serve_stdio"]

Emit = Callable[[dict[str, Any]], None]


class GpuReporter:
    """This host's cards as the main host's telemetry would sample them were they local: the sampler of the
    group's backend (Backend.sampler), made at the first report and kept for its rates. Every card of that kind
    here is reported (the main host matches plan cards to them as it does its own); memory counts only the agent's
    children. Plain file reads (Intel) or NVML calls, no subprocess; a sampler that is not available, or that
    fails, reports nothing. The sampler's module is imported at the first report, not at the agent's start."""

    def __init__(self, sys_root: Path, proc_root: Path, nvml: bool) -> None:
        self._sys_root, self._proc_root, self._want_nvml = sys_root, proc_root, nvml
        self._sampler: CardSampler | None = None

    def sample(self, backend: str | None, pids: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
        """-> {kind: {card key: row}} (CardSampler.kind: {"intel": {pci: row}}, {"cuda": {"index": row}}); {} when
        there is none."""
        known = backends.REGISTRY.get(backend or "")
        if known is None or known.sampler is None:
            return {}
        try:
            if self._sampler is None:
                cls = known.sampler_class()
                if cls is None:
                    return {}
                self._sampler = cls.create(self._sys_root, self._proc_root, self._want_nvml)
            rows = self._sampler.sample(None, pids) if self._sampler.available else {}
            return {self._sampler.kind: {key: row.to_dict() for key, row in rows.items()}} if rows else {}
        except Exception:  # a sampler's surprise must not end the agent (and its rpc-servers) or the stats
            return {}

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()


class Agent:
    """One agent process: its children by name, its run dir, the time of the last message from the client."""

    def __init__(self, emit: Emit, *, heartbeat: float, allow_bind: tuple[str, ...],
                 inventory: Inventory, sys_root: Path = Path("/sys/class/drm"),
                 proc_root: Path = Path("/proc"), nvml: bool = True) -> None:
        self._emit = emit
        self.heartbeat = heartbeat
        self.allow_bind = allow_bind
        self._inventory_fn = inventory
        self.inventory: dict[str, Any] | None = None
        self.backend: str | None = None  # the hello's: which sampler reads this host's cards
        self._gpus = GpuReporter(sys_root, proc_root, nvml)
        self.run_dir: RunDir | None = None
        self.children: dict[str, Child] = {}
        self._last_heard = time.monotonic()

    def emit(self, event: dict[str, Any]) -> None:
        try:
            self._emit(event)
        except (BrokenPipeError, OSError):
            pass  # the client is gone: stdin's EOF ends the loop

    async def serve(self, lines: MemoryObjectReceiveStream[bytes], early: Handover | None = None) -> None:
        """Handle ops (``early``'s first: node/quick.py's) until stdin ends or the client goes silent; then stop
        every rpc-server (shielded)."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, tg)
                if early is not None:
                    await self.take_over(tg, early)
                    for raw in early.lines:
                        self._last_heard = time.monotonic()
                        await self._handle(tg, raw)
                async with lines:
                    async for raw in lines:
                        self._last_heard = time.monotonic()  # any message counts as a ping
                        await self._handle(tg, raw)
                tg.cancel_scope.cancel()  # EOF: every Child.run stops its process group on cancel
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for child in self.children.values():
                        tg.start_soon(child.stop, 2.0)
                self._write_state()
                self._gpus.close()

    async def _watch(self, tg: TaskGroup) -> None:
        """Stats every second; give up when pings stop."""
        while True:
            await anyio.sleep(1.0)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat:
                self.emit(wire.error("", f"no ping for {silent:.0f} s: stopping"))
                tg.cancel_scope.cancel()
                return
            self.emit(self.stats())

    def stats(self) -> dict[str, Any]:
        """The ``stats`` event: CPU for the supervisor's stall timeout; CPU, RSS, threads and the cards' use for
        the telemetry of the main host, which cannot see these processes or cards."""
        cpu, rss, threads, stopped = {}, {}, {}, []
        pids = []
        for name, child in self.children.items():
            if child.alive and child.pid:
                pids.append(child.pid)
                try:
                    p = psutil.Process(child.pid)
                    with p.oneshot():
                        t = p.cpu_times()
                        cpu[name] = round(t.user + t.system, 3)
                        rss[name] = p.memory_info().rss
                        threads[name] = p.num_threads()
                        if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                            stopped.append(name)
                except psutil.Error:
                    pass
        gpus = self._gpus.sample(self.backend, pids) if pids else {}
        return wire.stats(cpu, rss, threads, stopped, gpus)

    async def _handle(self, tg: TaskGroup, raw: bytes) -> None:
        try:
            msg = wire.decode(raw)
        except ValueError:
            self.emit(wire.error("", "not a JSON object line"))
            return
        name = wire.subject(msg) if self.run_dir is not None else ""  # an error about a process names it
        try:
            await wire.dispatch(msg, _Ops(self, tg))
        except (BadInput, ValueError, TypeError) as exc:
            self.emit(wire.error(name, str(exc)))

    async def _hello(self, op: wire.Hello) -> None:
        run, self.backend = hello_args(op)
        if self.run_dir is None:
            self.run_dir, self.inventory, killed = await anyio.to_thread.run_sync(greet, run, self.backend,
                                                                                  self._inventory_fn)
            self._write_state()
        else:
            killed = []
        for event in hello_events(self.inventory, killed):
            self.emit(event)

    async def _start(self, tg: TaskGroup, spec: Mapping[str, Any]) -> None:
        name = str(spec.get("name", ""))
        old = self.children.get(name)
        if old is not None and old.alive:
            raise BadInput(f"{name} is already running here (pid {old.pid})", "stop it first")
        ps, dropped = rpc_process(spec, self.inventory, self.allow_bind)
        await self._run(tg, Child(ps, log_path=self._log(name), on_line=self._on_line, on_exit=self._on_exit),
                        dropped)

    async def _run(self, tg: TaskGroup, child: Child, notes: list[str]) -> None:
        """Supervise ``child``, say so, and probe it."""
        self.children[child.spec.name] = child
        await tg.start(child.run)
        self._write_state()  # recorded before it is announced: a next agent's sweep can find it from then on
        for event in started_events(child.spec, child.pid, child.create_time, notes):
            self.emit(event)
        tg.start_soon(self._probe, child)

    def _log(self, name: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir.log_path(name)

    async def take_over(self, tg: TaskGroup, early: Handover) -> None:
        """Carry on from node/quick.py: its run dir and inventory, and its rpc-servers as Children (it has said
        ``started`` for each, and ``ready`` for those that answered)."""
        if early.run_dir is None:
            return
        self.run_dir, self.inventory, self.backend = early.run_dir, early.inventory, early.backend
        for s in early.started:
            child = Child(s.spec, log_path=self._log(s.spec.name), on_line=self._on_line, on_exit=self._on_exit)
            child.adopt(PopenProcess(s.popen))
            self.children[s.spec.name] = child
            await tg.start(child.run)
            if not s.ready:
                tg.start_soon(self._probe, child)
        self._write_state()

    async def _probe(self, child: Child) -> None:
        """The rpc-server's readiness: its own process listens on its port (asked of /proc, never by connecting:
        each connection is two lines of its log, and it serves one client at a time)."""
        while child.alive:
            if child.pid is not None and owns_port(child.pid, child.spec.port, child.spec.host):  # not another user's
                if child.alive:
                    self.emit(wire.ready(child.spec.name))
                return
            await anyio.sleep(0.02)  # as the supervisor's own probe: only during a start

    def _on_line(self, child: Child, line: str) -> None:
        self.emit(wire.line(child.spec.name, line))

    def _on_exit(self, child: Child) -> None:
        self.emit(wire.exited(child.spec.name, child.returncode))
        self._write_state()

    def _write_state(self) -> None:
        if self.run_dir is None:
            return
        write_state(self.run_dir, [(c.spec, c.pid, c.create_time) for c in self.children.values()
                                   if c.alive and c.pid is not None])


class _Ops:
    """The agent's side of wire.dispatch: each op, its errors raised for Agent._handle to report."""

    def __init__(self, agent: Agent, tg: TaskGroup) -> None:
        self.agent, self.tg = agent, tg

    @property
    def greeted(self) -> bool:
        return self.agent.run_dir is not None

    async def ping(self, op: wire.Ping) -> None:
        answering()
        self.agent.emit(wire.pong())

    async def hello(self, op: wire.Hello) -> None:
        await self.agent._hello(op)

    async def ports(self, op: wire.Ports) -> None:
        self.agent.emit(wire.ports(pick_ports(op, self.agent.allow_bind)))

    async def start(self, op: wire.Start) -> None:
        await self.agent._start(self.tg, op.spec or {})

    async def stop(self, op: wire.Stop) -> None:
        child = self.agent.children.get(op.name)
        if child is None:
            raise BadInput(f"no process {op.name!r} here")
        self.tg.start_soon(child.stop, op.grace)

    async def refuse(self, op: object, why: str, fix: str) -> None:
        raise BadInput(why, fix)


async def _read_stdin(send: MemoryObjectSendStream[bytes], rest: bytes = b"", eof: bool = False) -> None:
    """stdin lines into ``send`` from a daemon thread (raw fd reads: no buffer lock held at exit); ``rest``: the
    start of a line node/quick.py read, ``eof``: it saw the end."""
    async with BlockingPortal() as portal:
        def reader() -> None:
            buf = rest
            try:
                while not eof:
                    chunk = os.read(0, 65536)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            portal.call(send.send, line)
            except Exception:  # the loop is gone or stdin broke: either way the input has ended
                pass
            try:
                portal.call(send.aclose)
            except Exception:
                pass

        threading.Thread(target=reader, name="stdin", daemon=True).start()
        await portal.sleep_until_stopped()


def serve_stdio(emit: Emit, early: Handover, *, heartbeat: float, allow_bind: tuple[str, ...],
                inventory: Inventory) -> int:
    """The ``--stdio`` agent after node/quick.py: until EOF or ``heartbeat`` seconds without a message."""
    async def main() -> None:
        send, receive = anyio.create_memory_object_stream[bytes](256)
        agent = Agent(emit, heartbeat=heartbeat, allow_bind=allow_bind, inventory=inventory)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_read_stdin, send, early.rest, early.eof)
            await agent.serve(receive, early)
            tg.cancel_scope.cancel()

    anyio.run(main)
    return 0
