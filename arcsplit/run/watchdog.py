"""The progress watchdog: a group whose compute stopped is a failure, even with every process alive and /health 200.

A card hung in its driver leaves every process running: llama-server's HTTP threads still answer /health, and a
request just waits. What stops is the work: llama-server's task loop answers ``/slots`` even while a decode runs
(llama/work.py), and its counters there move only as it computes. So the watchdog reads ``/slots`` (a few ms, on
loopback) every ``busy_every`` s while requests are in flight and every ``idle_every`` s otherwise:

- **busy, counters still** (or ``/slots`` unanswered: the task loop itself is stuck) for longer than the *bound*:
  a hang. The bound is ``--hang-after`` (the floor), or ``factor`` times the longest pause between two marks of
  progress this route has shown, if longer: a route whose prompt batches take 40 s each gets 120 s.
- **but at work**: while the members' main threads use CPU (``work_rate`` of a core; the main thread computes in
  llama-server and in rpc-server, where other threads may busy-wait at a barrier and fake it), a stall is given up
  to ``cap`` s: one ubatch of a big model on a CPU card blocks the counters for minutes. Members on other hosts
  count with their agents' reports of their whole process's CPU.
- **stopped on purpose**: a member stopped with SIGSTOP (^Z, a debugger) is left alone, as before the watchdog:
  the supervisor says so and requests wait until SIGCONT. A frozen cgroup is not that (it is what a hung driver
  call looks like from outside, and what the tests use), nor is state D.
- **idle**: nothing moves the counters, so a hung rpc-server would go unseen until a user's request hangs. After
  ``probe_every`` s without a computed token the watchdog sends one request of one token (``n_predict`` 1, a
  prompt of one word, only when every slot is idle), which crosses every member; the busy rule above then times it.

``ProgressCore`` is that decision, fed observations (``Look``): no processes, no clock of its own, tested alone
(tests/test_watchdog.py). ``Watchdog.watch`` is the thin async part the supervisor runs beside its /health watch: it
reads, feeds, probes, and on a hang names the member that stopped (``name_stalled``, from proc/stuck.py's reading of
each local member) and returns it; the supervisor ends the generation (cause ``hang``) and restarts as after an exit.
Defaults and the figures behind them: docs/watchdog.md.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Callable, Mapping, Sequence

import anyio
from anyio.abc import TaskGroup

from ..durations import format_s
from ..llama.childenv import SERVER_KEY_VAR
from ..llama.work import Work, from_metrics, from_slots
from ..netaddr import local_url
from ..proc.spec import ProcessSpec, runs_remote
from ..proc.stuck import Stuck, inspect, main_cpu
from ..roles import Role
from .launch import Http, http_client

DEFAULT_HANG_AFTER = 20.0  # s: the floor of the bound (docs/watchdog.md: why)
PROBE_PROMPT = "1"  # a one-token prompt (after the BOS): the cheapest request that still crosses every card


@dataclass(frozen=True)
class HangPolicy:
    """How the watchdog decides (every field in seconds but ``factor`` and ``work_rate``); ``after`` 0: off."""

    after: float = DEFAULT_HANG_AFTER  # no progress this long while work is due: a hang (the bound's floor)
    factor: float = 3.0  # the bound is at least this times the longest pause between progress this route showed
    cap: float = 600.0  # members at work (their main threads' CPU) hold the verdict off at most this long
    probe_every: float = 25.0  # idle, with no token computed for this long: a one-token request (0: never)
    busy_every: float = 2.0  # /slots is read this often while work is due
    idle_every: float = 5.0  # ... and this often while every slot is idle
    read_timeout: float = 5.0  # one read of /slots; no answer counts as no progress
    work_rate: float = 0.1  # main-thread CPU, in cores, that counts as work
    work_window: float = 10.0  # over the last this many seconds

    @property
    def on(self) -> bool:
        return self.after > 0


class Verdict(StrEnum):
    OK = "ok"
    PROBE = "probe"  # send the idle probe now
    HANG = "hang"


@dataclass(frozen=True)
class Look:
    """One observation: when (monotonic s), what the task loop answered (None: it did not), and the members' work
    counter (CPU seconds of their main threads, summed; None: unknown)."""

    at: float
    work: Work | None
    cpu: float | None = None


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    stalled: float = 0.0  # seconds without progress while work was due
    bound: float = 0.0
    working: bool = False  # the members' CPU held a verdict off


class ProgressCore:
    """The watchdog's decision, one ``observe`` per look. ``longest`` (the longest pause between two marks of
    progress seen while work was due) carries over from an earlier generation of the same route."""

    def __init__(self, policy: HangPolicy, start: float, longest: float = 0.0) -> None:
        self.policy = policy
        self.longest = longest
        self._done: tuple[float, ...] | None = None
        self._since: float | None = None  # work due without progress since
        self._verified = start  # when the route last proved it computes
        self._probe_at: float | None = None  # a probe in flight since, until the loop shows it took it
        self._probe_in_slot = False  # the loop took the probe: what is busy now is (also) the idle check
        self._cpu: deque[tuple[float, float]] = deque()

    @property
    def bound(self) -> float:
        p = self.policy
        return min(max(p.after, p.factor * self.longest), max(p.cap, p.after))

    @property
    def cap(self) -> float:
        return max(self.policy.cap, self.bound)

    @property
    def due(self) -> bool:
        """Whether work is due now (a request, the probe, or a task loop that did not answer)."""
        return self._since is not None or self._probe_at is not None

    def observe(self, look: Look) -> Decision:
        if look.cpu is not None:
            self._cpu.append((look.at, look.cpu))
            while len(self._cpu) > 2 and self._cpu[1][0] <= look.at - self.policy.work_window:
                self._cpu.popleft()
        work = look.work
        changed = work is not None and self._done is not None and work.done != self._done
        if work is not None:
            self._done = work.done
        if changed:
            assert work is not None
            if self._since is not None:
                self.longest = max(self.longest, look.at - self._since)
            self._probe_in_slot = self._probe_at is not None or self._probe_in_slot
            self._verified, self._probe_at = look.at, None
            self._since = look.at if work.busy else None
            self._probe_in_slot = self._probe_in_slot and work.busy > 0
            return Decision(Verdict.OK, bound=self.bound)
        if work is not None and not work.busy and self._probe_at is None:
            self._since, self._probe_in_slot = None, False
            p = self.policy
            if p.probe_every > 0 and look.at - self._verified >= p.probe_every:
                return Decision(Verdict.PROBE, bound=self.bound)
            return Decision(Verdict.OK, bound=self.bound)
        if self._since is None:
            self._since = self._probe_at if self._probe_at is not None else look.at
        stalled = look.at - self._since
        working = self._working(look.at)
        hang = stalled >= self.bound and (not working or stalled >= self.cap)
        return Decision(Verdict.HANG if hang else Verdict.OK, stalled, self.bound, working)

    def _working(self, now: float) -> bool:
        """Whether the members' main threads used ``work_rate`` of a core over the last ``work_window`` s."""
        if len(self._cpu) < 2:
            return False
        window = min(self.policy.work_window, self.bound)
        t1, c1 = self._cpu[-1]
        t0, c0 = next(((t, c) for t, c in reversed(self._cpu) if t <= t1 - window), self._cpu[0])
        return t1 - t0 >= 0.5 and (c1 - c0) / (t1 - t0) >= self.policy.work_rate

    def probe_sent(self, at: float) -> None:
        self._probe_at = at

    @property
    def probing(self) -> bool:
        """Whether the idle check is what is due (sent, or in a slot)."""
        return self._probe_at is not None or self._probe_in_slot

    def probe_answered(self, at: float) -> None:
        """The probe came back (its token, or an error answer): the next is due ``probe_every`` s from now."""
        self._verified, self._probe_at, self._probe_in_slot = at, None, False

    def next_look(self) -> float:
        return self.policy.busy_every if self.due else self.policy.idle_every


