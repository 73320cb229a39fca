"""One supervised process: spawn through the exec shim, capture its output line by line, stop it politely.

States: new -> starting -> ready -> stopping -> exited, checked against states.MEMBER_TRANSITIONS (the supervisor
sets ready; exit is observed, never polled).
The child runs in its own session (process group) so a stop reaches anything it forks; teardown is shielded
from cancellation because anyio's own cancel of a process is a bare SIGKILL.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections import deque
from pathlib import Path
from typing import Awaitable, Callable, TextIO

import anyio
import psutil
from anyio.abc import Process, TaskStatus

from . import spawn
from .spec import ProcessSpec
from .states import MemberState, Tracked

# What llama-server's router sends a child to make it exit (tools/server/server-models.cpp).
STDIN_EXIT = b"cmd_router_to_child:exit\n"

LineHandler = Callable[["Child", str], None]


class Child(Tracked):
    """Owns one OS process for one start; a restart makes a new Child."""

    def __init__(self, spec: ProcessSpec, *, log_path: Path | None = None, on_line: LineHandler | None = None,
                 on_exit: Callable[["Child"], None] | None = None, ring: deque[str] | None = None) -> None:
        self.spec = spec
        self.pid: int | None = None
        self.create_time: float | None = None
        self.returncode: int | None = None
        self.started_at: float | None = None
        self.exited_at: float | None = None
        self.output_count = 0  # lines + partial chunks seen: "progress" for the stall timeout
        self.paused = False  # stopped by SIGSTOP or a debugger: alive, holding its port, doing nothing
        self.lines: deque[str] = ring if ring is not None else deque(maxlen=1000)
        self.done = anyio.Event()
        self._log_path = log_path
        self._on_line = on_line
        self._on_exit = on_exit
        self._process: Process | None = None
        self._log: TextIO | None = None

    # -- running --------------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        return spawn.command(self.spec)

    def adopt(self, process: Process) -> None:
        """Run on a process already started from ``spec`` (spawn.start: serve's early ssh sessions) instead of
        starting one; call before :meth:`run`."""
        self._process = process

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Spawn (or take the adopted process), report started, then pump output until the process exits and its
        pipe is drained."""
        if self._log_path is not None:
            try:  # a full or unwritable log disk costs log lines, never the group
                self._log = open(self._log_path, "a", encoding="utf-8", errors="replace", buffering=1)
            except OSError:
                self._log = None
            self._log_write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {shlex.join(self.spec.argv)}\n")
        self.state = MemberState.STARTING
        try:
            if self._process is None:
                self._process = await spawn.start(self.spec)
        except OSError as exc:
            self._finish(127, f"cannot start {self.spec.argv[0]}: {exc.strerror}")
            task_status.started()
            return
        self.pid = self._process.pid
        self.started_at = time.time()
        try:
            self.create_time = psutil.Process(self.pid).create_time()
        except Exception:  # exited already: the wait below reports it
            self.create_time = None
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump)
                rc = await self._process.wait()
                self._reap_group()  # so the pipe reaches its end: a leftover would hold it open
            await self._process.aclose()  # exited already: this only releases the pipes
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop(grace=5.0)
                self._reap_group()
            raise
        self._finish(rc)

    def _reap_group(self) -> None:
        """SIGKILL what is left of the process group once its leader has exited. ggml's abort forks to print a
        backtrace; a SIGTERM landing in that fork before it is ready deadlocks its exit (fork holds malloc's lock),
        and the fork, holding the output pipe and ignoring every later SIGTERM, outlived a stopped llama-server."""
        if self.pid is not None:
            _killpg(self.pid, signal.SIGKILL)

    async def _pump(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        partial = b""
        try:
            async for chunk in self._process.stdout:
                self.output_count += 1
                data = partial + chunk
                *complete, partial = data.split(b"\n")
                for raw in complete:
                    self._line(raw.decode("utf-8", "replace").rstrip("\r"))
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        if partial:
            self._line(partial.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        self.lines.append(line)
        self._log_write(line + "\n")
        if self._on_line is not None:
            self._on_line(self, line)

    def _log_write(self, text: str) -> None:
        if self._log is not None:
            try:
                self._log.write(text)
            except OSError:
                pass

    def _finish(self, rc: int, message: str | None = None) -> None:
        if message:
            self._line(message)
        self.returncode = rc
        self.exited_at = time.time()
        self.state = MemberState.EXITED
        if self._log is not None:
            self._log_write(f"=== exited {describe_exit(rc)}\n")
            try:
                self._log.close()
            except OSError:  # the final flush on a full disk
                pass
            self._log = None
        self.done.set()
        if self._on_exit is not None:
            self._on_exit(self)

    # -- stopping -------------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.pid is not None and not self.done.is_set()

    def signal_group(self, sig: int) -> None:
        if self.pid is None or self.done.is_set():
            return
        if not _killpg(self.pid, sig):  # no right to the group: the process alone
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group (again after the spec's ``term_again``), SIGKILL after ``grace``; returns once the exit
        is observed. Never cancelled midway."""
        with anyio.CancelScope(shield=True):
            if not self.alive:
                return
            if self.state is not MemberState.STOPPING:
                self.state = MemberState.STOPPING
            self.signal_group(signal.SIGTERM)
            await self._close_stdin()
            again = self.spec.term_again
            if again is not None and again < grace:  # the spec's second SIGTERM (llama-server's forced exit)
                with anyio.move_on_after(again):
                    await self._wait_exit()
                    return
                self._log_write(f"=== still running {again:g} s after SIGTERM: a second SIGTERM\n")
                self.signal_group(signal.SIGTERM)
                grace -= again
            with anyio.move_on_after(grace):
                await self._wait_exit()
                return
            self.signal_group(signal.SIGKILL)
            with anyio.move_on_after(10):
                await self._wait_exit()

    async def send(self, data: bytes) -> bool:
        """Write to the child's stdin (a spec with keep_stdin); False when it is closed or the child is gone."""
        stdin = self._process.stdin if self._process is not None else None
        if stdin is None or self.done.is_set():
            return False
        try:
            await stdin.send(data)
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False

    async def close_input(self) -> None:
        """EOF on the child's stdin, without the router's exit line (a node agent stops everything on EOF)."""
        stdin = self._process.stdin if self._process is not None else None
        if stdin is not None:
            try:
                await stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass

    async def _close_stdin(self) -> None:
        """llama-server in child mode joins a thread that reads stdin before it exits: tell it to stop, then EOF."""
        stdin = self._process.stdin if self._process is not None else None
        if stdin is None:
            return
        with anyio.move_on_after(1):
            try:
                await stdin.send(STDIN_EXIT)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
        try:
            await stdin.aclose()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    async def _wait_exit(self) -> None:
        """Wait for the process itself (the pump task may still be draining)."""
        if self._process is not None:
            await self._process.wait()

    def uptime(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.exited_at or time.time()
        return end - self.started_at

    def check_paused(self) -> bool:
        """Read whether the process is stopped (SIGSTOP, ^Z, a debugger); True when that changed.

        A stopped rpc-server exits nothing and llama-server's /health still answers, so requests just wait:
        only the process state shows it.
        """
        now = False
        if self.pid is not None and self.alive:
            try:
                now = psutil.Process(self.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
            except psutil.Error:
                now = False
        changed, self.paused = now != self.paused, now
        return changed


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc > 128 and rc - 128 < 65:
        try:
            return f"exit {rc} ({signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"exit {rc}"


# What a signal did, in words a user reads in a failure message ("rpc0 exited with signal 9 (killed)").
_SIGNAL_WORDS = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGABRT: "aborted",
                 signal.SIGSEGV: "segmentation fault", signal.SIGBUS: "bus error", signal.SIGFPE: "arithmetic error",
                 signal.SIGILL: "illegal instruction", signal.SIGINT: "interrupted", signal.SIGHUP: "hung up",
                 signal.SIGPIPE: "broken pipe"}


def exit_words(rc: int | None) -> str:
    """How a process ended, as a sentence's verb phrase: "exited with signal 9 (killed)", "exited with code 1".
    A code over 128 from a shell wrapper is read as the signal it stands for, as describe_exit does."""
    if rc is None:
        return "is still running"
    sig = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + 65 else None
    if sig is None:
        return f"exited with code {rc}"
    try:
        what = _SIGNAL_WORDS.get(signal.Signals(sig)) or signal.Signals(sig).name
    except ValueError:
        what = "unknown signal"
    return f"exited with signal {sig} ({what})"


class _ShieldOnStart:
    """A task status whose started() also makes ``scope`` a shield (run_held)."""

    def __init__(self, scope: anyio.CancelScope, status: TaskStatus[None]) -> None:
        self._scope, self._status = scope, status

    def started(self, value: None = None) -> None:
        self._scope.shield = True
        self._status.started(value)


async def run_held(scope: anyio.CancelScope, run: Callable[..., Awaitable[None]],
                   task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """``run(task_status=...)`` (a member's or a transport's run) inside ``scope``, which turns into a shield once
    ``run`` reports started: from then on a cancel from outside does not reach it, only ``scope.cancel()`` (a group
    stops in order: llama-server before the rpc-servers it calls). Before that it is cancellable as usual, so a
    cancelled ``tg.start`` (which waits for the task it started to end) never waits on a shielded run."""
    with scope:
        await run(task_status=_ShieldOnStart(scope, task_status))


def _killpg(pid: int, sig: int) -> bool:
    """``sig`` to the process group ``pid`` leads (start_new_session: pgid == pid); False only where that group may
    not be signalled (PermissionError). A group already gone counts as signalled."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    return True
