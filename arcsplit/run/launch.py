"""The launcher seam: how the supervisor starts a member of the group and asks whether it is ready.

The supervisor decides *when* (order, readiness, restarts, backoff, stall, watchdog); a Launcher decides *how*:
``LocalLauncher`` runs each ProcessSpec as a local child process (proc/child.py). run/remote.NodeLauncher (rpc-servers
on other hosts, started by their agents over SSH) implements the same protocol, and the part only other hosts need
(open, close, ports, inventories) is a no-op here (``OneHost``); the tests use an in-memory one
(tests/_fake_launcher.py) to check the supervisor's logic in seconds without llama.cpp. The supervisor is given
its launcher (run/remote.launcher_for picks one) and names none.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Protocol, Sequence

import anyio
import psutil
from anyio.abc import TaskGroup, TaskStatus

from ..errors import RunError
from ..netaddr import local_url
from ..proc.child import Child
from ..proc.ports import owns_port, probe_once
from ..proc.spec import ProcessSpec
from ..proc.states import MemberState
from .events import StateData, member_snapshot

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

    def snapshot(self) -> StateData: ...


@dataclass(frozen=True)
class HostOpened:
    """Another host's agent session, open for this generation: how long the login and the agent's start took."""

    name: str
    ssh: str
    opened_s: float
    started_s: float | None  # the agent's own start, as it measured it; None from an agent that does not say


class Launcher(Protocol):
    """Starts members and answers the two readiness questions the supervisor asks; for cards on other hosts it
    also opens and closes their agents' sessions and asks them for ports (no-ops where there is no other host)."""

    async def open(self, tg: TaskGroup, run_id: str, names: Sequence[str], backend: str | None = None) -> None:
        """One agent session per host in ``names`` for this generation, its build checked; raises if one fails."""

    async def close(self) -> None:
        """End every host session (the group's processes there end with it)."""

    def opened(self, names: Sequence[str]) -> list[HostOpened]:
        """How long each of ``names``' sessions took to open this generation."""

    def node_bins(self) -> tuple[tuple[str, str], ...]:
        """Each open host's rpc-server binary (ServeConfig.node_bins)."""

    async def ports(self, node: str, n: int, bind: str, want: Sequence[int] = (),
                    prefer: Sequence[int] = ()) -> list[int]:
        """``n`` ports free on host ``node`` (``want``: exactly these; ``prefer``: these where free)."""

    @property
    def inventories(self) -> Mapping[str, Mapping[str, Any]]:
        """What each open host said it runs (its build, devices): for the state file and a field report."""

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> Member: ...

    async def accepts(self, spec: ProcessSpec) -> bool:
        """Whether an rpc-server's endpoint takes connections now (its own process listening, or one
        connect-and-close where there is no process of its own to ask: it serves one client at a time)."""

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

    def snapshot(self) -> StateData:
        return member_snapshot(self, self.uptime())


class OneHost:
    """The other-host half of the Launcher protocol for a launcher that reaches no other host: nothing to open,
    close or ask, and a group with cards elsewhere is refused."""

    async def open(self, tg: TaskGroup, run_id: str, names: Sequence[str], backend: str | None = None) -> None:
        if names:
            raise RunError(f"cards on {', '.join(names)} need a launcher that reaches other hosts")

    async def close(self) -> None:
        pass

    def opened(self, names: Sequence[str]) -> list[HostOpened]:
        return []

    def node_bins(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def ports(self, node: str, n: int, bind: str, want: Sequence[int] = (),
                    prefer: Sequence[int] = ()) -> list[int]:
        raise RunError(f"no host {node} here")

    @property
    def inventories(self) -> Mapping[str, Mapping[str, Any]]:
        return {}


class LocalLauncher(OneHost):
    """Every member is a process on this machine, confined by its spec's environment."""

    def __init__(self) -> None:
        self._members: dict[str, LocalMember] = {}  # the latest member of each name: whose port a probe checks

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> Member:
        member = LocalMember(spec, log_path=log_path, on_line=on_line, on_exit=on_exit, ring=ring)
        self._members[spec.name] = member
        return member

    async def accepts(self, spec: ProcessSpec) -> bool:
        """This member's own process listens on its port: what a connect would find, without connecting (each
        accepted connection is two lines of an rpc-server's log, and it serves one client at a time). Its own
        process, because a port's number is in its argv, which any local user can read from /proc, so another
        user's program may bind it first; llama-server must never be started against that one. A name this
        launcher did not start (a forward on a shared ssh): one connect-and-close."""
        member = self._members.get(spec.name)
        if member is not None and member.pid is not None:
            return owns_port(member.pid, spec.port, spec.host)
        return await probe_once(spec.host, spec.port, timeout=1.0)

    @asynccontextmanager
    async def health(self, spec: ProcessSpec, timeout: float) -> AsyncIterator[Health]:
        url = f"{local_url(spec.host, spec.port)}/health"
        async with http_client(timeout) as client:
            async def check() -> int | None:
                reply = await client.get(url)
                return reply.status if reply is not None and reply.status else None

            yield check


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: its status and body; status 0: the connection was refused (nothing listens there)."""

    status: int
    text: str


class Http:
    """The supervisor's own requests to llama-server (/health, the watchdog's reads and probe): an answer, or None
    when none came (refused, reset, timed out)."""

    def __init__(self, client: Any, errors: type[Exception], refused: type[Exception]) -> None:
        self._client, self._errors, self._refused = client, errors, refused

    async def get(self, url: str) -> Reply | None:
        try:
            r = await self._client.get(url)
        except self._refused:
            return Reply(0, "")
        except self._errors:
            return None
        return Reply(r.status_code, r.text)

    async def post(self, url: str, body: Mapping[str, Any], timeout: float) -> Reply | None:
        try:
            r = await self._client.post(url, json=dict(body), timeout=timeout)
        except self._errors:
            return None
        return Reply(r.status_code, r.text)


@asynccontextmanager
async def http_client(timeout: float, headers: Mapping[str, str] | None = None) -> AsyncIterator[Http]:
    """An HTTP client for loopback requests (no proxy from the environment), open for the block."""
    import httpx  # start-up: `arcsplit --help` and `plan` import this module (through the API)

    async with httpx.AsyncClient(timeout=timeout, trust_env=False, headers=dict(headers or {})) as client:
        yield Http(client, httpx.HTTPError, httpx.ConnectError)