# -- naming the member that stopped ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One member at the moment of the verdict: its name, where it runs (``label``: "card CPU1, host b"), the
    address llama-server dials it at (an rpc-server's ``dial``), /proc's reading (None: on another host or gone),
    whether it is stopped (SIGSTOP), and its CPU seconds over the stall (None: unknown)."""

    name: str
    role: Role
    label: str
    dial: str = ""
    stuck: Stuck | None = None
    paused: bool = False
    cpu: float | None = None


@dataclass(frozen=True)
class Hang:
    """The verdict: the member named (``who``, "group" when it cannot be told) and the one line that says so."""

    who: str
    message: str


def name_stalled(seen: Sequence[Seen], stalled: float, what: str) -> Hang:
    """Which member stopped, from what each one shows: the rpc-server llama-server waits on (one of its threads
    blocked reading from, or writing to, that rpc-server's connection), with that member's own state; else one that
    is stopped (SIGSTOP) or frozen by a cgroup freezer; else one with threads in state D. ``what``: what was due
    ("on the requests in flight", "on the idle check"). When none of these tells, the line says what is known."""
    head = f"no progress for {stalled:.0f} s {what}, with every process alive"
    server = next((s for s in seen if s.role == Role.SERVER), None)
    peers = {f"{a}:{p}" for a, p in server.stuck.waits_on} if server and server.stuck else set()
    awaited = [s for s in seen if s.dial and s.dial in peers]
    marked = [s for s in seen if _own(s)]
    if awaited:
        pick = next((s for s in awaited if _own(s)), awaited[0])
        io = server.stuck.io if server and server.stuck else None
        why = [f"llama-server waits on its answer ({io or 'a read'} on {pick.dial})"]
        why += [x for x in [_own(pick)] if x]
        if _own(pick) is None and pick.stuck is None and pick.cpu is not None:
            why.append(f"its host reports {pick.cpu:.1f} s CPU in that time")
        others = [s.name for s in awaited if s is not pick]
        if others:
            why.append(f"it waits on {', '.join(others)} too")
        return _line(pick, head, why)
    if marked:
        pick = next((s for s in marked if s.paused or (s.stuck and (s.stuck.frozen or s.stuck.state == "T"))),
                    marked[0])
        return _line(pick, head, [x for x in [_own(pick)] if x])
    known = "; ".join(_known(s) for s in seen)
    return Hang("group", f"the group stopped computing: {head}, and which member stopped cannot be told ({known})")


def _own(s: Seen) -> str | None:
    """What a member shows by itself: stopped, frozen, or threads in state D (None: none of these)."""
    if s.paused:
        return "stopped (SIGSTOP or a debugger)"
    if s.stuck is not None and (s.stuck.frozen or s.stuck.blocked or s.stuck.state == "T"):
        return s.stuck.summary()
    return None


def _line(s: Seen, head: str, why: list[str]) -> Hang:
    where = f" ({s.label})" if s.label else ""
    shown = "llama-server" if s.role == Role.SERVER else s.name
    return Hang(s.name, f"{shown}{where} stopped computing: {head}" + (f" ({'; '.join(why)})" if why else ""))


def _known(s: Seen) -> str:
    parts = [s.name]
    if s.stuck is not None:
        parts.append(f"main thread {s.stuck.state}")
    if s.cpu is not None:
        parts.append(f"{s.cpu:.1f} s CPU")
    return " ".join(parts)


# -- the async part ----------------------------------------------------------------------------------------------


def server_key(spec: ProcessSpec, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key llama-server asks of clients (its first), for the watchdog's own reads and probe: from its
    spec's environment (``--api-key`` is moved there), the inherited one, or an ``--api-key-file`` in its argv."""
    value = spec.env_dict.get(SERVER_KEY_VAR) or environ.get(SERVER_KEY_VAR)
    if value:
        return value.split(",")[0].strip() or None
    for flag, path in zip(spec.argv, spec.argv[1:]):
        if flag == "--api-key-file":
            try:
                with open(path, encoding="utf-8") as f:
                    return next((line.strip() for line in f if line.strip()), None)
            except OSError:
                return None
    return None


def sleeps_when_idle(argv: Sequence[str]) -> bool:
    """Whether llama-server unloads its model when idle (``--sleep-idle-seconds`` >= 0): reading /slots or a probe
    would wake it (server-context.cpp ``wait_until_no_sleep``); /metrics does not, and no probe is sent."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "--sleep-idle-seconds":
            try:
                return int(value) >= 0
            except ValueError:
                return False
    return False


def work_cpu(members: Mapping[str, Any]) -> float | None:
    """The members' work counter: each local process's main-thread CPU seconds, a remote one's (its agent's report)
    or a link's whole CPU; None when nothing could be read."""
    total, known = 0.0, False
    for m in list(members.values()):
        if not m.alive:
            continue
        local = not runs_remote(m.spec) and m.spec.role != Role.LINK and m.pid
        value = main_cpu(m.pid) if local else m.cpu_seconds()
        if value is not None:
            total, known = total + value, True
    return total if known else None


class _Reader:
    """Reads the task loop's Work from /slots, or /metrics where /slots is off (``--no-slots``) or would wake a
    sleeping server; says once why it cannot read at all."""

    def __init__(self, client: Http, base: str, metrics: bool) -> None:
        self.client, self.base = client, base
        self.path = "/metrics" if metrics else "/slots"
        self.refused: str | None = None
        self.listening = True  # False: the last read found nothing listening (the /health watch's business)

    async def work(self) -> Work | None:
        r = await self.client.get(self.base + self.path)
        self.listening = r is None or r.status != 0
        if r is None or not self.listening:
            return None
        if r.status in (404, 501) and self.path == "/slots":
            self.path = "/metrics"
            return await self.work()
        if r.status in (401, 403):
            self.refused = f"llama-server refused {self.path} (HTTP {r.status}): its API key is not one arcsplit knows"
            return None
        if r.status != 200:
            return None
        try:
            return from_slots(json.loads(r.text)) if self.path == "/slots" else from_metrics(r.text)
        except ValueError:
            return None


class Watchdog:
    """One per supervisor: the policy and what the route has shown (``longest``), kept across its generations."""

    def __init__(self, policy: HangPolicy) -> None:
        self.policy = policy
        self.longest = 0.0
        self.bound = policy.after  # the bound now: --hang-after, or longer where the route showed longer pauses
        self._route = ""
        self.probes = 0  # sent this run (docs, bench)
        self._refused = False  # an idle check was answered with an error (said once)

    async def watch(self, server: ProcessSpec, members: Mapping[str, Any], label: Callable[[ProcessSpec], str],
                    say: Callable[[str], None], route: str = "") -> Hang:
        """Watch one generation until its compute stops, then return who stopped; runs until cancelled otherwise.
        ``members``: the generation's members by name (read live), ``label``: where one runs ("card CPU1, host
        b"), ``say``: a line for the log, ``route``: what the route is (a new one forgets the pauses learned)."""
        if route != self._route:
            self.longest, self.bound, self._route = 0.0, self.policy.after, route
        asleep = sleeps_when_idle(server.argv)
        policy = self.policy if not asleep else _no_probe(self.policy)
        if not policy.on:
            await anyio.sleep_forever()
        key = server_key(server)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        hang: Hang | None = None
        async with http_client(policy.read_timeout, headers) as client, anyio.create_task_group() as tg:
            reader = _Reader(client, local_url(server.host, server.port), metrics=asleep)
            hang = await self._loop(ProgressCore(policy, time.monotonic(), self.longest), reader, tg, members,
                                    label, say)
            tg.cancel_scope.cancel()  # a probe still in flight
        assert hang is not None
        return hang

    async def _loop(self, core: ProgressCore, reader: _Reader, tg: TaskGroup, members: Mapping[str, Any],
                    label: Callable[[ProcessSpec], str], say: Callable[[str], None]) -> Hang:
        cpu0: dict[str, float | None] = {}  # each member's CPU when work became due
        requests = False  # the task loop's last answer held requests
        while True:
            work = await reader.work()
            requests = work.busy > 0 if work is not None else requests
            if reader.refused:
                say(f"progress watchdog off: {reader.refused}")
                await anyio.sleep_forever()
            if not reader.listening:  # llama-server gone: its exit, or the /health watch, ends the generation
                await anyio.sleep(core.next_look())
                continue
            d = core.observe(Look(time.monotonic(), work, work_cpu(members)))
            self.longest, self.bound = core.longest, core.bound
            if not core.due:
                cpu0 = {}
            elif not cpu0:
                cpu0 = {n: _cpu_of(m) for n, m in list(members.items())}
            if d.verdict is Verdict.HANG and any(m.paused for m in list(members.values())):
                pass  # stopped by the user or a debugger (SIGSTOP): said already, left alone until SIGCONT
            elif d.verdict is Verdict.HANG:
                what = "on the idle check, a one-token request" if core.probing else \
                    "on the requests in flight" if requests else "while idle"
                if work is None:
                    what += f" (llama-server's task loop does not answer {reader.path})"
                return name_stalled(_seen(members, label, cpu0), d.stalled, what)
            if d.verdict is Verdict.PROBE:
                core.probe_sent(time.monotonic())
                tg.start_soon(self._probe, reader, core, say)
            await anyio.sleep(core.next_look())

    async def _probe(self, reader: _Reader, core: ProgressCore, say: Callable[[str], None]) -> None:
        """The idle check: one token through every member. Its answer, or an error answer, ends it; a probe that
        does not come back is the busy rule's to time. An error answer is said once (a server that refuses
        completions is watched only while busy)."""
        self.probes += 1
        body = {"prompt": PROBE_PROMPT, "n_predict": 1, "temperature": 0, "cache_prompt": True}
        r = await reader.client.post(f"{reader.base}/completion", body, timeout=core.cap + self.policy.read_timeout)
        if r is None:
            return
        core.probe_answered(time.monotonic())
        if r.status != 200 and not self._refused:
            self._refused = True
            say(f"progress watchdog: llama-server answers its idle check with HTTP {r.status} "
                f"({r.text[:120]!r}); a hang while idle shows at the next request")

    def to_dict(self) -> dict[str, Any]:
        """What status() says of it: the bound now and why, and how many idle checks it sent."""
        return {"hang_after": self.policy.after, "bound": round(self.bound, 1),
                "longest_pause": round(self.longest, 1), "idle_checks": self.probes}


def _no_probe(policy: HangPolicy) -> HangPolicy:
    return replace(policy, probe_every=0.0)


def _cpu_of(member: Any) -> float | None:
    if not member.alive:
        return None
    local = not runs_remote(member.spec) and member.spec.role != Role.LINK and member.pid
    return main_cpu(member.pid) if local else member.cpu_seconds()


def _seen(members: Mapping[str, Any], label: Callable[[ProcessSpec], str], cpu0: Mapping[str, float | None]
          ) -> list[Seen]:
    """Each member as it is now, for name_stalled: /proc's reading of local ones, the CPU used since work was due."""
    out = []
    for name, m in list(members.items()):
        spec: ProcessSpec = m.spec
        if spec.role == Role.LINK:
            continue
        local = not runs_remote(spec) and m.alive and m.pid
        now, then = _cpu_of(m), cpu0.get(name)
        out.append(Seen(name=name, role=spec.role, label=label(spec), dial=spec.dial if spec.role == Role.RPC else "",
                        stuck=inspect(m.pid) if local else None, paused=bool(m.paused),
                        cpu=(now - then) if now is not None and then is not None else None))
    return out


def describe_policy(policy: HangPolicy) -> str:
    """The watchdog's settings in one phrase, for a log line and docs: "hang after 20 s (or 3x the longest pause
    seen), idle check every 25 s"."""
    if not policy.on:
        return "progress watchdog off"
    probe = f", idle check every {format_s(policy.probe_every)}" if policy.probe_every > 0 else ", no idle check"
    return (f"hang after {format_s(policy.after)} without progress (or {policy.factor:g}x the longest pause this "
            f"route showed; up to {format_s(policy.cap)} while the members compute){probe}")
