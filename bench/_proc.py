"""A process a bench started itself (an rpc-server, a llama-server typed by hand), ended the one way."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace`` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
