"""An in-memory Launcher: members that start, print, get ready, die and stop on the test's script, no processes.

It stands in for what cannot be timed reliably with real llama.cpp in a fast test (a crash at an exact moment, a
load that never progresses, a /health that stops answering); tests/test_serve.py and test_faults.py run the same
supervisor against real processes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
from anyio.abc import TaskStatus

from arcsplit.run.events import StateData, member_snapshot
from arcsplit.run.launch import OneHost
from arcsplit.decide.specs import ProcessSpec
from arcsplit.proc.states import MemberState, Tracked

_pids = itertools.count(40_000)


@dataclass
class Script:
    """How one member behaves in every generation unless changed between them."""

    start_rc: int | None = None  # exit with this code right after starting (a crash while loading)
    ready: bool = True  # the rpc-server accepts / llama-server answers /health 200
    ready_after: float = 0.0  # seconds after start
    lines_every: float | None = None  # print a line this often (progress for the stall timeout)
    ignores_term: bool = False  # only the kill after the grace period ends it
    exit_after: float = 0.0  # seconds from SIGTERM to the exit (llama-server frees its buffers on the way out)
    start_after: float = 0.0  # seconds before it reports started (the spawn)


class FakeMember(Tracked):  # the same transition table as a real member: an illegal change raises
    def __init__(self, launcher: "FakeLauncher", spec: ProcessSpec, on_line: Callable[[Any, str], None],
                 on_exit: Callable[[Any], None], ring: deque[str]) -> None:
        self.launcher, self.spec = launcher, spec
        self.script = launcher.scripts.setdefault(spec.name, Script())
        self.pid: int | None = None
        self.create_time: float | None = None
        self.returncode: int | None = None
        self.output_count = 0
        self.paused = False
        self.lines = ring
        self.done = anyio.Event()
        self.started_at: float | None = None
        self._on_line, self._on_exit = on_line, on_exit
        self._exit = anyio.Event()
        self._rc = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.state = MemberState.STARTING
        self.launcher.started.append(self.spec.name)
        await anyio.sleep(self.script.start_after)
        self.pid, self.started_at = next(_pids), time.monotonic()
        self.create_time = time.time()
        task_status.started()
        if self.script.start_rc is not None:
            self.line("error: failed to load model")
            self.exit(self.script.start_rc)
        try:
            async with anyio.create_task_group() as tg:
                if self.script.lines_every:
                    tg.start_soon(self._chatter, self.script.lines_every)
                await self._exit.wait()
                tg.cancel_scope.cancel()
        except BaseException:  # cancelled from outside: like Child.run, the member stops itself at once
            with anyio.CancelScope(shield=True):
                await self._terminate()
                self._finish()
            raise
        self._finish()

    def _finish(self) -> None:
        self.returncode, self.state = self._rc, MemberState.EXITED
        self.launcher.log.append(("exit", self.spec.name))
        self.done.set()
        self._on_exit(self)

    async def _chatter(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            self.line("load_tensors: loading ...")

    def line(self, text: str) -> None:
        self.output_count += 1
        self.lines.append(text)
        self._on_line(self, text)

    def exit(self, rc: int) -> None:
        self._rc = rc
        self._exit.set()

    async def stop(self, grace: float = 10.0) -> None:
        with anyio.CancelScope(shield=True):
            if not self.alive:
                return
            await self._terminate(grace)
            await self.done.wait()

    async def _terminate(self, grace: float = 10.0) -> None:
        """SIGTERM (once), then the exit: ``exit_after`` later, or the kill after ``grace``."""
        if self.state is not MemberState.STOPPING and not self._exit.is_set():
            self.launcher.stopped.append(self.spec.name)
            self.launcher.log.append(("stop", self.spec.name))
            self.state = MemberState.STOPPING
            if self.script.ignores_term:
                await anyio.sleep(grace)
                self.exit(-9)
            else:
                await anyio.sleep(self.script.exit_after)
                self.exit(-15)
        await self._exit.wait()

    @property
    def alive(self) -> bool:
        return self.pid is not None and not self.done.is_set()

    def ready_now(self) -> bool:
        return (self.alive and not self._exit.is_set() and self.script.ready and self.started_at is not None
                and time.monotonic() - self.started_at >= self.script.ready_after)

    def check_paused(self) -> bool:
        return False

    def cpu_seconds(self) -> float:
        return 0.0

    def snapshot(self) -> StateData:
        return member_snapshot(self, None)


class FakeLauncher(OneHost):  # no other host: the part of the protocol only they need is a no-op
    """Records what was started and stopped, in order; ``health`` is what /health answers once ready."""

    def __init__(self, **scripts: Script) -> None:
        self.scripts: dict[str, Script] = dict(scripts)
        self.members: dict[str, FakeMember] = {}
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.log: list[tuple[str, str]] = []  # ("stop" | "exit", name), in the order they happened
        self.specs: list[ProcessSpec] = []
        self.health_code: int | None = 200

    def member(self, spec: ProcessSpec, *, log_path: Path | None, on_line: Callable[[Any, str], None],
               on_exit: Callable[[Any], None], ring: deque[str]) -> FakeMember:
        m = FakeMember(self, spec, on_line, on_exit, ring)
        self.members[spec.name] = m
        self.specs.append(spec)
        return m

    async def accepts(self, spec: ProcessSpec) -> bool:
        return self.members[spec.name].ready_now()

    @asynccontextmanager
    async def health(self, spec: ProcessSpec, timeout: float) -> AsyncIterator[Callable[[], Any]]:
        async def check() -> int | None:
            m = self.members.get(spec.name)
            if m is None or not m.alive:
                return None
            return self.health_code if m.ready_now() else 503

        yield check

    def kill(self, name: str, rc: int = -9) -> None:
        self.members[name].exit(rc)
