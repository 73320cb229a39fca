"""Run a cleanup however the test process ends: at exit, and on SIGTERM/SIGHUP before dying of the signal as before
(a handler already there is chained). Shared by the harnesses that make things outside the process (tests/_netns.py's
namespaces, tests/_freeze.py's cgroups), so a killed test session leaves none behind."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
from typing import Callable

_installed: set[Callable[[], None]] = set()


def on_exit(cleanup: Callable[[], None]) -> None:
    """Call ``cleanup`` at exit and on SIGTERM/SIGHUP; once per cleanup, however often asked."""
    if cleanup in _installed:
        return
    _installed.add(cleanup)
    atexit.register(cleanup)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: object, previous: object = previous) -> None:
            cleanup()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(sig, handler)
