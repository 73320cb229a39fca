"""The serving group: rpc-servers then llama-server, watched as one unit and restarted as one unit.

    async with Supervisor(config, launcher=launcher_for(config)) as sup:  # once the group first answers 200
        print(sup.status()["url"])

Readiness by role (reference/supervisors.md §8): an rpc-server is ready when it is alive and one
connect-and-close succeeds (never probed again: it serves one client at a time); llama-server when /health
turns 200, with a *stall* timeout that any log line, load-progress report or CPU use by the group resets.
/health stays 200 when an rpc-server dies, so the processes themselves are watched (their exit is awaited,
not polled). When any member exits the group is stopped in order (llama-server first) and restarted with
exponential backoff; a failure count that time ready wears down (RestartPolicy.half_life) gives up past a cap, with
the log lines that explain why.

Members are started through the Launcher it is given (run/launch.py: local processes, run/remote.py: other hosts'
agents, the tests' in-memory fake; it names none), from specs that are complete (decide/specs.py); states change
only along the tables in proc/states.py.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ..decide.choice import RouteChoice
from ..decide.routes import RouteList, entry as route_entry
from ..decide.specs import LOOPBACK, ProcessSpec, ServeConfig, build_specs, card_of_buffer, n_links
from ..errors import ArcsplitError, BadInput, RunError
from ..llama import logs
from ..llama.hostcheck import SHM_FIX, host_ram_short
from ..llama.mode import ModeDecision
from ..proc.child import run_held
from ..proc.ports import free_port, is_free
from ..proc.rundir import RunDir, since_boot, supervisor_identity, sweep
from ..proc.spec import runs_remote
from ..proc.stuck import gone, inspect
from ..proc.states import GROUP_TRANSITIONS, Cause, GroupState, MemberState, advance
from ..roles import Role
from . import faults
from .canary import Canary, CheckResult, Verdict
from .events import (BuffersData, CanaryData, CardLoad, Event, EventBus, FailureData, GroupBackoff, GroupData,
                     GroupReady, GroupStarting,
                     HostData, LogData, MemberStatus, Payload, PlanData, ProgressData, RouteData, StateData, Status,
                     VerdictData)
from .fallback import Leave, RouteMove, RouteTracker
from .launch import Launcher, Member
from .watchdog import HangPolicy, Watchdog

# llama-server's load progress in the router's child protocol (specs.ROUTER_PORT_ENV opts in), one per 200 ms.
_ROUTER_STATE = "cmd_child_to_router:state:"


@dataclass(frozen=True)
class RestartPolicy:
    base_delay: float = 1.0
    max_delay: float = 30.0
    max_failures: int = 5  # the failure count may reach this; one more failure and the supervisor gives up
    half_life: float = 30.0  # each 30 s ready halves the failure count (docs/multihost.md: "Faults in a row")

    def count(self, failures: float, ready_s: float) -> float:
        """The failure count after one more failure that came ``ready_s`` seconds after the group was ready (0: it
        never was): what was counted decays by half every ``half_life`` s ready, then this failure adds 1. Failed
        starts in a row count 1, 2, 3, ... as before; faults an hour apart count ~1 each, where a 60 s cliff made
        a 4th fault inside a minute wait 8 s and a 6th give up."""
        return failures * 0.5 ** (max(ready_s, 0.0) / self.half_life) + 1.0

    def delay(self, failures: float) -> float:
        """The backoff before the next start: ``base_delay`` doubled per failure counted past the first, capped."""
        return round(min(self.max_delay, self.base_delay * 2 ** max(failures - 1.0, 0.0)), 3)


@dataclass(frozen=True)
class Timeouts:
    rpc_ready: float = 60.0  # an rpc-server must accept a connection within this
    stall: float = 120.0  # llama-server load: no progress of any kind for this long
    stop_grace: float = 10.0  # SIGTERM -> SIGKILL when the user stops or restarts
    failed_grace: float = 2.0  # the same when a member died: a group missing a member has nothing to finish
    health_interval: float = 3.0  # once ready, /health is asked this often (one cheap GET)
    health_failures: int = 3  # this many misses in a row: the group is restarted even if no process exited
    hang: HangPolicy = HangPolicy()  # the progress watchdog (run/watchdog.py): compute stopped, processes alive


class _StartFailed(Exception):
    """Why a generation failed: ``who`` (a member's name, "group" or a host), the one-line ``message``, the log
    signature ``kind`` (logs.failure_kind) and the ``cause`` it is counted under; ``lines``: the log lines that show
    it, ``card``: the plan card it was on (run/faults.py)."""

    def __init__(self, who: str, message: str, kind: str | None = None, error: ArcsplitError | None = None,
                 cause: Cause = Cause.EXIT, lines: Sequence[str] = (), card: str | None = None) -> None:
        super().__init__(message)
        self.who, self.message, self.kind, self.error, self.cause = who, message, kind, error, cause
        self.lines, self.card = tuple(lines), card

    @classmethod
    def of(cls, f: "faults.Failure", who: str) -> "_StartFailed":
        return cls(who, f.message, f.kind, cause=f.cause, lines=f.lines, card=f.card)


OnMove = Callable[[RouteMove], None]


class Supervisor:
    """Runs one serving group until stop(); publishes Events; status() is a plain dict snapshot."""

    def __init__(self, config: ServeConfig, *, run_dir: RunDir | None = None, policy: RestartPolicy = RestartPolicy(),
                 timeouts: Timeouts = Timeouts(), routes: RouteList | None = None, on_move: OnMove | None = None,
                 canary: Canary | None = None, log_lines: int = 2000,
                 sweep_leftovers: bool = True, decision: dict[str, Any] | None = None,
                 choice: RouteChoice | None = None, launcher: Launcher) -> None:
        self.config = config
        self.launcher = launcher
        self.decision = decision or {"mode": config.mode, "reasons": []}  # why this mode, for status()
        self.choice = choice or RouteChoice.untuned(config.mode, config.forced_mode)  # tuned or not, for status()
        self.policy = policy
        self.timeouts = timeouts
        self.events = EventBus()
        self.run_dir = run_dir
        # the routes decided before the start (decide/routes.py), this config first; run/fallback.py walks them
        self._routes = RouteTracker(routes or RouteList.one(route_entry(
            config, ModeDecision(config.mode, reasons=tuple(self.decision.get("reasons") or ())), self.choice,
            "the route given"), config.forced_mode))
        self._on_move = on_move
        self._canary = canary
        self._canary_scope: anyio.CancelScope | None = None
        self._sweep = sweep_leftovers
        self._rings: dict[str, deque[str]] = {}
        self._ring_size = log_lines
        self._children: dict[str, Member] = {}
        self._specs: tuple[ProcessSpec, ...] = ()
        self._rpc_ports: list[int] | None = list(config.rpc_ports) if config.rpc_ports else None
        self._links: list[int] = []  # this machine's ends of the ssh links, kept across restarts
        self._restarts: dict[str, int] = {}
        self._causes: dict[Cause, int] = {}  # failures by cause this run (events, metrics, arcsplit ps)
        self._card_faults: dict[str, dict[str, int]] = {}  # failures by plan card and cause this run (faults.count)
        self._fresh: dict[str, int] = {}  # lines each member printed in this generation (the ring keeps older ones)
        self._group_state = GroupState.NEW
        self._generation = 0
        self._failures = 0.0  # RestartPolicy.count: decays with time ready
        self._streak = 0  # failures since the count was last near zero, for the give-up message
        self._ready_at: float | None = None
        self._started_at = time.time()
        self._stop_requested = False
        self._restart_requested = False
        self._tearing_down = False
        self._wake = anyio.Event()
        self._ready_event = anyio.Event()
        self._progress: dict[str, Any] = {}
        self._buffers: list[logs.BufferLine] = []
        self._load_mmap = True  # llama-server's load mode: the order its buffers fill in (logs.load_progress)
        self._links_on_tcp: list[str] = []  # why same-host links stay on TCP this generation (patch 0008's warning)
        self._last_error: str | None = None
        self._last_lines: tuple[str, ...] = ()  # the log lines that show it (faults.Failure.lines)
        self._trouble: _StartFailed | None = None  # what a watcher found wrong with a running group (_fail_now)
        self._held: set[anyio.CancelScope] = set()  # the members' runs, which only _teardown ends (_hold)
        self._watchdog = Watchdog(timeouts.hang)
        self._last_failure: dict[str, Any] | None = None  # the last FailureData, with its time (status, ps)

    # -- public surface -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.config.url

    def subscribe(self, max_buffer: int = 1000) -> Any:
        """A bounded receive stream of Events; a subscriber that falls behind loses events, never blocks us."""
        return self.events.subscribe(max_buffer)

    def stop(self) -> None:
        """Ask the group to stop (llama-server first). Safe from signal handlers and other tasks."""
        self._stop_requested = True
        self._wake.set()

    async def restart(self) -> None:
        """Stop the group in order and start it again now (no backoff; the failure count is kept)."""
        self._restart_requested = True
        self._wake.set()

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def logs(self, name: str | None = None, n: int = 100, verbose: bool = True) -> list[str]:
        """The last ``n`` captured lines of one process (or of all, prefixed with the process name). ``verbose``
        False: without what logs.QuietFilter hides (llama-server's -lv 4 trace lines, the rpc-servers' connects)."""
        return logs.pick_lines(self._rings, name, n, verbose)

    def status(self) -> Status:
        procs: dict[str, MemberStatus] = {}
        for spec in self._specs:
            child = self._children.get(spec.name)
            snap = child.snapshot() if child else StateData(
                state=MemberState.NEW, pid=None, port=spec.port, endpoint=spec.endpoint, returncode=None, uptime=None,
                argv=tuple(spec.argv), paused=False, host=spec.node)
            procs[spec.name] = {**snap.to_dict(), "restarts": self._restarts.get(spec.name, 0), "role": spec.role}
        return {
            "state": self._group_state,
            "mode": self.config.mode,
            "backend": self.config.backend,
            "url": self.url,
            "generation": self._generation,
            "failures": round(self._failures),  # a count people read; the decay stays in _failures
            "uptime": (time.time() - self._ready_at) if self._ready_at and self._group_state is GroupState.READY else None,
            "processes": procs,
            "progress": dict(self._progress),
            "buffers": self.buffers().to_dict(),
            "last_error": self._last_error,
            "notes": self.notes(),
            "run_dir": str(self.run_dir.path) if self.run_dir else None,
            "plan": self.config.plan.to_dict(),
            "route": self.config.route.to_dict(),
            "decision": self.decision,
            "choice": self.choice.to_dict(),
            "events_dropped": self.events.dropped,
            "causes": {str(c): n for c, n in self._causes.items()},
            "last_error_lines": list(self._last_lines),
            "card_faults": {card: dict(per) for card, per in self._card_faults.items()},
            "resets": faults.resets(self.config, self._card_faults),
            "routes": self._routes.to_dict(),
            "canary": self._canary.to_dict() if self._canary is not None else {"on": False},
            "last_failure": self._last_failure,
            "watchdog": self._watchdog.to_dict(),
        }

    def notes(self) -> list[str]:
        """What serves but slower than it should, each with its fix: a link left on TCP by a full /dev/shm."""
        return [f"llama-server's links to the rpc-servers of this host run over loopback TCP, not shared memory "
                f"({why}), which is slower; {SHM_FIX}" for why in self._links_on_tcp]

    def buffers(self) -> BuffersData:
        """Actual bytes per plan card from llama-server's buffer lines, beside the plan's prediction."""
        plan = self.config.plan
        actual = logs.sum_buffers(self._buffers)
        card_of = card_of_buffer(self._specs, self.config.route.host_position)
        cards: list[dict[str, Any]] = []
        for i, cp in enumerate(plan.cards):
            cards.append({"device": cp.device, "plan": {"model": cp.weights, "KV": cp.kv + cp.state,
                                                        "compute": cp.compute}, "actual": {}})
        host: dict[str, int] = {}
        for key, kinds in actual.items():
            pos = card_of(key)
            target = cards[pos]["actual"] if pos is not None else host
            for kind, n in kinds.items():
                kind = "KV" if kind in ("KV", "RS") else kind
                target[kind] = target.get(kind, 0) + n
        return BuffersData(cards=tuple(cards), host=host, plan_host=plan.host_bytes)

    # -- context manager ------------------------------------------------------------------------------------

    async def __aenter__(self) -> "Supervisor":
        """Start the group; return once it first answers /health 200, or raise why it never did."""
        self._cm_error: BaseException | None = None
        settled = anyio.Event()

        async def runner() -> None:
            try:
                await self.run()
            except ArcsplitError as exc:
                self._cm_error = exc
            finally:
                settled.set()

        async def on_ready() -> None:
            await self._ready_event.wait()
            settled.set()

        self._cm_tg = anyio.create_task_group()
        await self._cm_tg.__aenter__()
        self._cm_tg.start_soon(runner)
        self._cm_tg.start_soon(on_ready)
        await settled.wait()
        if not self._ready_event.is_set():
            self._cm_tg.cancel_scope.cancel()
            await self._cm_tg.__aexit__(None, None, None)
            raise self._cm_error or RunError("the group stopped before it was ready")
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self.stop()
        result = await self._cm_tg.__aexit__(*exc)
        if self._cm_error is not None and exc[0] is None:
            raise self._cm_error
        return result

    # -- the loop -------------------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start, watch, restart until stop(). task_status.started() at the first ready; RunError on giving up."""
        self._pending_status: TaskStatus[Any] | None = task_status
        if self._sweep:
            sweep()
        if self.run_dir is None:
            self.run_dir = RunDir.create()
        self._publish("group", PlanData(plan=self.config.plan.to_dict(), mode=self.config.mode, choice=self.choice))
        try:
            while not self._stop_requested:
                reason = await self._one_generation()
                if self._stop_requested:
                    break
                if reason == "restart":
                    continue
                self._count_failure()
                failure = reason if isinstance(reason, _StartFailed) else None
                if failure is not None:
                    self._record_failure(failure)
                if failure is not None and self._leave_route(failure):
                    continue
                if failure and failure.kind == "fatal":
                    raise failure.error or RunError(failure.message, f"logs: {self.run_dir.path}")
                if failure and failure.kind == "bad_args" and not self._ready_event.is_set():
                    # The same arguments fail the same way on every start: final, said once.
                    said = logs.bad_args_line(self._rings.get(failure.who, ())) or failure.message
                    who = "llama-server" if failure.who == "server" else failure.who
                    raise BadInput(f"{who} refused its arguments: {said}",
                                   "check the arguments after --; `llama-server --help` lists what this build accepts")
                if self._failures > self.policy.max_failures + 1e-9:
                    if failure is not None and self._leave_route(failure, Leave.RESTARTS):
                        continue
                    raise RunError(f"gave up after {self._gave_up_after()}: {self._last_error}"
                                   + (f"; {self._routes.exhausted(self._last_error or '')}" if self._routes.moves else ""),
                                   f"logs: {self.run_dir.path}")
                delay = self.policy.delay(self._failures)
                self._set_group(GroupBackoff(delay=delay, failures=round(self._failures, 2), error=self._last_error))
                self._wake = anyio.Event()
                with anyio.move_on_after(delay):
                    await self._wake.wait()  # stop() or restart() cut the wait short
        finally:
            with anyio.CancelScope(shield=True):
                await self._teardown()
                self._set_group(GroupData(GroupState.STOPPED))
                self._write_state(ended=True)
                self.events.close()

    def _record_failure(self, failure: _StartFailed) -> None:
        """Count ``failure`` by its cause and say so on the bus (who, where, why)."""
        n = self._causes[failure.cause] = self._causes.get(failure.cause, 0) + 1
        spec = next((s for s in self._specs if s.name == failure.who), None)
        host = spec.node if spec is not None and runs_remote(spec) else None
        card = failure.card or _card_label(self.config, spec)
        faults.count(self._card_faults, card, host, failure.cause)
        data = FailureData(cause=failure.cause, who=failure.who, message=failure.message, host=host, card=card, count=n,
                           lines=failure.lines)
        self._last_failure = {**data.to_dict(), "time": time.time()}
        self._publish("group", data)

    def _leave_route(self, failure: _StartFailed, reason: Leave | None = None) -> bool:
        """Whether ``failure`` moves the group to the next route of its list (run/fallback.py), and the move: one
        line (on_move), a ``route`` event, the new config. A mismatch with no route left ends the run."""
        why = reason or self._routes.why_leave(failure.cause, failure.kind, self._ready_at is not None, time.time())
        if why is None or (self._routes.next is None and why is not Leave.WRONG):
            return False  # the last route keeps restarting under the cap, as a group with one route always did
        move = self._routes.move(why, failure.message, time.time())
        if self._on_move is not None:
            self._on_move(move)
        to = move.to
        self._publish("group", RouteData(left=move.left.label, reason=why, message=failure.message,
                                         to=to.label if to else None, mode=to.config.mode if to else None))
        if to is None:
            raise RunError(f"stopped: {self._routes.exhausted(failure.message)}",
                           f"logs: {self.run_dir.path if self.run_dir else '-'}")
        if why is Leave.MULTI_DEVICE:  # the event subscribers of older versions know
            self._publish("group", VerdictData(failed_mode=self.config.mode, failure=failure.kind or "",
                                               message=failure.message, fallback=to.config.mode))
        self.config, self.choice = to.config, to.choice
        self.decision = {"mode": to.config.mode, "reasons": [f"left {move.left.label}: {move.line()}",
                                                             *to.decision.reasons]}
        self._rpc_ports = list(to.config.rpc_ports) if to.config.rpc_ports else None
        self._failures, self._streak = 0.0, 0
        self._publish("group", PlanData(plan=self.config.plan.to_dict(), mode=self.config.mode, choice=self.choice))
        self._write_state()
        return True

    def _count_failure(self) -> None:
        """One more failure, counted after the decay of the time this generation was ready."""
        ready = time.time() - self._ready_at if self._ready_at else 0.0
        previous = self._failures
        self._failures = self.policy.count(previous, ready)
        self._streak = 1 if self._failures - 1.0 < 0.05 else self._streak + 1

    def _gave_up_after(self) -> str:
        if abs(self._failures - self._streak) < 1e-6:  # never ready in between: the plain count
            return f"{self._streak} failures in a row"
        return (f"{self._streak} failures with too little time ready between them (counted {self._failures:.1f}, "
                f"over {self.policy.max_failures}; each {self.policy.half_life:.0f} s ready halves the count)")

    async def _one_generation(self) -> "str | _StartFailed":
        """Start the group, wait for an exit or a request, tear down. Returns why it ended."""
        self._generation += 1
        self._wake = anyio.Event()
        self._restart_requested = False
        self._buffers = []
        self._load_mmap = True
        self._links_on_tcp = []
        self._progress = {}
        self._ready_at = None
        self._trouble = None
        reason: str | _StartFailed = "exit"
        watchdog: anyio.CancelScope | None = None
        progress = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            try:
                await self._start_group(tg)
                self._ready_at = time.time()
                buffers = self.buffers()
                self._set_group(GroupReady(url=self.url, buffers=buffers.to_dict(), notes=tuple(self.notes())))
                self._publish("group", buffers)
                if not self._ready_event.is_set():
                    self._ready_event.set()
                    self._task_started()
                watchdog = anyio.CancelScope()
                tg.start_soon(self._watch_health, watchdog)
                self._routes.ready()
                self._start_canary(tg)
                tg.start_soon(self._watch_progress, progress)
                while True:
                    await self._wake.wait()
                    if self._stop_requested:
                        reason = "stop"
                        break
                    if self._restart_requested:
                        reason = "restart"
                        break
                    dead = [c for c in self._children.values() if c.done.is_set()]
                    if dead:
                        reason = self._exited(dead, "")
                        self._last_error, self._last_lines = reason.message, reason.lines
                        break
                    if self._trouble is not None:
                        self._last_error, self._last_lines = self._trouble.message, self._trouble.lines
                        reason = self._trouble
                        break
                    self._wake = anyio.Event()
            except _StartFailed as exc:
                self._last_error, self._last_lines = exc.message, exc.lines
                reason = exc
            finally:
                if watchdog is not None:
                    watchdog.cancel()  # else the task group would wait out its remaining probes
                self._stop_canary()
                progress.cancel()
                with anyio.CancelScope(shield=True):
                    await self._teardown()
        return reason

    async def _watch_health(self, scope: anyio.CancelScope) -> None:
        """A llama-server that stops answering without exiting (SIGTERM'd and waiting on its stdin, wedged)
        is a failure too: the processes alone cannot tell."""
        t = self.timeouts
        server = next(s for s in self._specs if s.role == Role.SERVER)
        with scope:
            async with self.launcher.health(server, max(2.0, t.health_interval)) as check:
                await self._probe_health(check, t)

    async def _probe_health(self, check: Any, t: Timeouts) -> None:
        misses = 0
        while True:
            await anyio.sleep(t.health_interval)
            code = await check()
            ok = code == 200
            why = "no answer" if code is None else f"answers {code}"
            misses = 0 if ok else misses + 1
            for child in list(self._children.values()):
                if child.check_paused():
                    self._publish_state(child)
                    self._publish(child.spec.name, LogData((
                        f"arcsplit: {child.spec.name} (pid {child.pid}) is stopped (SIGSTOP or a debugger): "
                        "requests wait until it gets SIGCONT") if child.paused else
                        f"arcsplit: {child.spec.name} (pid {child.pid}) resumed"))
            if misses >= t.health_failures:
                self._fail_now(_StartFailed("server", f"llama-server stopped answering /health ({why}, {misses} times "
                                            f"in {misses * t.health_interval:.0f} s) while its process is alive",
                                            cause=Cause.UNHEALTHY))
                return

    def _start_canary(self, tg: TaskGroup) -> None:
        """The output canary of this generation (run/canary.py), from now until the generation ends."""
        if self._canary is None:
            return
        self._canary_scope = anyio.CancelScope()
        tg.start_soon(self._watch_output, self._canary, self._canary_scope)

    def _stop_canary(self) -> None:
        if self._canary_scope is not None:
            self._canary_scope.cancel()
            self._canary_scope = None

    async def _watch_output(self, canary: Canary, scope: anyio.CancelScope) -> None:
        """A group that answers but computes something else than its reference has failed: Cause.WRONG, with the
        canary's evidence in the run's state (state.json, arcsplit report)."""
        with scope:
            try:
                wrong = await canary.watch(self.url, self._canary_tried)
            except Exception as exc:  # a check that cannot run says so; it never takes the group down
                self._publish("group", LogData(f"arcsplit: the output canary stopped for this start: "
                                               f"{type(exc).__name__}: {exc}"))
                return
            self._fail_now(_StartFailed("server", f"the output canary: {wrong.reason}", cause=Cause.WRONG))

    def _canary_tried(self, result: CheckResult) -> None:
        self._publish("group", CanaryData(verdict=result.verdict, seconds=round(result.seconds, 3),
                                          prompts=result.prompts, reason=result.reason, evidence=result.evidence))
        if result.verdict in (Verdict.WRONG, Verdict.REFERENCE):
            self._write_state()

    async def _watch_progress(self, scope: anyio.CancelScope) -> None:
        """A group whose compute stopped while every process lives and /health answers (a card hung in its driver)
        fails with cause ``hang``, naming the member that stopped (run/watchdog.py)."""
        server = next(s for s in self._specs if s.role == Role.SERVER)
        with scope:
            hang = await self._watchdog.watch(server, self._children, self._label,
                                              lambda line: self._publish("server", LogData(f"arcsplit: {line}")),
                                              json.dumps(self.config.route.to_dict(), sort_keys=True))
            self._publish(hang.who if hang.who in self._children else "group",
                          LogData(f"arcsplit: {hang.message}; restarting"))
            self._fail_now(_StartFailed(hang.who, hang.message, cause=Cause.HANG))

    def _label(self, spec: ProcessSpec) -> str:
        """Where a member runs, for a line that names it: "card CPU1, host b"."""
        card = _card_label(self.config, spec)
        parts = [f"card {card}" if card else "", f"host {spec.node}" if runs_remote(spec) else ""]
        return ", ".join(p for p in parts if p)

    def _left_behind(self) -> None:
        """Members of this machine still alive after SIGKILL: stuck in the kernel (a driver call that does not
        return, a frozen cgroup v1), they keep their memory, and their port until they exit. Said in one line each,
        with what to do; the group starts again meanwhile (an rpc-server on another port; llama-server's own port
        stays taken, so its starts fail until then)."""
        for c in self._children.values():
            if not c.alive or c.pid is None or runs_remote(c.spec) or c.spec.role == Role.LINK:
                continue
            if gone(c.pid):  # exited a moment ago; its exit is not observed yet (the pumps drain below)
                continue
            seen = inspect(c.pid)
            shown = "llama-server" if c.spec.role == Role.SERVER else c.spec.name
            port = (f"; llama-server cannot start again on port {c.spec.port} until it exits"
                    if c.spec.role == Role.SERVER else f", and its port {c.spec.port}")
            self._publish(c.spec.name, LogData(
                f"arcsplit: {shown} (pid {c.pid}) did not exit after SIGKILL: "
                f"{seen.summary() if seen else 'its state cannot be read'}; it is stuck in the kernel and keeps its "
                f"memory{port}: thaw its cgroup if one is frozen, else reset the card's driver (on xe: "
                f"docs/watchdog.md) or reboot"))

    def _fail_now(self, failure: _StartFailed) -> None:
        """A watcher of the running group (health, progress, output) found it failed: the generation ends with
        ``failure`` (the first one found wins), the group is torn down and restarted as after an exit."""
        if self._trouble is None:
            self._trouble = failure
        self._wake.set()

    def _task_started(self) -> None:
        ts = getattr(self, "_pending_status", None)
        if ts is not None:
            self._pending_status = None
            ts.started(self.url)

    # -- starting -------------------------------------------------------------------------------------------

    def _guess_ports(self) -> list[int]:
        """A port for each remote rpc-server before its host's agent answers (0 for this machine's), so that the ssh
        links can log in while the agent sessions open: the last run's, else a random one below the ephemeral
        range. The agent keeps a guess that is free there (``prefer``); a link whose guess was taken restarts."""
        procs = self.config.route.rpc
        if self.config.rpc_ports:
            return list(self.config.rpc_ports)
        previous = self._rpc_ports if self._rpc_ports and len(self._rpc_ports) == len(procs) else None
        picks = random.sample(range(20000, 32768), len(procs))
        return [(previous[i] if previous else picks[i]) if proc.host else 0 for i, proc in enumerate(procs)]

    def _link_ports(self) -> list[int]:
        """This machine's ends of the ssh links: kept across restarts while free, so a restart's guesses hold;
        never llama-server's port, not bound yet when these are picked."""
        taken = {self.config.port}
        previous = self._links if len(self._links) == n_links(self.config) else []
        out: list[int] = []
        for i in range(n_links(self.config)):
            p = previous[i] if previous and previous[i] not in taken and is_free(LOOPBACK, previous[i]) else 0
            while p == 0 or p in taken:
                p = free_port(LOOPBACK)
            out.append(p)
            taken.add(p)
        self._links = out
        return out

    def _local_ports(self) -> list[int]:
        """This machine's rpc-server ports in --rpc order (0 for a remote one), kept across restarts while free."""
        config = self.config
        procs = config.route.rpc
        fixed = config.rpc_ports
        previous = self._rpc_ports if self._rpc_ports and len(self._rpc_ports) == len(procs) else None
        ports = [0] * len(procs)
        taken: set[int] = {*self._links, config.port}  # and llama-server's, not bound yet when these are picked

        def fresh() -> int:
            while (p := free_port(LOOPBACK if config.rpc_host in ("", "0.0.0.0") else config.rpc_host)) in taken:
                pass
            return p

        for i, proc in enumerate(procs):
            if proc.host:
                continue
            if fixed:
                if not is_free(config.rpc_host, fixed[i]):
                    raise _StartFailed("rpc", f"rpc port {fixed[i]} is in use", "fatal")
                ports[i] = fixed[i]
            elif previous and previous[i] not in taken and is_free(config.rpc_host, previous[i]):
                ports[i] = previous[i]
            else:
                ports[i] = fresh()
            taken.add(ports[i])
        return ports

    async def _remote_ports(self, local: Sequence[int], prefer: Sequence[int] = ()) -> list[int]:
        """``local`` with each remote rpc-server's port filled in: free on its host, as its agent says (``prefer``:
        the guesses its link was started with)."""
        config = self.config
        procs = config.route.rpc
        fixed = config.rpc_ports
        ports = list(local)
        for host in _hosts(config):
            where = [i for i, proc in enumerate(procs) if proc.host == host]
            h = config.host_named(host)
            bind = h.address if h.link == "direct" and h.address else LOOPBACK
            try:
                got = await self.launcher.ports(host, len(where), bind, [fixed[i] for i in where] if fixed else (),
                                                [prefer[i] for i in where] if prefer and not fixed else ())
            except ArcsplitError as exc:  # a port the user named is taken there: retrying changes nothing
                raise _StartFailed(host, str(exc), "fatal" if fixed else None, exc if fixed else None) from None
            for i, p in zip(where, got):
                ports[i] = p
        self._rpc_ports = ports
        return ports

    async def _open_hosts(self, tg: TaskGroup) -> None:
        """One agent session per host this generation (hello + inventory check) before any port is picked."""
        hosts = _hosts(self.config)
        if not hosts:
            return
        assert self.run_dir is not None
        try:
            await self.launcher.open(tg, self.run_dir.path.name, hosts, self.config.backend)
        except ArcsplitError as exc:
            # Another build there: retrying changes nothing. Unreachable at the first start: most likely the layout
            # or ssh setup (the error says which), so the user hears it now; once the group has run, it is retried.
            fatal = isinstance(exc, BadInput) or not self._ready_event.is_set()
            raise _StartFailed("group", str(exc), "fatal" if fatal else None, exc if fatal else None) from None
        for o in self.launcher.opened(hosts):
            self._publish(o.name, HostData(ssh=o.ssh, opened_s=o.opened_s, generation=self._generation,
                                           started_s=o.started_s))
        bins = self.launcher.node_bins()
        if bins != self.config.node_bins:
            self.config = replace(self.config, node_bins=bins)

    def _build(self, ports: Sequence[int], link_ports: Sequence[int]) -> tuple[ProcessSpec, ...]:
        try:
            return build_specs(self.config, ports, link_ports)
        except ArcsplitError as exc:
            raise _StartFailed("group", str(exc), "fatal") from None

    async def _start_group(self, tg: TaskGroup) -> None:
        self._set_group(GroupStarting(generation=self._generation))
        self._children = {}
        failures: list[_StartFailed] = []

        async def start_rpc(spec: ProcessSpec) -> None:
            try:
                await self._start_rpc(tg, spec)
            except _StartFailed as exc:
                failures.append(exc)

        # While the agent sessions open (a login and the agent's start there), what needs no answer from them starts:
        # this machine's rpc-servers, and the ssh links (a forward needs its rpc-server only when llama-server dials
        # through it, so it can start on a guessed remote port). Then the rpc-servers there, and any link whose guess
        # was taken; then llama-server.
        guess = self._guess_ports()
        link_ports = self._link_ports()
        local = self._local_ports()
        early = [s for s in self._build([p or g for p, g in zip(local, guess)], link_ports)
                 if s.role == Role.LINK or (s.role == Role.RPC and not s.node)]
        async with anyio.create_task_group() as otg:
            for spec in early:
                otg.start_soon(start_rpc, spec)
            try:
                await self._open_hosts(tg)
            except _StartFailed as exc:  # raised after the group: a task group would wrap it
                failures.insert(0, exc)
                otg.cancel_scope.cancel()
        if failures:
            raise failures[0]
        ports = await self._remote_ports(local, guess)
        specs = self._build(ports, link_ports)
        server_spec = specs[-1]
        self._specs = specs
        if self._generation > 1:  # the whole group restarts together
            for spec in specs:
                self._restarts[spec.name] = self._restarts.get(spec.name, 0) + 1
        started = {s.name: s for s in early}
        for spec in specs:  # a guess that was taken there: that link points nowhere
            old = self._children.get(spec.name)
            if old is not None and spec.name in started and started[spec.name].argv != spec.argv:
                await old.stop(2.0)

        async with anyio.create_task_group() as rtg:
            for spec in specs:
                if spec.role in (Role.RPC, Role.LINK) and (spec.name not in started or started[spec.name].argv != spec.argv):
                    rtg.start_soon(start_rpc, spec)
        self._write_state()
        if failures:
            raise failures[0]
        await self._start_server(tg, server_spec)
        self._write_state()

    def _child(self, spec: ProcessSpec) -> Member:
        ring = self._rings.setdefault(spec.name, deque(maxlen=self._ring_size))
        self._fresh[spec.name] = 0
        assert self.run_dir is not None
        child = self.launcher.member(spec, log_path=self.run_dir.log_path(spec.name), on_line=self._on_line,
                                     on_exit=self._on_exit, ring=ring)
        self._children[spec.name] = child
        return child

    async def _hold(self, member: Member, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """A member's run, out of reach of a cancel of the task that runs the group (an error in the caller's
        ``async with`` block, a caller's timeout): a cancelled member stops itself at once, so rpc-servers went
        while llama-server was still freeing its buffers over RPC, and it aborted. _teardown stops the group in
        order whatever ended it, and then cancels a run that is still going."""
        scope = anyio.CancelScope()
        self._held.add(scope)
        try:
            await run_held(scope, member.run, task_status)
        finally:
            self._held.discard(scope)

    async def _start_rpc(self, tg: TaskGroup, spec: ProcessSpec) -> None:
        child = self._child(spec)
        await tg.start(self._hold, child)
        self._publish_state(child)
        with anyio.move_on_after(self.timeouts.rpc_ready) as scope:
            while True:
                if child.done.is_set():
                    raise self._exited([child], " while starting")
                if await self.launcher.accepts(spec):  # a remote one: its agent's connect-and-close there
                    if child.done.is_set():
                        continue  # someone else answered on that port: report the exit
                    break
                await anyio.sleep(0.02)  # only during start; a refused connect costs microseconds
        if scope.cancelled_caught:
            shown, quote = faults.evidence(self._own_lines(child))
            raise _StartFailed(spec.name, f"{spec.name} did not accept connections on {_where(spec)} "
                                          f"within {self.timeouts.rpc_ready:.0f} s" + quote, lines=shown)
        child.state = MemberState.READY
        self._publish_state(child)

    async def _start_server(self, tg: TaskGroup, spec: ProcessSpec) -> None:
        child = self._child(spec)
        await tg.start(self._hold, child)
        self._publish_state(child)
        stall = self.timeouts.stall
        deadline = time.monotonic() + stall
        marker: tuple[Any, ...] = ()
        last_cpu_check = 0.0
        cpu_total = 0.0
        async with self.launcher.health(spec, 2.0) as check:
            while True:
                dead = [c for c in self._children.values() if c.done.is_set()]
                if dead:
                    raise self._exited(dead, " while llama-server was loading")
                code = await check()
                if code == 200:
                    break
                now = time.monotonic()
                new_marker = (code, child.output_count, self._progress.get("value"))
                if new_marker != marker:
                    marker, deadline = new_marker, now + stall
                if now - last_cpu_check >= 1.0:  # big loads over RPC print nothing for minutes: CPU use is progress
                    last_cpu_check = now
                    short = host_ram_short(self.config.backend)
                    if short:  # retrying would swap again: give up with the reason
                        raise _StartFailed("server", short, "fatal")
                    total = sum(c.cpu_seconds() for c in self._children.values())
                    if total - cpu_total > 0.05:
                        deadline = now + stall
                    cpu_total = total
                if now > deadline:
                    shown, quote = faults.evidence(self._own_lines(child))
                    raise _StartFailed("server", f"llama-server made no progress for {stall:.0f} s while loading"
                                       + quote, lines=shown)
                await anyio.sleep(0.05)
        child.state = MemberState.READY
        self._progress.update(value=1.0, cards=[c.to_dict() for c in self._card_loads(1.0)])
        self._publish_state(child)

    # -- output and exits -----------------------------------------------------------------------------------

    def _on_line(self, child: Member, line: str) -> None:
        self._fresh[child.spec.name] = self._fresh.get(child.spec.name, 0) + 1
        self._publish(child.spec.name, LogData(line))
        if child.spec.role != Role.SERVER:
            return
        if line.startswith(_ROUTER_STATE):
            try:
                state = json.loads(line[len(_ROUTER_STATE):])
            except ValueError:
                return
            payload = state.get("payload") or {}
            if state.get("state") == "loading" and "value" in payload:
                value = float(payload["value"])
                progress = ProgressData(stage=payload.get("current"), value=value, cards=self._card_loads(value))
                self._progress = progress.to_dict()
                self._publish(child.spec.name, progress)
            return
        if (why := logs.link_on_tcp(line)) is not None and why not in self._links_on_tcp:
            self._links_on_tcp.append(why)
        b = logs.parse_buffer_line(line)
        if b is not None:
            self._buffers.append(b)
        elif (mode := logs.parse_load_mode(line)) is not None:
            self._load_mmap = logs.load_mode_mmaps(mode)

    def _card_loads(self, value: float) -> tuple[CardLoad, ...]:
        """Model bytes loaded per plan card at load fraction ``value`` (events.CardLoad), host memory last."""
        card_of = card_of_buffer(self._specs, self.config.route.host_position)
        per: dict[int | None, tuple[int, int]] = {}
        for key, (done, total) in logs.load_progress(self._buffers, value, self._load_mmap).items():
            pos = card_of(key)
            d, t = per.get(pos, (0, 0))
            per[pos] = (d + done, t + total)
        order = sorted(per, key=lambda pos: (pos is None, pos or 0))
        return tuple(CardLoad(card=pos, done=per[pos][0], total=per[pos][1]) for pos in order)

    def _own_lines(self, child: Member) -> list[str]:
        """The lines ``child`` printed in this generation: its ring holds the earlier generations' too, and a fault
        of the last one must not name this one's."""
        n = self._fresh.get(child.spec.name, 0)
        return list(child.lines)[-n:] if n else []

    def _exited(self, dead: Sequence[Member], phase: str) -> _StartFailed:
        """The failure of the members that exited: the one whose log names a card fault, else the first."""
        own = {c.spec.name: self._own_lines(c) for c in dead}
        c = next((c for c in dead if logs.fault_kind(own[c.spec.name])), dead[0])
        if phase and c.spec.role == Role.SERVER:
            phase = " while loading"
        return _StartFailed.of(faults.judge(self.config, c.spec, own[c.spec.name], c.returncode, phase), c.spec.name)

    def _on_exit(self, child: Member) -> None:
        self._publish_state(child)
        if not self._tearing_down:
            self._wake.set()

    async def _teardown(self) -> None:
        """llama-server first (it aborts if an rpc peer vanishes under it), then all rpc-servers and links at once,
        then the agent sessions of other hosts."""
        self._tearing_down = True
        try:
            if any(c.alive for c in self._children.values()) and self._group_state is not GroupState.STOPPING:
                self._set_group(GroupData(GroupState.STOPPING))
            # A llama-server whose rpc peer died sits in a blocking RPC call and ignores SIGTERM: waiting the full
            # grace then only delays the restart (measured: 10 of 13.6 s to serve again).
            failed = any(c.done.is_set() for c in self._children.values()) or self._trouble is not None
            grace = self.timeouts.failed_grace if failed and not self._stop_requested else self.timeouts.stop_grace
            server = self._children.get("server")
            if server is not None:
                await server.stop(grace)
            async with anyio.create_task_group() as tg:
                for c in self._children.values():
                    if c.spec.role != Role.SERVER:
                        tg.start_soon(c.stop, grace)
            self._left_behind()
            await self.launcher.close()
            # Pumps drain to EOF after the exit; bound it in case a grandchild holds the pipe.
            with anyio.move_on_after(5):
                for c in self._children.values():
                    if c.pid is not None:
                        await c.done.wait()
            for scope in list(self._held):  # a member whose exit was never seen: its own cancel path kills it
                scope.cancel()
            self._write_state()
        finally:
            self._tearing_down = False

    # -- events and state file ------------------------------------------------------------------------------

    def _publish(self, name: str, data: Payload) -> None:
        self.events.publish(Event.of(name, data))

    def _publish_state(self, child: Member) -> None:
        self._publish(child.spec.name, child.snapshot())
        if self.run_dir is not None:
            self._write_state()

    def _set_group(self, data: GroupData) -> None:
        """Every group state change reaches the state file too (`ps`, `report` read it, not the events)."""
        self._group_state = advance(GROUP_TRANSITIONS, self._group_state, data.state)
        self._publish("group", data)
        self._write_state()

    def _write_state(self, ended: bool = False) -> None:
        if self.run_dir is None:
            return
        procs = []
        for c in self._children.values():
            if c.pid is not None and c.alive and not ended and not runs_remote(c.spec):  # a host's agent sweeps its own
                procs.append({"name": c.spec.name, "pid": c.pid, "pgid": c.pid, "create_time": c.create_time,
                              "since_boot": since_boot(c.pid), "port": c.spec.port, "argv": list(c.spec.argv)})
        state = {"supervisor": supervisor_identity(), "started": self._started_at, "url": self.url,
                 "mode": self.config.mode, "group": self._group_state, "processes": procs,
                 # for `arcsplit report`: what this run was asked to do, and its last error
                 "backend": self.config.backend, "decision": self.decision, "choice": self.choice.to_dict(),
                 "plan": self.config.plan.to_dict(),
                 "last_error": self._last_error, "last_error_lines": list(self._last_lines),
                 # what `arcsplit doctor` and `report` name after the run: faults per card, cards to reset
                 "card_faults": self._card_faults, "resets": faults.resets(self.config, self._card_faults),
                 # the routes and why each was left; the output canary, a mismatch's evidence included
                 "routes": self._routes.to_dict(),
                 "canary": self._canary.to_dict() if self._canary is not None else {"on": False}}
        if self.launcher.inventories:
            # what each other host said it runs (build, devices): a field report needs both sides
            state["hosts"] = {name: {"ssh": self.config.host_named(name).ssh, **inv}
                              for name, inv in self.launcher.inventories.items()}
        if ended:
            state["ended"] = time.time()
        try:
            self.run_dir.write_state(state)
        except OSError:
            pass


def _hosts(config: ServeConfig) -> tuple[str, ...]:
    """The other hosts the group has rpc-servers on, in --rpc order."""
    return tuple(dict.fromkeys(p.host for p in config.route.rpc if p.host))


def _card_label(config: ServeConfig, spec: ProcessSpec | None) -> str | None:
    """The plan card(s) a member holds, by their own names ("CPU0", "SYCL1"; not llama-server's "RPC1"), or None."""
    if spec is None:
        return None
    names = [c.card.device for i, c in enumerate(config.plan.cards) if i in spec.cards]
    return ",".join(names) or None


def _where(spec: ProcessSpec) -> str:
    return f"{spec.endpoint} on {spec.node}" if runs_remote(spec) else spec.endpoint


