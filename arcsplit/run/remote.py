"""Members on other hosts: a NodeSession per host and generation, and the launcher that routes by ``spec.node``.

A NodeSession runs the transport (``ssh ... arcsplit node --stdio``: hosts.node_argv) as a local Child and speaks
the agent's JSON lines over it (arcsplit/node/). Each remote rpc-server is a RemoteMember living in its host's
session: its pid, output, readiness and exit come from the agent's events. The session's death (ssh exits, the
agent dies, the link goes silent) is every one of its members' exit, with the reason ("node agent on b exited:
ssh: connect to host b port 22: Connection refused"): the supervisor then restarts the group as for any exit.

Links (role "link") run here; their node names the host they reach. With ``forwards = "shared"`` (the default) the
session's ssh is a ControlMaster (hosts.node_argv with a control socket) and each link is a SharedLink: a forward
added to that connection with ``ssh -O forward``, ready in ~10 ms instead of a login of its own, and gone with the
session. With ``forwards = "own"`` (or a transport without ssh) each link is an ``ssh -N -L`` process of its own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ..decide.specs import ServeConfig
from ..errors import ArcsplitError, BadInput, HostError
from ..llama.build import build_rpc_proto
from ..llama.childenv import child_environ
from ..llama.locate import LlamaBinaries, server_build_info
from ..hosts import check_inventory, control_argv, node_argv, shares_connection
from ..proc import wire
from ..proc.child import Child, describe_exit, run_held
from ..proc.spec import ProcessSpec, runs_remote
from ..proc.states import MemberState, Tracked
from ..rig import Host
from .early import Early, control_socket, session_spec
from ..samples import GpuReport
from ..roles import Role
from .events import StateData, Usage, member_snapshot, with_remote
from .launch import Health, HostOpened, Launcher, LocalLauncher, Member

PING_EVERY = 2.0  # the agent's default --heartbeat is 10 s
SILENT_AFTER = 10.0  # no message from the agent (it sends stats every second) this long: the session is dead
HELLO_TIMEOUT = 60.0  # ssh's ConnectTimeout is 10 s; the agent's inventory runs llama-server --version


@dataclass(frozen=True)
class Transport:
    """How to reach a host's agent and how to run a link. Production: ssh for both; a test without sshd runs the
    agent as a local process (`python -m arcsplit node --stdio`) and its own forward (``shared=None``)."""

    node: Callable[[Host], Sequence[str]] = node_argv
    link: Callable[[ProcessSpec], Sequence[str]] = field(default=lambda spec: spec.argv)
    # the agent's ssh as the ControlMaster of a socket whose connection the links ride; None: links are processes
    shared: Callable[[Host, str], Sequence[str]] | None = node_argv


def ssh_fix(host: Host, why: str) -> str:
    """What to do about a session that ended before its hello, from ssh's own words."""
    if "Host key verification failed" in why or "IDENTIFICATION HAS CHANGED" in why:
        return (f"arcsplit only connects to known host keys: check {host.ssh}'s key and add it to known_hosts "
                f"(ssh-keyscan prints it), or fix the entry that changed")
    if "cannot start" in why:  # the transport itself (ssh) is missing here
        return "install the OpenSSH client (ssh) on this machine"
    if "Permission denied" in why:
        return f"install a key for {host.ssh} (ssh-copy-id): arcsplit never asks for a password (BatchMode)"
    if "not found" in why or "No such file" in why:
        return f'install arcsplit on {host.name}, or set arcsplit = "/path/to/arcsplit" in its [[hosts]] table'
    return f"check that `ssh {host.ssh} {host.arcsplit} --version` works from here without a prompt"


