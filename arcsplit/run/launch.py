"""The launcher seam: how the supervisor starts a member of the group and asks whether it is ready.

The supervisor decides *when* (order, readiness, restarts, backoff, stall, watchdog); a Launcher decides *how*:
``LocalLauncher`` runs each ProcessSpec as a local child process (proc/child.py). A remote launcher (rpc-servers
on another host, started by an agent over SSH) implements the same three things; the tests use an in-memory one
(tests/_fake_launcher.py) to check the supervisor's logic in seconds without llama.cpp.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import anyio
import psutil
from anyio.abc import TaskStatus

from ..proc.child import Child
from ..proc.ports import probe_once
from ..proc.spec import ProcessSpec
from ..proc.states import MemberState
from .events import MemberSnapshot, member_snapshot

Health = Callable[[], Awaitable["int | None"]]


class Member(Protocol):
    """One started member of the group, wherever it runs. Its exit is awaited (``done``), never polled."""

    spec: ProcessSpec
    pid: int | None
    create_time: float | None
    returncode: int | None
    output_count: int  # lines or chunks seen: progress for the stall timeout
    paused: bool
    lines: deque[str]
    done: anyio.Event

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start; report started; return once the member has exited and its output is drained."""

    async def stop(self, grace: float = 10.0) -> None:
        """Ask it to exit, force it after ``grace``; return once the exit is observed. Never cancelled midway."""

    @property
    def state(self) -> MemberState: ...

    @state.setter
    def state(self, new: MemberState) -> None:
        """Checked against states.MEMBER_TRANSITIONS."""

    @property
    def alive(self) -> bool: ...

    def check_paused(self) -> bool:
        """Re-read whether it is stopped (SIGSTOP, a debugger); True when that changed."""

    def cpu_seconds(self) -> float:
        """CPU time used so far (0 when unknown): a load that prints nothing still shows progress here."""

    def snapshot(self) -> MemberSnapshot: ...


class Launcher(Protocol):
    """Starts members and answers the two readiness questions the supervisor asks."""

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> Member: ...

    async def accepts(self, spec: ProcessSpec) -> bool:
        """One connect-and-close to an rpc-server's endpoint (it serves one client at a time: never more)."""

    def health(self, spec: ProcessSpec, timeout: float) -> Any:
        """An async context manager yielding ``check() -> HTTP status of llama-server's /health, or None``."""


class LocalMember(Child):
    """A local child process (Child) with the CPU reading the stall timeout needs."""

    def cpu_seconds(self) -> float:
        if not (self.alive and self.pid):
            return 0.0
        try:
            t = psutil.Process(self.pid).cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return 0.0

    def snapshot(self) -> MemberSnapshot:
        return member_snapshot(self, self.uptime())


class LocalLauncher:
    """Every member is a process on this machine, confined by its spec's environment."""

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> Member:
        return LocalMember(spec, log_path=log_path, on_line=on_line, on_exit=on_exit, ring=ring)

    async def accepts(self, spec: ProcessSpec) -> bool:
        return await probe_once(spec.host, spec.port, timeout=1.0)

    @asynccontextmanager
    async def health(self, spec: ProcessSpec, timeout: float) -> AsyncIterator[Health]:
        import httpx  # here, not at the top: serve's warm start imports this module before it opens ssh (~0.2 s)

        url = f"http://{connect_host(spec.host)}:{spec.port}/health"
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            async def check() -> int | None:
                try:
                    return (await client.get(url)).status_code
                except httpx.HTTPError:
                    return None

            yield check


def connect_host(host: str) -> str:
    """Where to connect for a server bound to ``host`` (a wildcard bind answers on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
