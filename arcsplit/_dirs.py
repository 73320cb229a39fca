"""Where arcsplit keeps its files: caches, run state, control sockets (all per user)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Callable, Iterator

import platformdirs

_APP = "arcsplit"


def cache_dir() -> Path:
    """Builds, downloaded sources, the demo model, probe verdicts. ``ARCSPLIT_CACHE_DIR`` overrides."""
    override = os.environ.get("ARCSPLIT_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir(_APP))


LOCK_NAME = "lock"  # scripts/_oneapi.sh takes the same file with flock(1)
_held = 0  # how deep this process is inside cache_lock (a UI build runs inside a llama.cpp build's lock)


@contextlib.contextmanager
def cache_lock(on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """The one lock every writer of the shared cache holds: llama.cpp builds and prunes, the web UI build, the demo
    models, the oneAPI runtime. Two terminals, parallel test runs or a demo beside a build would otherwise
    trample each other's directories. Each writer checks "is it done?" again once it holds the lock, so the one
    that waited finds the other's work. Reentrant within a process; ``on_wait`` is called when another holds it."""
    global _held
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / LOCK_NAME).open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        _held = 1
        try:
            yield
        finally:
            _held = 0
            fcntl.flock(fh, fcntl.LOCK_UN)


def state_dir() -> Path:
    """Per-run log files and state files. ``ARCSPLIT_STATE_DIR`` overrides."""
    override = os.environ.get("ARCSPLIT_STATE_DIR")
    return Path(override) if override else Path(platformdirs.user_state_dir(_APP))


def runtime_dir() -> Path:
    """Control sockets; created 0700 because the bus accepts commands."""
    override = os.environ.get("ARCSPLIT_RUNTIME_DIR")
    if override:
        path = Path(override)
    else:
        base = os.environ.get("XDG_RUNTIME_DIR")
        path = Path(base) / _APP if base else state_dir() / "sockets"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def keep_json(path: Path, data: object, indent: int | None = None) -> bool:
    """Write ``data`` as JSON to a cache or state file by rename, so a reader never sees half of it. Best effort:
    False when it cannot be written (a read-only cache only costs the next run the work it saved)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=indent), encoding="utf-8")
        tmp.replace(path)
        return True
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