class NodeSession:
    """One host's agent for one generation; members register by name and get their events."""

    def __init__(self, host: Host, argv: Sequence[str], run_id: str = "", backend: str | None = None,
                 control: Path | None = None, early: Early | None = None) -> None:
        self.host = host
        self.control = control  # the socket of this ssh as ControlMaster: its links are SharedLinks
        if control is not None and early is None:  # a master of this launcher that was killed left it
            control.unlink(missing_ok=True)
        self.links: dict[str, SharedLink] = {}
        self.run_id = run_id
        self.backend = backend
        self.hello: dict[str, Any] | None = None
        self.members: dict[str, RemoteMember] = {}
        self.usage: dict[str, Usage] = {}  # each member's last reported CPU seconds, RSS and threads there
        self.gpus: GpuReport | None = None  # the host's cards as last reported (an agent with no GPU sampler: None)
        self.stopped: set[str] = set()
        self.notes: deque[str] = deque(maxlen=20)  # lines that are not messages: ssh's and the agent's stderr
        self.dead: str | None = None
        self.opened_in: float | None = None  # s from the spawn to the agent's first message: login and agent start
        self._spawned = 0.0
        self._child = Child(session_spec(host, argv), on_line=self._on_line, on_exit=self._on_exit)
        self._early = early  # started before serve's imports (run/early.py): adopted at spawn
        self._reply: anyio.Event = anyio.Event()
        self._answer: dict[str, Any] | None = None
        self._ask = anyio.Lock()
        self._write = anyio.Lock()
        self._heard = time.monotonic()
        # The transport and its keepalive outlast a cancel of the task group they run in: the agent stops its
        # rpc-servers on EOF, which must come after llama-server here has exited (the supervisor's teardown, then
        # close()); close() ends both.
        self._scope = anyio.CancelScope(shield=True)
        self._held = anyio.CancelScope()  # a shield once the transport has started (child.run_held)

    @property
    def where(self) -> str:
        return f"node agent on {self.host.name}"

    async def spawn(self, tg: TaskGroup) -> None:
        """Start the transport (ssh's login and the agent's start run on from here) and its keepalive; the agent
        answers pings and sends stats before any hello."""
        self._spawned = time.monotonic()
        if self._early is not None:
            self._child.adopt(self._early.process)
            self._early.taken, self._spawned = True, self._early.at
        await tg.start(self._transport)
        tg.start_soon(self._keepalive)
        await self.send(wire.Ping().msg())  # its pong is the agent's first word: when the login and its start are done

    async def open(self, tg: TaskGroup) -> dict[str, Any]:
        """Start the transport unless :meth:`spawn` did, say hello; the hello's inventory, or HostError with the
        reason it never came."""
        if self._child.state is MemberState.NEW:  # not warmed: start the transport now
            await self.spawn(tg)
        if self.dead:  # a warm session that ended while serve planned: its reason, not a second try
            raise HostError(self.dead, ssh_fix(self.host, self.dead))
        answer = await self.request(wire.Hello(self.run_id, self.backend).msg(), wire.Ev.HELLO, HELLO_TIMEOUT)
        self.hello = answer
        return answer

    async def ports(self, n: int, bind: str, want: Sequence[int] = (), prefer: Sequence[int] = ()) -> list[int]:
        """``n`` free ports there, or HostError when one of ``want`` (the user's) is taken; ``prefer``: ports to
        keep where free there (an agent that predates it just picks others)."""
        answer = await self.request(wire.Ports(n, bind, list(want) or None, list(prefer)).msg(), wire.Ev.PORTS, 30.0)
        return [int(p) for p in answer["ports"]]

    async def request(self, msg: Mapping[str, Any], ev: wire.Ev, timeout: float) -> dict[str, Any]:
        """One op whose answer is the next session-level ``ev`` (or an error naming no process)."""
        async with self._ask:
            # A new event per request: _on_exit sets whichever is current, so one that ended while this request
            # waited for the lock has set an older one; self.dead, read with no await since, says so.
            self._reply, self._answer = anyio.Event(), None
            if self.dead is None:
                await self.send(msg)
                with anyio.move_on_after(timeout):
                    await self._reply.wait()
            answer = self._answer
        if answer is None:
            why = self.dead or f"{self.where} ({self.host.ssh}) sent no {ev} within {timeout:.0f} s"
            raise HostError(why, ssh_fix(self.host, why))
        if answer.get("ev") == wire.Ev.ERROR:
            raise HostError(f"{self.where}: {answer.get('message')}")
        return answer

    async def send(self, msg: Mapping[str, Any]) -> bool:
        async with self._write:
            return await self._child.send(wire.encode(msg))

    async def _transport(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await run_held(self._held, self._child.run, task_status)

    async def close(self, grace: float = 10.0) -> None:
        """EOF to the agent (it stops its rpc-servers and exits), then the transport; never cancelled midway."""
        with anyio.CancelScope(shield=True):
            self._scope.cancel()
            await self._child.close_input()
            with anyio.move_on_after(grace):
                await self._child.done.wait()
            await self._child.stop(2.0)
            self._held.cancel()  # a transport whose exit was never seen: Child's own cancel path kills it
            if self.control is not None:  # ssh removes it on its way out, unless it was killed
                self.control.unlink(missing_ok=True)

    async def _keepalive(self) -> None:
        with self._scope:
            while not self._child.done.is_set():
                await anyio.sleep(PING_EVERY)
                if time.monotonic() - self._heard > SILENT_AFTER:
                    self.notes.append(f"no message for {SILENT_AFTER:.0f} s")
                    await self._child.stop(2.0)
                    return
                await self.send(wire.Ping().msg())

    def _on_line(self, _child: Child, line: str) -> None:
        self._heard = time.monotonic()
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict) or "ev" not in msg:
                raise ValueError
        except ValueError:
            if line.strip():
                self.notes.append(line.strip())
                for m in self.members.values():
                    m.line(f"[{self.host.name}] {line}")
            return
        if self.opened_in is None:
            self.opened_in = time.monotonic() - self._spawned
        ev, name = msg["ev"], msg.get("name")
        if ev == wire.Ev.STATS:
            rss, threads, at = msg.get("rss") or {}, msg.get("threads") or {}, time.time()
            self.usage = {str(k): Usage(cpu_s=float(v), rss=int(rss[k]) if k in rss else None,
                                        threads=int(threads[k]) if k in threads else None, at=at)
                          for k, v in (msg.get("cpu") or {}).items()}
            self.stopped = set(msg.get("stopped") or ())
            gpus = msg.get("gpus")
            self.gpus = GpuReport.from_dict(gpus, at) if isinstance(gpus, dict) else None
        elif ev in (wire.Ev.HELLO, wire.Ev.PORTS) or (ev == wire.Ev.ERROR and not name):
            self._answer = msg
            self._reply.set()
        elif name in self.members:
            self.members[name].event(msg)

    def _on_exit(self, child: Child) -> None:
        why = self.notes[-1].rstrip(".") if self.notes else describe_exit(child.returncode)
        self.dead = f"{self.where} exited: {why}"
        self._reply.set()  # a pending request ends with the reason
        for m in [*self.members.values(), *self.links.values()]:
            m.lost(self.dead)


