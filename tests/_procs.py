"""Process checks the tests share."""

from __future__ import annotations

import psutil


def dead(p: int | psutil.Process) -> bool:
    """Exited, or a zombie its parent has not reaped yet. A process can be reaped between two questions about it,
    so a process that vanishes while being asked is dead too."""
    try:
        proc = p if isinstance(p, psutil.Process) else psutil.Process(p)
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
