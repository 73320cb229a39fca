"""What a live process that stopped computing is doing, read from /proc (Linux; elsewhere: nothing known).

The progress watchdog (run/watchdog.py) reads this once it has found a group stalled, to name the member that
stopped: a process or thread frozen by a cgroup freezer (v1 ``freezer.state``, v2 ``cgroup.events``: what a
``systemctl freeze`` or a test does), threads in uninterruptible sleep (state D, with the kernel function they wait
in, ``wchan``: a driver call that does not return), and the peers its threads are blocked on (each thread's
system call, ``/proc/PID/task/TID/syscall``, reading or writing a socket whose other end ``/proc/PID/net/tcp``
names: llama-server's RPC dispatcher thread for one rpc-server waiting on the answer that does not come). ``main_cpu`` is the CPU time of a process's
main thread, which computes in llama-server and rpc-server alike: the watchdog's evidence of work, which the other
threads' busy-waiting does not fake. Each read is a few small files; all of it only as the same user (or root).
"""

from __future__ import annotations

import ipaddress
import os
import platform
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# System calls that move data on a file descriptor given as their first argument: a thread blocked in one of these
# on a socket waits on that socket's peer (the kernel's syscall tables: arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h for arm64).
_IO_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 19: "readv", 20: "writev", 44: "sendto", 45: "recvfrom", 46: "sendmsg",
               47: "recvmsg"},
    "aarch64": {63: "read", 64: "write", 65: "readv", 66: "writev", 206: "sendto", 207: "recvfrom", 211: "sendmsg",
                212: "recvmsg"},
}
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Stuck:
    """One process as /proc shows it now."""

    pid: int
    state: str  # its main thread's state letter (R running, S sleeping, D uninterruptible, T stopped, Z zombie)
    frozen: str | None  # "the cgroup v2 freezer (/sys/fs/cgroup/...)" when it, or its main thread, is frozen
    frozen_threads: int  # how many of its threads are in a frozen cgroup
    threads: int
    blocked: tuple[tuple[int, str], ...]  # (tid, wchan) of its threads in state D
    waits_on: tuple[tuple[str, int], ...]  # (address, port) of each socket peer one of its threads is blocked on
    io: str | None  # the system call of the first ("recvfrom")

    def summary(self) -> str:
        """What it does, in a few words: "frozen by the cgroup v2 freezer (...)", "in state D (in xe_wait)"."""
        if self.frozen:
            n, of = self.frozen_threads, self.threads
            if n >= of:
                return f"frozen by {self.frozen}"
            return f"{'its main thread' if n <= 1 else f'{n} of its {of} threads'} frozen by {self.frozen}"
        if self.state == "T":
            return "stopped (SIGSTOP or a debugger)"
        if self.blocked:
            where = ", ".join(sorted({w for _, w in self.blocked if w}))
            return f"{len(self.blocked)} thread(s) in uninterruptible sleep (state D{', in ' + where if where else ''})"
        return f"main thread in state {self.state}"


def main_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid``'s main thread (tid == pid); None when it cannot be read."""
    return _cpu(PROC / str(pid) / "task" / str(pid) / "stat")


def _cpu(stat: Path) -> float | None:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def _state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no longer in /proc, or a zombie (or dead) whose exit only waits to be reaped."""
    return _state(PROC / str(pid)) in ("?", "Z", "X")


def inspect(pid: int) -> Stuck | None:
    """``pid`` as /proc shows it now; None when it is gone or not readable."""
    task_dir = PROC / str(pid) / "task"
    try:
        tids = sorted(int(t) for t in os.listdir(task_dir))
    except (OSError, ValueError):
        return None
    blocked: list[tuple[int, str]] = []
    frozen_by: str | None = None
    n_frozen = 0
    for tid in tids:
        task = task_dir / str(tid)
        if _state(task) == "D":
            blocked.append((tid, _read(task / "wchan")))
        by = frozen_cgroup(task)
        if by is not None:
            n_frozen += 1
            if frozen_by is None or tid == pid:
                frozen_by = by
    waits = [w for w in (_waits_on(pid, tid) for tid in tids) if w[1] is not None]
    return Stuck(pid=pid, state=_state(task_dir / str(pid)), frozen=frozen_by, frozen_threads=n_frozen,
                 threads=len(tids), blocked=tuple(blocked), waits_on=tuple(dict.fromkeys(p for _, p in waits if p)),
                 io=waits[0][0] if waits else None)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().strip("\0")
    except OSError:
        return ""


def _mounts() -> dict[str, Path]:
    """Where each cgroup hierarchy is mounted: "2" (cgroup2) and "freezer" (v1), when they are."""
    out: dict[str, Path] = {}
    for line in _read(PROC / "self" / "mounts").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[2] == "cgroup2":
            out.setdefault("2", Path(parts[1]))
        elif parts[2] == "cgroup" and "freezer" in parts[3].split(","):
            out.setdefault("freezer", Path(parts[1]))
    return out


def frozen_cgroup(task: Path) -> str | None:
    """Which freezer holds the thread ``task`` (/proc/PID/task/TID): "the cgroup v2 freezer (PATH)", v1's, None."""
    mounts = _mounts()
    for line in _read(task / "cgroup").splitlines():
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if hid == "0" and "2" in mounts and rel:
            cg = mounts["2"] / rel
            if "frozen 1" in _read(cg / "cgroup.events").splitlines():
                return f"the cgroup v2 freezer ({cg})"
        elif "freezer" in controllers.split(",") and "freezer" in mounts and rel:
            cg = mounts["freezer"] / rel
            if _read(cg / "freezer.state") in ("FROZEN", "FREEZING"):
                return f"the cgroup v1 freezer ({cg})"
    return None


def _waits_on(pid: int, tid: int) -> tuple[str | None, tuple[str, int] | None]:
    """The system call thread ``tid`` of ``pid`` is blocked in, when it moves data on a socket, and that socket's
    peer."""
    table = _IO_SYSCALLS.get(platform.machine())
    words = _read(PROC / str(pid) / "task" / str(tid) / "syscall").split()
    if table is None or len(words) < 2 or not words[0].isdigit() or int(words[0]) not in table:
        return None, None
    try:
        fd = int(words[1], 16)
        link = os.readlink(PROC / str(pid) / "fd" / str(fd))
    except (OSError, ValueError):
        return table[int(words[0])], None
    if not link.startswith("socket:["):
        return table[int(words[0])], None
    inode = link[len("socket:["):-1]
    return table[int(words[0])], socket_peer(pid, inode)


def socket_peer(pid: int, inode: str) -> tuple[str, int] | None:
    """The remote (address, port) of ``pid``'s TCP socket ``inode`` (/proc/PID/net/tcp and tcp6)."""
    for name in ("tcp", "tcp6"):
        for line in _read(PROC / str(pid) / "net" / name).splitlines()[1:]:
            f = line.split()
            if len(f) > 9 and f[9] == inode:
                return parse_address(f[2])
    return None


def parse_address(field: str) -> tuple[str, int] | None:
    """``0100007F:1F90`` -> ("127.0.0.1", 8080); IPv6's 32 hex digits too (each 32-bit word in host order, which is
    little-endian on every machine arcsplit runs on)."""
    host, _, port = field.partition(":")
    try:
        raw = bytes.fromhex(host)
        n = int(port, 16)
    except ValueError:
        return None
    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
    data = b"".join(words)
    if len(data) == 4:
        return ".".join(str(b) for b in data), n
    if len(data) == 16:
        if data[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 address as IPv6 sees it
            return ".".join(str(b) for b in data[12:]), n
        return str(ipaddress.IPv6Address(data)), n
    return None
