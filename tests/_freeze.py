"""Freeze a process, or one thread of it, with the kernel's cgroup freezer: the hang a card's driver leaves behind
(every process alive, nothing computing), made on purpose for the tests and bench of the progress watchdog.

    with frozen(pid) as f:            # the whole process (every thread)
        ...                           # f.kind: "v2" or "v1", f.path: the cgroup
    with frozen(pid, thread=pid):     # only its main thread (tid == pid), the others run on
        ...

cgroup v2 (preferred: a frozen task still dies on SIGKILL, so a restart can end it) needs a cgroup2 mount
(``/sys/fs/cgroup`` on a unified host, ``/sys/fs/cgroup/unified`` on a hybrid one): a child cgroup
``arcs-freeze-<pid>-<n>`` takes the process (``cgroup.procs``) and ``cgroup.freeze`` stops it; for one thread, a
*threaded* child of that cgroup takes the thread (``cgroup.threads``) and only it is frozen. cgroup v1 (the
``freezer`` hierarchy) accepts thread ids in ``tasks``; a task frozen there cannot die, not even on SIGKILL, until it
is thawed, as a task stuck in a driver call. ``kind="v1"`` asks for it.

Every exit path thaws and removes what was made: the context's exit, atexit, SIGTERM/SIGHUP, and the next start for
cgroups whose creating process is gone (a SIGKILLed test session). ``unavailable()`` says why neither can be used here
(the tests skip with it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from _on_exit import on_exit

PREFIX = "arcs-freeze-"
_seq = itertools.count()
_live: list["Frozen"] = []


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, options) of this process's mounts."""
    out = []
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1], parts[2], parts[3]))
    except OSError:
        pass
    return out


def v2_root() -> Path | None:
    """Where cgroup2 is mounted (a unified host: /sys/fs/cgroup; hybrid: /sys/fs/cgroup/unified), or None."""
    for point, fstype, _ in _mounts():
        if fstype == "cgroup2":
            return Path(point)
    return None


def v1_root() -> Path | None:
    """The cgroup v1 freezer hierarchy's mount, or None."""
    for point, fstype, opts in _mounts():
        if fstype == "cgroup" and "freezer" in opts.split(","):
            return Path(point)
    return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _probe(root: Path, kind: str) -> str | None:
    """Whether a cgroup can be made and removed under ``root``: None, or why not."""
    probe = root / f"{PREFIX}{os.getpid()}-probe"
    try:
        probe.mkdir(exist_ok=True)
        if kind == "v2" and not (probe / "cgroup.freeze").exists():
            return f"{root} has no cgroup.freeze (kernel older than 5.2)"
        if kind == "v1" and not (probe / "freezer.state").exists():
            return f"{root} has no freezer.state"
        return None
    except OSError as exc:
        return f"cannot make a cgroup under {root}: {exc.strerror}"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def available_kinds() -> dict[str, str | None]:
    """Each freezer kind and why it cannot be used here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return {"v2": "the cgroup freezer needs Linux", "v1": "the cgroup freezer needs Linux"}
    if os.geteuid() != 0:
        return {"v2": "freezing needs root (writing cgroups)", "v1": "freezing needs root (writing cgroups)"}
    v2, v1 = v2_root(), v1_root()
    return {"v2": _probe(v2, "v2") if v2 else "no cgroup2 mount", "v1": _probe(v1, "v1") if v1 else
            "no cgroup v1 freezer mount"}


def unavailable(kind: str | None = None) -> str | None:
    """Why the freezer (``kind``, or either) cannot be used here, or None."""
    kinds = available_kinds()
    if kind is not None:
        return kinds[kind]
    if any(why is None for why in kinds.values()):
        return None
    return "; ".join(f"cgroup {k}: {why}" for k, why in kinds.items())


def _v2_path_of(pid: int, root: Path) -> Path:
    """The cgroup2 directory ``pid`` is in now (its ``0::`` line)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


