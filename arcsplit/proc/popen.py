"""A process started without an event loop (spawn.popen), seen as anyio's Process so a Child can adopt it.

The node agent starts its first rpc-servers before it has imported anyio (node/quick.py), then supervises them
like every other child; ``serve --layout`` starts its hosts' ssh sessions the same way before it imports anyio
(run/early.py), and their stdin carries the agent's requests. Output is read from the pipe when the loop says it
is readable, and the exit is awaited on a pidfd: nothing blocks a worker thread, so cancelling a Child's task
behaves as with anyio's own processes.
"""

from __future__ import annotations

import os
import signal
import subprocess

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process


class _PipeStream(ByteReceiveStream):
    """The read end of a pipe, non-blocking, read when anyio.wait_readable says so."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self._fd is None:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class _PipeSend(ByteSendStream):
    """The write end of a pipe, non-blocking, written when anyio.wait_writable says so (a node session's stdin)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            if self._fd is None:
                raise anyio.ClosedResourceError
            try:
                view = view[os.write(self._fd, view):]
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
            except BrokenPipeError:
                raise anyio.BrokenResourceError from None

    async def aclose(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class PopenProcess(Process):
    """``subprocess.Popen`` (stdout a pipe, stdin a pipe or not, stderr not) behind anyio's Process interface."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdout is not None
        self._popen = popen
        self._stdout = _PipeStream(os.dup(popen.stdout.fileno()))
        popen.stdout.close()  # the duplicate is the one read from now on
        self._stdin: _PipeSend | None = None
        if popen.stdin is not None:
            self._stdin = _PipeSend(os.dup(popen.stdin.fileno()))
            popen.stdin.close()
        self._pidfd: int | None = None
        self._watched: anyio.Event | None = None  # set while one task waits on the pidfd; set() when it stops

    async def wait(self) -> int:
        """The exit status, once the process has exited. Several tasks may wait at once (a Child's run() and its
        stop(), as with anyio's own processes): one of them watches the pidfd, which anyio lets only one task
        wait on, and the others wait for it to stop watching, then look again."""
        while (rc := self._popen.poll()) is None:
            if self._watched is not None:
                await self._watched.wait()
                continue
            if self._pidfd is None:
                try:
                    self._pidfd = os.pidfd_open(self._popen.pid)
                except (OSError, AttributeError):  # no pidfd (an old kernel): look again shortly
                    await anyio.sleep(0.05)
                    continue
            self._watched = watched = anyio.Event()
            try:
                await anyio.wait_readable(self._pidfd)  # readable once the process has exited
            finally:  # exited, or this task was cancelled: either way another waiter may take over
                self._watched = None
                watched.set()
        return rc

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()

    def send_signal(self, sig: signal.Signals) -> None:
        self._popen.send_signal(sig)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    @property
    def stdin(self) -> ByteSendStream | None:
        return self._stdin

    @property
    def stdout(self) -> ByteReceiveStream | None:
        return self._stdout

    @property
    def stderr(self) -> ByteReceiveStream | None:
        return None

    async def aclose(self) -> None:
        if self._stdin is not None:
            await self._stdin.aclose()
        await self._stdout.aclose()
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            os.close(fd)
        await self.wait()
