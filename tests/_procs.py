"""Process checks the tests share."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

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