@dataclass
class Frozen:
    """One freeze: its cgroup(s), what it froze, and how to undo it (``thaw`` is idempotent)."""

    kind: str
    pid: int
    thread: int | None
    path: Path  # the cgroup that is frozen
    made: list[Path] = field(default_factory=list)  # every cgroup made, outermost first
    home: Path | None = None  # v2: where the process was before (it goes back there)
    owner: int = field(default_factory=os.getpid)
    done: bool = False

    def freeze(self) -> None:
        if self.kind == "v2":
            _write(self.path / "cgroup.freeze", "1")
            self._wait("frozen 1")
        else:
            _write(self.path / "freezer.state", "FROZEN")
            self._wait("FROZEN")

    def _wait(self, want: str, timeout: float = 5.0) -> None:
        """Until the kernel reports the cgroup frozen (a task in a syscall freezes when it leaves it)."""
        file = self.path / ("cgroup.events" if self.kind == "v2" else "freezer.state")
        deadline = time.monotonic() + timeout
        while want not in file.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path} not {want!r} after {timeout:.0f} s: {file.read_text()!r}")
            time.sleep(0.01)

    def thaw(self) -> None:
        """Thaw, put the tasks back where they were, remove the cgroups: safe to call twice, and after the process
        has exited."""
        if self.done:
            return
        self.done = True
        with contextlib.suppress(OSError):
            if self.kind == "v2":
                _write(self.path / "cgroup.freeze", "0")
            else:
                _write(self.path / "freezer.state", "THAWED")
        self._move_back()
        for cg in reversed(self.made):
            _rmdir(cg)
        if self in _live:
            _live.remove(self)

    def _move_back(self) -> None:
        if self.kind == "v2":
            if self.home is not None:
                with contextlib.suppress(OSError):  # moves every thread, those of the threaded child too
                    _write(self.home / "cgroup.procs", str(self.pid))
            return
        parent = self.path.parent
        for tid in _tasks(self.path):
            with contextlib.suppress(OSError):
                _write(parent / "tasks", str(tid))


def _tasks(cg: Path) -> list[int]:
    try:
        return [int(t) for t in (cg / "tasks").read_text().split()]
    except (OSError, ValueError):
        return []


def _rmdir(cg: Path, timeout: float = 5.0) -> None:
    """Remove a cgroup once its tasks are gone (a task just killed leaves it a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def _make(pid: int, thread: int | None, kind: str) -> Frozen:
    name = f"{PREFIX}{os.getpid()}-{next(_seq)}"
    if kind == "v2":
        root = v2_root()
        assert root is not None
        top = root / name
        home = _v2_path_of(pid, root)
        top.mkdir()
        f = Frozen("v2", pid, thread, top, [top], home)
        _live.append(f)
        _write(top / "cgroup.procs", str(pid))
        if thread is not None:
            inner = top / "thread"
            inner.mkdir()
            f.made.append(inner)
            _write(inner / "cgroup.type", "threaded")
            _write(inner / "cgroup.threads", str(thread))
            f.path = inner
        return f
    root = v1_root()
    assert root is not None
    cg = root / name
    cg.mkdir()
    f = Frozen("v1", pid, thread, cg, [cg])
    _live.append(f)
    for tid in [thread] if thread is not None else _threads(pid):  # v1's tasks file takes one thread each
        with contextlib.suppress(ProcessLookupError, OSError):
            _write(cg / "tasks", str(tid))
    return f


@contextlib.contextmanager
def frozen(pid: int, *, thread: int | None = None, kind: str | None = None) -> Iterator[Frozen]:
    """``pid`` (or only its thread ``thread``) frozen inside, thawed and put back on the way out, whatever
    happens. ``kind``: "v2" or "v1"; None: v2 where it works, else v1. Skip first with ``unavailable()``."""
    kinds = available_kinds()
    kind = kind or ("v2" if kinds["v2"] is None else "v1")
    if kinds[kind] is not None:
        raise RuntimeError(f"cgroup {kind} freezer: {kinds[kind]}")
    on_exit(_cleanup_all)
    sweep()
    f = _make(pid, thread, kind)
    try:
        f.freeze()
        yield f
    finally:
        f.thaw()


def state_of(pid: int, tid: int | None = None) -> str:
    """The kernel's state letter of a thread (``tid``, default the main one): R, S, D, T, Z."""
    tid = pid if tid is None else tid
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def sweep() -> None:
    """Thaw and remove the freeze cgroups of test sessions that are gone (their creating pid in the name)."""
    for root, kind in ((v2_root(), "v2"), (v1_root(), "v1")):
        if root is None:
            continue
        try:
            entries = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
        except OSError:
            continue
        for top in entries:
            try:
                owner = int(top.name[len(PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner != os.getpid() and Path(f"/proc/{owner}").exists():
                continue
            if owner == os.getpid() and any(f.made and f.made[0] == top for f in _live):
                continue
            _sweep_one(top, root, kind)


def _sweep_one(top: Path, root: Path, kind: str) -> None:
    inner = [top / "thread"] if (top / "thread").is_dir() else []
    for cg in [*inner, top]:
        with contextlib.suppress(OSError):
            _write(cg / ("cgroup.freeze" if kind == "v2" else "freezer.state"), "0" if kind == "v2" else "THAWED")
    if kind == "v2":
        with contextlib.suppress(OSError):
            for pid in (top / "cgroup.procs").read_text().split():
                _write(root / "cgroup.procs", pid)
    else:
        for tid in _tasks(top):
            with contextlib.suppress(OSError):
                _write(root / "tasks", str(tid))
    for cg in [*inner, top]:
        _rmdir(cg, 1.0)


def _cleanup_all() -> None:
    for f in list(_live):
        if f.owner == os.getpid():
            f.thaw()


