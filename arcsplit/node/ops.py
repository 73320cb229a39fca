"""What each op of the node protocol checks and does, without an event loop.

Shared by the agent's two phases: node/quick.py answers the first ops (ping, hello, ports, start) before anyio is
imported, node/agent.py everything after. Standard library and arcsplit's light modules only: every import here
is paid on the critical path of a start over SSH.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .. import backends
from .._dirs import state_dir
from ..errors import BadInput
from ..llama.locate import RPC_NAMES
from ..llama.seeding import SEED_FLAG, can_seed
from ..proc.ports import free_port, is_free
from ..proc.rundir import RunDir, since_boot, supervisor_identity, sweep
from ..proc.spec import LOOPBACK, ProcessSpec
from ..proc import wire
from ..proc.wire import PROTO, Hello, Ports
from ..netaddr import same_address
from ..roles import Role

# ggml-rpc-server's own options (tools/rpc/rpc-server.cpp): the only ones a client may pass. True: takes a value.
RPC_FLAGS = {"-H": True, "--host": True, "-p": True, "--port": True, "-t": True, "--threads": True,
             "-d": True, "--device": True, "-c": False, "--cache": False, "--seed-cache": True}
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PORTS = 64

Inventory = Callable[[str | None], dict[str, Any]]


@dataclass
class Started:
    """An rpc-server node/quick.py started: the agent adopts ``popen`` as a Child."""

    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    create_time: float | None = None
    ready: bool = False  # its port accepted a connection and ``ready`` was sent


@dataclass
class Handover:
    """What node/agent.py carries on from when node/quick.py hands over: the hello's results, the rpc-servers
    started, the input not handled yet."""

    run_dir: RunDir | None = None
    inventory: dict[str, Any] | None = None
    backend: str | None = None
    started: list[Started] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)  # complete lines, in order, for the agent to handle
    rest: bytes = b""  # the start of a line not complete yet
    eof: bool = False  # stdin ended


def nodes_root() -> Path:
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
                port = int(value) if value.isascii() and value.isdigit() else -1
            i += 2
        else:
            i += 1
    if not may_bind(host, allow_bind):
        raise BadInput(f"binding {host} is not allowed on this host",
                       "the node binds 127.0.0.1 unless started with --allow-bind ADDR (layout link = \"direct\")")
    if port is None or not 0 < port < 65536:
        raise BadInput("the rpc-server argv needs -p PORT (1-65535)")
    return (rpc_bin, *argv[1:]), host, port


def may_bind(address: str, allow_bind: tuple[str, ...]) -> bool:
    """Loopback, or one of the addresses ``--allow-bind`` named, compared as addresses (never the wildcard: the
    node refused that at start)."""
    return any(same_address(address, a) for a in (LOOPBACK, *allow_bind))


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


def hello_args(op: Hello) -> tuple[str, str | None]:
    """A hello's run id and backend (the group's: that build's rpc-server, not whatever auto picks here)."""
    run = op.run
    if op.proto != PROTO:
        raise BadInput(f"protocol {op.proto!r} is not this node's {PROTO}",
                       "run the same arcsplit version on both hosts")
    if not _RUN_ID.match(run):
        raise BadInput(f"run id {run!r} is not a plain name")
    backend = op.backend
    if backend is not None and backend not in backends.REGISTRY:
        raise BadInput(f"backend {backend!r} is unknown here", f"use one of {', '.join(backends.names())}")
    return run, backend


def greet(run: str, backend: str | None, inventory: Inventory) -> tuple[RunDir, dict[str, Any], list[int]]:
    """The first hello's work: sweep what a dead agent left, this run's dir, this host's inventory.
    -> (run dir, inventory, pids swept)."""
    killed = sweep(nodes_root())
    run_dir = RunDir.create(run, root=nodes_root())
    return run_dir, inventory(backend), killed


@functools.cache
def answering() -> float | None:
    """How long this process took from its creation to its first answer, noted on the first call (the first
    pong, or the hello). Over SSH the process is the one sshd forked for the login shell, so this is the shell's
    rc, the exec of Python and the agent's imports: what a slow ``~/.bashrc`` there adds to every start (the hello
    reports it as ``started_s``)."""
    started = since_boot(os.getpid())
    return None if started is None else round(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 3)


def hello_events(inventory: dict[str, Any] | None, killed: list[int]) -> list[dict[str, Any]]:
    """What a hello is answered with: a line naming what was swept (if anything), then the hello itself."""
    swept = [wire.line("", f"swept leftovers of a dead agent: pids {killed}")] if killed else []
    return [*swept, wire.hello(inventory, answering())]


