"""The agent's loop: read ops, run rpc-servers as Child processes, write events; stop everything on EOF or silence.

Every rpc-server is a run/child.Child (own process group, parent-death signal, confined environment from its spec),
so the agent dying by SIGKILL still takes its rpc-servers with it. Its state file (pids, create times, argv) lives
in its own run dir under ``state_dir()/nodes/<run id>`` and the next agent's hello sweeps what a dead one left
(run/rundir.sweep, the same check of pid + create time + argv as the supervisor's).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import anyio
import psutil
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import backends
from ..errors import BadInput
from ..llama.locate import RPC_NAMES
from ..run.child import Child
from ..run.ports import free_port, is_free, probe_once
from ..run.rundir import RunDir, supervisor_identity, sweep
from ..run.procspec import LOOPBACK, ProcessSpec
from ..run.weightcache import SEED_FLAG, can_seed
from . import PROTO

if TYPE_CHECKING:
    from ..telemetry.intel import IntelSampler
    from ..telemetry.nvidia import NvidiaSampler

# ggml-rpc-server's own options (tools/rpc/rpc-server.cpp): the only ones a client may pass. True: takes a value.
RPC_FLAGS = {"-H": True, "--host": True, "-p": True, "--port": True, "-t": True, "--threads": True,
             "-d": True, "--device": True, "-c": False, "--cache": False, "--seed-cache": True}
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PORTS = 64

Emit = Callable[[dict[str, Any]], None]


def nodes_root() -> Path:
    from .._dirs import state_dir

    return state_dir() / "nodes"


def check_rpc_argv(argv: list[str], rpc_bin: str | None, allow_bind: tuple[str, ...]) -> tuple[tuple[str, ...], str, int]:
    """A client's rpc-server argv -> (argv with this host's binary, bind address, port); BadInput if refused.

    The binary must be this host's rpc-server (a bare ``ggml-rpc-server`` means it), every flag one of the
    rpc-server's own, and the bind loopback unless ``--allow-bind`` named the address.
    """
    if not argv or not all(isinstance(a, str) for a in argv):
        raise BadInput("argv must be a non-empty list of strings")
    if rpc_bin is None:
        raise BadInput("no llama.cpp build on this host", "run `arcsplit llama build` there")
    exe = argv[0]
    if exe not in RPC_NAMES and Path(exe).resolve() != Path(rpc_bin).resolve():
        raise BadInput(f"{exe} is not this host's rpc-server ({rpc_bin})", "the node only starts its own rpc-server")
    host, port, i = LOOPBACK, None, 1
    while i < len(argv):
        flag = argv[i]
        if flag not in RPC_FLAGS:
            raise BadInput(f"{flag!r} is not an rpc-server option the node passes",
                           f"use only {', '.join(sorted(RPC_FLAGS))}")
        if RPC_FLAGS[flag]:
            if i + 1 >= len(argv):
                raise BadInput(f"{flag} needs a value")
            value = argv[i + 1]
            if flag in ("-H", "--host"):
                host = value
            elif flag in ("-p", "--port"):
                port = int(value) if value.isdigit() else -1
            i += 2
        else:
            i += 1
    if host != LOOPBACK and host not in allow_bind:
        raise BadInput(f"binding {host} is not allowed on this host",
                       "the node binds 127.0.0.1 unless started with --allow-bind ADDR (layout link = \"direct\")")
    if port is None or not 0 < port < 65536:
        raise BadInput("the rpc-server argv needs -p PORT (1-65535)")
    return (rpc_bin, *argv[1:]), host, port


def drop_missing_seeds(argv: tuple[str, ...], can_seed: bool) -> tuple[tuple[str, ...], list[str]]:
    """``--seed-cache FILE`` kept only for a file this host has and a build that can seed (patch 0006): the
    client names its own GGUF's path (or the layout's model_dir), which this host may lack. Without it the
    rpc-server still starts and the weights come over the link. -> (argv, one line per file dropped, saying why)."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == SEED_FLAG and i + 1 < len(argv):
            path = argv[i + 1]
            if not can_seed:
                notes.append(f"this host's rpc-server cannot read weights from a GGUF (patch 0006): {path}'s "
                             "weights come over the link")
            elif not (os.path.isfile(path) and os.access(path, os.R_OK)):
                notes.append(f"no readable {path} on this host: its weights come over the link (put the same "
                             "file there, or name its directory with model_dir in the layout's [[hosts]])")
            else:
                out += argv[i:i + 2]
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return tuple(out), notes