class _Relayed(Tracked):
    """A member whose process is not a child of this one (launch.Member): its output, readiness and exit are
    told to it, and it logs, counts and reports them like a local child."""

    def __init__(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
                 on_exit: Callable[[Any], None], ring: deque[str]) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.create_time: float | None = None
        self.returncode: int | None = None
        self.output_count = 0
        self.paused = False
        self.lines = ring
        self.done = anyio.Event()
        self.started_at: float | None = None
        self.exited_at: float | None = None
        self._on_line, self._on_exit = on_line, on_exit
        self._log_path = log_path

    async def _hold(self, task_status: TaskStatus[None], grace: float) -> None:
        """Report started, then live until the member ends; a cancelled holder stops it (``grace`` s) first."""
        task_status.started()
        try:
            await self.done.wait()
        except BaseException:
            await self.stop(grace)
            raise

    async def stop(self, grace: float = 10.0) -> None:
        """Each kind ends its own way: a remote process through its agent, a shared forward with ``-O cancel``."""
        raise NotImplementedError

    def lost(self, reason: str) -> None:
        """The session died: the process is gone with it (the agent kills its rpc-servers when its stdin closes;
        a forward ends with its ssh)."""
        if not self.done.is_set():
            self.line(reason)
            self._finish(255)

    def line(self, text: str) -> None:
        self.output_count += 1
        self.lines.append(text)
        if self._log_path is not None:
            try:
                with open(self._log_path, "a", encoding="utf-8", errors="replace") as f:
                    f.write(text + "\n")
            except OSError:
                pass
        self._on_line(self, text)

    def _finish(self, rc: int) -> None:
        if self.done.is_set():
            return
        self.returncode, self.exited_at = rc, time.time()
        if self.state is MemberState.NEW:
            self.state = MemberState.STARTING
        self.state = MemberState.EXITED
        self.done.set()
        self._on_exit(self)

    def snapshot(self) -> StateData:
        end = self.exited_at or time.time()
        return with_remote(member_snapshot(self, (end - self.started_at) if self.started_at else None),
                           self.usage(), self.gpus())

    def usage(self) -> Usage | None:
        """What its host's agent last said of it (None: nothing yet, not running, or a link)."""
        return None

    def gpus(self) -> GpuReport | None:
        """What its host's agent last said of that host's cards (None: nothing, not running, or a link)."""
        return None


