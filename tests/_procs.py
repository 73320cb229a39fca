"""Process checks the tests share."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil


def dead(p: int | psutil.Process) -> bool:
    """Exited, or a zombie its parent has not reaped yet. A process can be reaped between two questions about it,
    so a process that vanishes while being asked is dead too."""
    try:
        proc = p if isinstance(p, psutil.Process) else psutil.Process(p)
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """``pred()``'s first true value, asked every ``interval`` s; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    """Until the llama-server ``proc`` answers ``url``/health with 200; AssertionError with the tail of its ``log``
    if it exits first or does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"llama-server never answered /health: {log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.1)


def stop_after_first_line(child, timeout: float = 10.0, grace: float = 5.0) -> None:
    """Run the arcsplit.proc.child.Child ``child`` until its first output line, then stop() it and wait until its run
    has ended (its group reaped)."""

    async def main() -> None:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                await tg.start(child.run)
                while not child.lines:
                    await anyio.sleep(0.01)
                await child.stop(grace=grace)
                await child.done.wait()

    anyio.run(main)
