"""``arcsplit serve --layout``'s ssh sessions, started before the serving stack is imported.

A start across hosts waits for each other host's ssh login and node agent (~0.5 s), since that host's rpc-servers
start only after its agent's hello. Importing the supervisor, the planner and the CLI's flags takes ~0.2 s on a
small machine. This module imports only the ssh command lines, and spawns each session before anything imports
anyio (proc/popen.py then presents it as anyio's Process), so ``serve`` (arcsplit/_warm.py) starts each host's
session that much sooner. The launcher adopts each one (NodeLauncher.warm) and runs it like one it started
itself; :func:`end` ends one the run never takes (a usage error).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .._dirs import runtime_dir
from ..hosts import node_argv, shares_connection
from ..proc import spawn
from ..proc.spec import ProcessSpec
from ..rig import Host
from ..roles import Role

if TYPE_CHECKING:
    from anyio.abc import Process

CONTROL_NAME = re.compile(r"ssh-[0-9a-f]{8}")  # ssh binds "<path>.<16 random chars>" first, then links it here
SUN_PATH = 104  # the shortest sockaddr_un.sun_path among the systems OpenSSH runs on (BSDs, macOS)


def control_socket() -> Path | None:
    """A fresh path for a session's ControlMaster socket in arcsplit's private runtime folder (0700: only this user
    reaches it; ssh checks the peer's uid too), or None where the path would be too long for a socket. Sockets
    that no master answers any more (a run that was SIGKILLed) are removed first."""
    folder = runtime_dir()
    for old in folder.iterdir():
        if CONTROL_NAME.fullmatch(old.name):
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(old))
                except ConnectionRefusedError:
                    old.unlink(missing_ok=True)
                except OSError:
                    pass
    path = folder / f"ssh-{os.urandom(4).hex()}"  # not secrets: 10 ms of imports for one call
    return path if len(os.fsencode(path)) + 17 < SUN_PATH else None


def session_spec(host: Host, argv: Sequence[str]) -> ProcessSpec:
    """The transport of ``host``'s node session as a process to run (its stdin carries the agent's requests)."""
    return ProcessSpec(name=f"node-{host.name}", role=Role.NODE, argv=tuple(argv), env=(), host="", port=0, cards=(),
                       keep_stdin=True)


@dataclass
class Early:
    """One host's session ssh, already running: the process and its command line, its ControlMaster socket
    (None: the links log in on their own), when it started (time.monotonic), and whether a launcher took it."""

    process: Process
    argv: tuple[str, ...]
    control: Path | None
    at: float
    taken: bool = False


def start_sessions(hosts: Sequence[Host]) -> dict[str, Early]:
    """Each host's session ssh, run as NodeLauncher would run it (hosts.node_argv; a ControlMaster where its links
    share the connection). A session that cannot start is left to the launcher, which reports why. No event loop
    is needed: every ssh is spawned (spawn.popen) before anyio is imported, which happens while they log in."""
    spawned = []
    for host in hosts:
        control = control_socket() if shares_connection(host) else None
        argv = node_argv(host, str(control) if control is not None else None)
        try:
            popen = spawn.popen(session_spec(host, argv))
        except OSError:
            continue
        spawned.append((host.name, popen, tuple(argv), control, time.monotonic()))
    from ..proc.popen import PopenProcess  # start-up: anyio, once every ssh is spawned

    return {name: Early(PopenProcess(popen), argv, control, at) for name, popen, argv, control, at in spawned}


async def end(early: Early) -> None:
    """A session no launcher took: EOF to the agent, then ssh's process group; its control socket removed."""
    import anyio  # start-up: this module is imported before anyio (see above)

    with anyio.CancelScope(shield=True):
        if early.process.stdin is not None:
            await early.process.stdin.aclose()
        with anyio.move_on_after(2.0):
            await early.process.wait()
        if early.process.returncode is None:
            try:
                os.killpg(early.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await early.process.wait()
        await early.process.aclose()
        if early.control is not None:
            early.control.unlink(missing_ok=True)