class RemoteMember(_Relayed):
    """A remote rpc-server as the supervisor sees it (launch.Member), driven by its session's events."""

    def __init__(self, session: NodeSession, spec: ProcessSpec, *, log_path: Path | None,
                 on_line: Callable[[Any, str], None], on_exit: Callable[[Any], None], ring: deque[str]) -> None:
        super().__init__(spec, log_path=log_path, on_line=on_line, on_exit=on_exit, ring=ring)
        self.session = session
        self.ready = False
        self._started = anyio.Event()

    @property
    def alive(self) -> bool:
        return self.pid is not None and not self.done.is_set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.state = MemberState.STARTING
        self.session.members[self.spec.name] = self
        s = self.spec
        self.line(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start on {self.session.host.name}: {shlex.join(s.argv)}")
        if self.session.dead:
            self.lost(self.session.dead)
        else:
            await self.session.send(wire.Start({
                "name": s.name, "argv": list(s.argv), "env": s.env_dict, "env_unset": list(s.env_unset),
                "host": s.host, "port": s.port, "cards": list(s.cards), "devices": list(s.devices)}).msg())
            await self._started.wait()
        await self._hold(task_status, 5.0)

    async def stop(self, grace: float = 10.0) -> None:
        with anyio.CancelScope(shield=True):
            if self.done.is_set() or self.state is MemberState.NEW:
                return
            if self.state is not MemberState.STOPPING:
                self.state = MemberState.STOPPING
            await self.session.send(wire.Stop(self.spec.name, grace).msg())
            with anyio.move_on_after(grace + 5.0):
                await self.done.wait()
                return
            await self.session.close(2.0)  # the agent does not answer: ending the session ends its processes
            self.lost(f"{self.session.where} did not report {self.spec.name}'s exit")

    def event(self, msg: Mapping[str, Any]) -> None:
        ev = msg.get("ev")
        if ev == wire.Ev.STARTED:
            self.pid, self.create_time, self.started_at = msg.get("pid"), msg.get("create_time"), time.time()
            self._started.set()
        elif ev == wire.Ev.LINE:
            self.line(str(msg.get("line", "")))
        elif ev == wire.Ev.READY:
            self.ready = True
        elif ev == wire.Ev.EXIT:
            self._finish(int(msg["returncode"]) if msg.get("returncode") is not None else 255)
        elif ev == wire.Ev.ERROR:
            self.line(f"{self.session.where}: {msg.get('message')}")
            if self.pid is None:
                self._finish(127)

    def _finish(self, rc: int) -> None:
        self._started.set()
        super()._finish(rc)

    def check_paused(self) -> bool:
        now = self.alive and self.spec.name in self.session.stopped
        changed, self.paused = now != self.paused, now
        return changed

    def cpu_seconds(self) -> float:
        usage = self.usage()
        return usage.cpu_s if usage else 0.0

    def usage(self) -> Usage | None:
        return self.session.usage.get(self.spec.name) if self.alive else None

    def gpus(self) -> GpuReport | None:
        return self.session.gpus if self.alive else None


class SharedLink(_Relayed):
    """A link riding its host's session (``forwards = "shared"``): ``spec.argv`` is the ``ssh -O forward`` that adds
    the forward to the session's ssh (its ControlMaster), ``cancel`` the ``-O cancel`` that removes it. It has no
    process of its own (pid None): it exits when the session's ssh does (agent, connection or ssh gone), or at once
    when the forward cannot be added (a port taken here); the supervisor then restarts the group as for any exit."""

    def __init__(self, session_of: Callable[[], NodeSession | None], spec: ProcessSpec, cancel: Sequence[str], *,
                 log_path: Path | None, on_line: Callable[[Any, str], None], on_exit: Callable[[Any], None],
                 ring: deque[str]) -> None:
        super().__init__(spec, log_path=log_path, on_line=on_line, on_exit=on_exit, ring=ring)
        self.session: NodeSession | None = None
        self._session_of = session_of  # this generation's session, once NodeLauncher.open made it
        self._cancel = tuple(cancel)
        self._added = False

    @property
    def alive(self) -> bool:
        return self._added and not self.done.is_set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.state = MemberState.STARTING
        self.line(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {shlex.join(self.spec.argv)}")
        why = await self._connected()
        if why is not None:
            self.lost(why)
        elif not self.done.is_set():
            rc, out = await self._control(self.spec.argv)
            for text in out:
                self.line(text)
            if rc != 0:
                self._finish(rc)
            elif not self.done.is_set():
                self._added, self.started_at = True, time.time()
        await self._hold(task_status, 2.0)

    async def _connected(self) -> str | None:
        """Wait until this generation's session exists and its ssh has logged in (the master's socket appears
        then); None, or why it never will."""
        deadline = time.monotonic() + HELLO_TIMEOUT
        while not self.done.is_set():
            if self.session is None and (session := self._session_of()) is not None:
                self.session = session
                session.links[self.spec.name] = self
            if self.session is not None:
                if self.session.dead:
                    return self.session.dead
                assert self.session.control is not None
                if self.session.control.exists():
                    return None
            if time.monotonic() > deadline:
                return f"no ssh connection to {self.spec.node} within {HELLO_TIMEOUT:.0f} s for the forward"
            await anyio.sleep(0.01)
        return None

    async def _control(self, argv: Sequence[str]) -> tuple[int, list[str]]:
        """One ``ssh -O ...`` client: its exit status and output lines."""
        env = child_environ(os.environ)  # ssh needs no credential of the environment's (llama/childenv.py)
        for var in self.spec.env_unset:
            env.pop(var, None)
        with anyio.move_on_after(30.0):
            r = await anyio.run_process(list(argv), check=False, stdin=subprocess.DEVNULL, env=env)
            out = (r.stdout + r.stderr).decode("utf-8", errors="replace").splitlines()
            return r.returncode, [line.strip() for line in out if line.strip()]
        return 255, [f"{argv[0]} -O did not answer within 30 s"]

    async def stop(self, grace: float = 10.0) -> None:
        """Remove the forward from the session's ssh (it keeps serving the others); the session's end removes it
        anyway."""
        with anyio.CancelScope(shield=True):
            if self.done.is_set() or self.state is MemberState.NEW:
                return
            if self.state is not MemberState.STOPPING:
                self.state = MemberState.STOPPING
            if self._added and self.session is not None and not self.session.dead:
                await self._control(self._cancel)
            self._finish(0)

    def check_paused(self) -> bool:
        return False

    def cpu_seconds(self) -> float:
        return 0.0


def same_build(server_bin: str) -> Callable[[Host, Mapping[str, Any]], None]:
    """The hello check: the host has a build, of this machine's llama.cpp commit and RPC protocol
    (hosts.check_inventory). This machine's side is read now, while the sessions open (between a hello and its
    host's rpc-servers it would delay the group); a read that fails is tried again, and raised, at the first hello."""
    here: dict[str, Any] = {}

    def read_here() -> None:
        exe = Path(server_bin)
        info = server_build_info(LlamaBinaries(server=exe, rpc_server=exe, cli=None, bench=None, fit_params=None,
                                               found_by="config"))
        here.update(commit=info.commit, rpc_proto=build_rpc_proto(exe.parent))

    try:
        read_here()
    except ArcsplitError:
        pass

    def check(host: Host, hello: Mapping[str, Any]) -> None:
        llama = hello.get("llama") or {}
        if not llama.get("rpc_bin"):
            raise BadInput(f"host {host.name} ({host.ssh}) has no llama.cpp build: {llama.get('error')}",
                           f"run `{host.arcsplit} llama build` there")
        if not here:
            read_here()
        check_inventory(here, llama, host)

    return check


class NodeLauncher:
    """Routes by ``spec.node``: this machine's processes (and the links) to ``local``, a host's to its session.

    ``check(host, hello)`` refuses a host's build (hosts.check_inventory against this machine's); a refusal is
    BadInput, an unreachable host a RunError (the supervisor retries those with backoff).
    """

    def __init__(self, hosts: Sequence[Host], *, transport: Transport = Transport(),
                 check: Callable[[Host, Mapping[str, Any]], None] | None = None,
                 local: Launcher | None = None) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.transport = transport
        self.check = check
        self.local: Launcher = local or LocalLauncher()
        self.sessions: dict[str, NodeSession] = {}
        self._warm: dict[str, NodeSession] = {}
        self._controls: dict[str, Path | None] = {}  # each host's ControlMaster socket, for this launcher's life
        self.inventories: dict[str, dict[str, Any]] = {}  # each host's last hello: its build, devices, arcsplit

    async def warm(self, tg: TaskGroup, names: Sequence[str], early: Mapping[str, Early] | None = None) -> None:
        """Start the transports to ``names`` now, before the group exists (``serve`` does while it plans: an ssh
        login and the agent's start take ~0.6 s); the first :meth:`open` greets them instead of starting its own.
        ``early``: sessions already running (run/early.py), adopted with their control sockets. ``tg`` must
        outlive the first generation; :meth:`close` ends a session never greeted."""
        for name in names:
            host = self.hosts[name]
            pre = (early or {}).get(name)
            if pre is not None:
                self._controls[name] = pre.control
                session = NodeSession(host, pre.argv, control=pre.control, early=pre)
            else:
                session = self._session(host)
            self._warm[name] = session
            await session.spawn(tg)

    async def open(self, tg: TaskGroup, run_id: str, names: Sequence[str], backend: str | None = None) -> None:
        """One session per host in ``names`` (at once), asking for ``backend``'s build there; each hello checked.
        Raises after closing what opened."""
        warm, self._warm = self._warm, {}
        await self.close()
        errors: list[ArcsplitError] = []

        async def one(name: str) -> None:
            host = self.hosts[name]
            session = warm.pop(name, None) or self._session(host)
            session.run_id, session.backend = run_id, backend
            self.sessions[name] = session
            try:
                hello = await session.open(tg)
                self.inventories[name] = {k: v for k, v in hello.items() if k not in ("ev", "pid")}
                if self.check is not None:
                    self.check(host, hello)
            except ArcsplitError as exc:
                errors.append(exc)

        try:
            async with anyio.create_task_group() as otg:
                for name in names:
                    otg.start_soon(one, name)
        finally:  # a host this generation does not use, or not yet greeted when the open was cancelled
            for session in warm.values():
                await session.close(2.0)
        if errors:
            await self.close()
            raise next((e for e in errors if isinstance(e, BadInput)), errors[0])

    def _control(self, host: Host) -> Path | None:
        """The socket of ``host``'s session ssh as ControlMaster when its links ride it (forwards = "shared"),
        the same one for every generation (each session removes a stale one first); None: links are processes."""
        if self.transport.shared is None or not shares_connection(host):
            return None
        if host.name not in self._controls:
            self._controls[host.name] = control_socket()
        return self._controls[host.name]

    def _session(self, host: Host) -> NodeSession:
        control = self._control(host)
        if control is None or self.transport.shared is None:
            return NodeSession(host, self.transport.node(host))
        return NodeSession(host, self.transport.shared(host, str(control)), control=control)

    def node_bins(self) -> tuple[tuple[str, str], ...]:
        """Each open host's rpc-server binary from its hello (ServeConfig.node_bins): the argv shows the real path."""
        return tuple(sorted((name, str(s.hello["llama"]["rpc_bin"])) for name, s in self.sessions.items()
                            if s.hello and (s.hello.get("llama") or {}).get("rpc_bin")))

    def opened(self, names: Sequence[str]) -> list[HostOpened]:
        """How long each of ``names``' sessions took to open this generation (one not opened now: left out)."""
        out = []
        for name in names:
            session = self.sessions.get(name)
            if session is not None and session.opened_in is not None:
                started = (session.hello or {}).get("started_s")
                out.append(HostOpened(name, session.host.ssh, round(session.opened_in, 3),
                                      started if isinstance(started, (int, float)) else None))
        return out

    async def ports(self, node: str, n: int, bind: str, want: Sequence[int] = (),
                    prefer: Sequence[int] = ()) -> list[int]:
        """``n`` free ports on host ``node``, as its agent sees them (``want``: these, checked free there;
        ``prefer``: these where free)."""
        return await self.sessions[node].ports(n, bind, want, prefer)

    async def close(self) -> None:
        sessions, self.sessions = [*self.sessions.values(), *self._warm.values()], {}
        self._warm = {}
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for s in sessions:
                    tg.start_soon(s.close)

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> Member:
        if runs_remote(spec):
            return RemoteMember(self.sessions[spec.node], spec, log_path=log_path, on_line=on_line,
                                on_exit=on_exit, ring=ring)
        if spec.role == Role.LINK and (control := self._control(self.hosts[spec.node])) is not None:
            host, node = self.hosts[spec.node], spec.node
            return SharedLink(lambda: self.sessions.get(node),
                              replace(spec, argv=tuple(control_argv(host, str(control), "forward", spec.argv))),
                              control_argv(host, str(control), "cancel", spec.argv), log_path=log_path,
                              on_line=on_line, on_exit=on_exit, ring=ring)
        if spec.role == Role.LINK:
            argv = tuple(self.transport.link(spec))
            if argv != spec.argv:
                spec = replace(spec, argv=argv)
        return self.local.member(spec, log_path=log_path, on_line=on_line, on_exit=on_exit, ring=ring)

    async def accepts(self, spec: ProcessSpec) -> bool:
        if runs_remote(spec):
            session = self.sessions.get(spec.node)
            member = session.members.get(spec.name) if session else None
            return bool(member and member.ready and member.alive)
        return await self.local.accepts(spec)

    @asynccontextmanager
    async def health(self, spec: ProcessSpec, timeout: float) -> AsyncIterator[Health]:
        async with self.local.health(spec, timeout) as check:
            yield check


def launcher_for(config: ServeConfig) -> Launcher:
    """The launcher a group needs: its hosts' agents (each build checked against this machine's) where it has
    cards on other hosts, else this machine's processes."""
    return NodeLauncher(config.hosts, check=same_build(config.server_bin)) if config.hosts else LocalLauncher()