def started_events(spec: ProcessSpec, pid: int | None, create_time: float | None,
                   notes: list[str]) -> list[dict[str, Any]]:
    """What a start is answered with: ``started``, then one line per note (a ``--seed-cache`` file dropped)."""
    return [wire.started(spec.name, pid, create_time),
            *(wire.line(spec.name, f"arcsplit node: {note}") for note in notes)]


def pick_ports(op: Ports, allow_bind: tuple[str, ...]) -> list[int]:
    """The ``ports`` op: ``n`` ports free here (``want``: exactly these; ``prefer``: these where free)."""
    n, bind = op.n, op.bind
    if not 0 < n <= MAX_PORTS:
        raise BadInput(f"protocol error: ports: n = {n} is not 1-{MAX_PORTS}")
    if not may_bind(bind, allow_bind):
        raise BadInput(f"binding {bind} is not allowed on this host", "start the node with --allow-bind ADDR")
    want = op.want
    if want is not None:  # the user's ports: each must be free here
        ports = list(want)
        if len(ports) != n or any(not 0 < p < 65536 for p in ports):
            raise BadInput(f"ports: want {want!r} is not {n} ports 1-65535")
        busy = [p for p in ports if not port_free(bind, p)]
        if busy:
            raise BadInput(f"port {busy[0]} on {bind} is already in use on this host",
                           "stop what uses it there or pass other --rpc-ports")
        return ports
    ports = []
    for p in op.prefer:  # the client's guesses (its ssh links already point there), if free
        if len(ports) < n and isinstance(p, int) and 0 < p < 65536 and p not in ports and port_free(bind, p):
            ports.append(p)
    while len(ports) < n:
        try:
            p = free_port(bind)
        except OSError as exc:
            raise BadInput(f"cannot listen on {bind} here: {exc.strerror}") from None
        if p not in ports:
            ports.append(p)
    return ports


def port_free(bind: str, port: int) -> bool:
    try:
        return is_free(bind, port)
    except OSError as exc:
        raise BadInput(f"cannot listen on {bind} here: {exc.strerror}") from None


def rpc_process(spec: Mapping[str, Any], inventory: dict[str, Any] | None,
                allow_bind: tuple[str, ...]) -> tuple[ProcessSpec, list[str]]:
    """A ``start`` op's spec -> the rpc-server to run (this host's binary, its own flags, a free port) and one
    note per ``--seed-cache`` file dropped; BadInput if refused."""
    name = str(spec.get("name", ""))
    if not _NAME.match(name):
        raise BadInput(f"process name {name!r} is not a plain name")
    rpc_bin = (inventory or {}).get("llama", {}).get("rpc_bin")
    argv, bind, port = check_rpc_argv(list(spec.get("argv") or []), rpc_bin, allow_bind)
    argv, dropped = drop_missing_seeds(argv, bool(rpc_bin) and can_seed(Path(str(rpc_bin)), None))
    if not port_free(bind, port):  # else the ready probe would be answered by whoever holds it
        raise BadInput(f"port {port} on {bind} is already in use on this host")
    env = {str(k): str(v) for k, v in dict(spec.get("env") or {}).items()}
    bad = [k for k in env if k.startswith(("LD_", "DYLD_"))]
    if bad:
        raise BadInput(f"environment variable {bad[0]} is not passed to an rpc-server")
    ps = ProcessSpec(name=name, role=Role.RPC, argv=argv, env=tuple(sorted(env.items())), host=bind, port=port,
                     cards=tuple(int(c) for c in spec.get("cards") or ()),
                     devices=tuple(str(d) for d in spec.get("devices") or ()), ignore_sigpipe=True,
                     env_unset=tuple(str(v) for v in spec.get("env_unset") or ()))
    return ps, dropped


def write_state(run_dir: RunDir, procs: Iterable[tuple[ProcessSpec, int, float | None]]) -> None:
    """The run dir's state.json: each live rpc-server (spec, pid, create time), so the next agent's hello sweeps
    what this one leaves if it dies some way the parent-death signal does not cover."""
    rows = [{"name": spec.name, "pid": pid, "pgid": pid, "create_time": create_time, "since_boot": since_boot(pid),
             "port": spec.port, "argv": list(spec.argv)} for spec, pid, create_time in procs]
    try:
        run_dir.write_state({"supervisor": supervisor_identity(), "node": True, "processes": rows})
    except OSError:
        pass