class GpuReporter:
    """This host's cards as the main host's telemetry would sample them were they local: the samplers of the
    group's backend (backends.REGISTRY[...].sampler), made at the first report and kept for their rates. Every card
    of that kind here is reported (the main host matches plan cards to them as it does its own); memory counts only
    the agent's children. Plain file reads (Intel) or NVML calls, no subprocess; a sampler that is not available,
    or that fails, reports nothing. The samplers are imported at the first report, not at the agent's start (the
    telemetry package pulls in the route and HTTP)."""

    def __init__(self, sys_root: Path, proc_root: Path, nvml: bool) -> None:
        self._sys_root, self._proc_root, self._want_nvml = sys_root, proc_root, nvml
        self._intel: IntelSampler | None = None
        self._nvidia: NvidiaSampler | None = None

    def sample(self, backend: str | None, pids: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
        """-> {"intel": {pci: row}} or {"cuda": {"index": row}} (JSON keys are strings); {} when there is none."""
        known = backends.REGISTRY.get(backend or "")
        kind = known.sampler if known else None
        try:
            if kind == "intel":
                if self._intel is None:
                    from ..telemetry.intel import IntelSampler

                    self._intel = IntelSampler(self._sys_root, self._proc_root)
                rows = self._intel.sample(pids) if self._intel.available else {}
                return {"intel": rows} if rows else {}
            if kind == "nvidia" and self._want_nvml:
                if self._nvidia is None:
                    from ..telemetry.nvidia import NvidiaSampler

                    self._nvidia = NvidiaSampler()
                if not self._nvidia.available:
                    return {}
                nv = self._nvidia.sample(range(self._nvidia.count()), pids)
                return {"cuda": {str(i): row for i, row in nv.items()}} if nv else {}
        except Exception:  # a sampler's surprise must not end the agent (and its rpc-servers) or the stats
            pass
        return {}

    def close(self) -> None:
        if self._nvidia is not None:
            self._nvidia.close()


class Agent:
    """One agent process: its children by name, its run dir, the time of the last message from the client."""

    def __init__(self, emit: Emit, *, heartbeat: float, allow_bind: tuple[str, ...],
                 inventory: Callable[[str | None], dict[str, Any]], sys_root: Path = Path("/sys/class/drm"),
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

    async def serve(self, lines: MemoryObjectReceiveStream[bytes]) -> None:
        """Handle ops until stdin ends or the client goes silent; then stop every rpc-server (shielded)."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, tg)
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
                self.emit({"ev": "error", "name": "", "message": f"no ping for {silent:.0f} s: stopping"})
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
        event: dict[str, Any] = {"ev": "stats", "cpu": cpu, "rss": rss, "threads": threads, "stopped": stopped}
        gpus = self._gpus.sample(self.backend, pids) if pids else {}
        if gpus:
            event["gpus"] = gpus
        return event

    async def _handle(self, tg: TaskGroup, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError:
            self.emit({"ev": "error", "name": "", "message": "not a JSON object line"})
            return
        op, name = msg.get("op"), ""
        try:
            if op == "ping":
                self.emit({"ev": "pong"})
            elif op == "hello":
                await self._hello(msg)
            elif self.run_dir is None:
                raise BadInput(f"{op!r} before hello", "send hello first")
            elif op == "ports":
                self.emit({"ev": "ports", "ports": self._ports(msg)})
            elif op == "start":
                raw_spec = msg.get("spec")
                spec: dict[str, Any] = raw_spec if isinstance(raw_spec, dict) else {}
                name = str(spec.get("name", ""))
                await self._start(tg, spec)
            elif op == "stop":
                name = str(msg.get("name", ""))
                child = self.children.get(name)
                if child is None:
                    raise BadInput(f"no process {name!r} here")
                tg.start_soon(child.stop, float(msg.get("grace", 10.0)))
            else:
                raise BadInput(f"unknown op {op!r}", "ops: hello, ports, start, stop, ping")
        except (BadInput, ValueError, TypeError) as exc:
            self.emit({"ev": "error", "name": name, "message": str(exc)})

    async def _hello(self, msg: dict[str, Any]) -> None:
        run = str(msg.get("run", ""))
        if msg.get("proto") != PROTO:
            raise BadInput(f"protocol {msg.get('proto')!r} is not this node's {PROTO}",
                           "run the same arcsplit version on both hosts")
        if not _RUN_ID.match(run):
            raise BadInput(f"run id {run!r} is not a plain name")
        backend = msg.get("backend")  # the group's backend: that build's rpc-server, not whatever auto picks here
        if backend is not None and backend not in backends.NAMES:
            raise BadInput(f"backend {backend!r} is unknown here", f"use one of {', '.join(backends.NAMES)}")
        self.backend = backend
        if self.run_dir is None:
            killed = await anyio.to_thread.run_sync(sweep, nodes_root())
            if killed:
                self.emit({"ev": "line", "name": "", "line": f"swept leftovers of a dead agent: pids {killed}"})
            self.run_dir = RunDir.create(run, root=nodes_root())
            self._write_state()
            self.inventory = await anyio.to_thread.run_sync(self._inventory_fn, backend)
        self.emit({"ev": "hello", "proto": PROTO, **(self.inventory or {}), "pid": os.getpid()})

    def _ports(self, msg: dict[str, Any]) -> list[int]:
        n, bind = int(msg.get("n", 1)), str(msg.get("bind", LOOPBACK))
        if not 0 < n <= MAX_PORTS:
            raise BadInput(f"ports: n={n} is not 1-{MAX_PORTS}")
        if bind != LOOPBACK and bind not in self.allow_bind:
            raise BadInput(f"binding {bind} is not allowed on this host", "start the node with --allow-bind ADDR")
        want = msg.get("want")
        if want is not None:  # the user's ports: each must be free here
            ports = [int(p) for p in want]
            if len(ports) != n or any(not 0 < p < 65536 for p in ports):
                raise BadInput(f"ports: want {want!r} is not {n} ports 1-65535")
            busy = [p for p in ports if not self._free(bind, p)]
            if busy:
                raise BadInput(f"port {busy[0]} on {bind} is already in use on this host",
                               "stop what uses it there or pass other --rpc-ports")
            return ports
        ports = []
        for p in msg.get("prefer") or ():  # the client's guesses (its ssh links already point there), if free
            if len(ports) < n and isinstance(p, int) and 0 < p < 65536 and p not in ports and self._free(bind, p):
                ports.append(p)
        while len(ports) < n:
            try:
                p = free_port(bind)
            except OSError as exc:
                raise BadInput(f"cannot listen on {bind} here: {exc.strerror}") from None
            if p not in ports:
                ports.append(p)
        return ports

    async def _start(self, tg: TaskGroup, spec: dict[str, Any]) -> None:
        name = str(spec.get("name", ""))
        if not _NAME.match(name):
            raise BadInput(f"process name {name!r} is not a plain name")
        old = self.children.get(name)
        if old is not None and old.alive:
            raise BadInput(f"{name} is already running here (pid {old.pid})", "stop it first")
        rpc_bin = (self.inventory or {}).get("llama", {}).get("rpc_bin")
        argv, bind, port = check_rpc_argv(list(spec.get("argv") or []), rpc_bin, self.allow_bind)
        argv, dropped = drop_missing_seeds(argv, bool(rpc_bin) and can_seed(Path(str(rpc_bin)), None))
        if not self._free(bind, port):  # else the ready probe would be answered by whoever holds it
            raise BadInput(f"port {port} on {bind} is already in use on this host")
        env = {str(k): str(v) for k, v in dict(spec.get("env") or {}).items()}
        bad = [k for k in env if k.startswith(("LD_", "DYLD_"))]
        if bad:
            raise BadInput(f"environment variable {bad[0]} is not passed to an rpc-server")
        ps = ProcessSpec(name=name, role="rpc", argv=argv, env=tuple(sorted(env.items())), host=bind, port=port,
                         cards=tuple(int(c) for c in spec.get("cards") or ()),
                         devices=tuple(str(d) for d in spec.get("devices") or ()), ignore_sigpipe=True,
                         env_unset=tuple(str(v) for v in spec.get("env_unset") or ()))
        assert self.run_dir is not None
        child = Child(ps, log_path=self.run_dir.log_path(name), on_line=self._on_line, on_exit=self._on_exit)
        self.children[name] = child
        await tg.start(child.run)
        self.emit({"ev": "started", "name": name, "pid": child.pid, "create_time": child.create_time})
        for note in dropped:
            self.emit({"ev": "line", "name": name, "line": f"arcsplit node: {note}"})
        self._write_state()
        tg.start_soon(self._probe, child)

    @staticmethod
    def _free(bind: str, port: int) -> bool:
        try:
            return is_free(bind, port)
        except OSError as exc:
            raise BadInput(f"cannot listen on {bind} here: {exc.strerror}") from None

    async def _probe(self, child: Child) -> None:
        """The rpc-server's only probe: one connect-and-close per try until one succeeds (it serves one client)."""
        while child.alive:
            if await probe_once(child.spec.host, child.spec.port, timeout=1.0):
                if child.alive:
                    self.emit({"ev": "ready", "name": child.spec.name})
                return
            await anyio.sleep(0.02)  # as the supervisor's own probe: only during a start

    def _on_line(self, child: Child, line: str) -> None:
        self.emit({"ev": "line", "name": child.spec.name, "line": line})

    def _on_exit(self, child: Child) -> None:
        self.emit({"ev": "exit", "name": child.spec.name, "returncode": child.returncode})
        self._write_state()

    def _write_state(self) -> None:
        if self.run_dir is None:
            return
        procs = [{"name": c.spec.name, "pid": c.pid, "pgid": c.pid, "create_time": c.create_time,
                  "port": c.spec.port, "argv": list(c.spec.argv)}
                 for c in self.children.values() if c.alive and c.pid is not None]
        try:
            self.run_dir.write_state({"supervisor": supervisor_identity(), "node": True, "processes": procs})
        except OSError:
            pass


async def _read_stdin(send: MemoryObjectSendStream[bytes]) -> None:
    """stdin lines into ``send`` from a daemon thread (raw fd reads: no buffer lock held at exit)."""
    async with BlockingPortal() as portal:
        def reader() -> None:
            buf = b""
            try:
                while True:
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


def run_stdio(*, heartbeat: float, allow_bind: tuple[str, ...],
              inventory: Callable[[str | None], dict[str, Any]]) -> int:
    """The ``--stdio`` agent: JSON lines on stdin/stdout until EOF or ``heartbeat`` seconds without a message."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # a stray print anywhere goes to stderr, never into the message stream
    lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(event, separators=(",", ":")) + "\n")

    async def main() -> None:
        send, receive = anyio.create_memory_object_stream[bytes](256)
        agent = Agent(emit, heartbeat=heartbeat, allow_bind=allow_bind, inventory=inventory)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_read_stdin, send)
            await agent.serve(receive)
            tg.cancel_scope.cancel()

    anyio.run(main)
    return 0
