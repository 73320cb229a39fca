"""The run directory (logs + state.json) and the sweep that removes what a dead supervisor left behind.

state_dir()/runs/<run-id>/ holds one log file per process name (appended across restarts) and state.json:
pids, pgids, create times, ports, argv, the supervisor's pid, the group's state. The next start reads every
state.json whose supervisor is gone and kills the processes still matching by pid + create_time + cmdline: a reused
pid is never touched. The newest KEEP_RUNS directories stay after their run, for `arcsplit ps --all` and `logs`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .._dirs import state_dir
from ..errors import BadInput

if TYPE_CHECKING:
    import psutil

# psutil is imported where a process is looked at, not at the top: the node agent creates its run dir and sweeps
# (usually nothing) before it has imported anything it does not need to start its first rpc-server.

KEEP_RUNS = 20


def runs_root() -> Path:
    return state_dir() / "runs"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, run_id: str | None = None, root: Path | None = None) -> "RunDir":
        """A new private run dir under ``root`` (default: runs_root(); a node agent keeps its own root)."""
        root = root or runs_root()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)  # logs and state hold argv, ports and prompts: private to the user
        base = run_id or new_run_id()
        n = 1
        while True:  # two instances of one process started in the same second get -2, -3, ...
            path = root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir(mode=0o700)
                break
            except FileExistsError:
                if run_id is not None:
                    break  # a run id given by the caller is reused as is
                n += 1
        path.chmod(0o700)
        _prune(root, keep=KEEP_RUNS)
        return cls(path)

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    def log_path(self, name: str) -> Path:
        return self.path / f"{name}.log"

    def write_state(self, state: dict[str, Any]) -> None:
        """Atomic: a reader (or a sweep after SIGKILL) never sees half a file."""
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(state, indent=1))
        tmp.replace(self.state_file)


def newest_run(root: Path | None = None) -> Path | None:
    """The run dir written last (its state.json is rewritten on every change), or None when there is none."""
    root = root or runs_root()
    dirs = [d for d in root.glob("*") if d.is_dir()] if root.is_dir() else []
    return max(dirs, key=lambda d: (d / "state.json").stat().st_mtime if (d / "state.json").exists()
               else d.stat().st_mtime, default=None)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """A run's state.json, or None when it is missing or unreadable."""
    try:
        state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def fault_lines(state: Mapping[str, Any]) -> list[str]:
    """What a run's state (state.json, or the supervisor's status) says went wrong, as lines of text: the last error
    with the log lines that show it below, the failures counted per card, and each card that needs a driver reset
    with how (run/faults.py writes them). ``arcsplit ps``, ``doctor``, ``report`` and the dashboard print these."""
    out: list[str] = []
    if state.get("last_error"):
        out.append(f"last error: {state['last_error']}")
        out += [f"    {line}" for line in state.get("last_error_lines") or []]
    per_card = state.get("card_faults") or {}
    if per_card:
        said = [f"{card} " + ", ".join(f"{cause} x{n}" for cause, n in causes.items())
                for card, causes in per_card.items()]
        out.append("failures by card: " + "; ".join(said))
    out += [str(r.get("line")) for r in state.get("resets") or [] if isinstance(r, dict)]
    return out


def since_boot(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot (``/proc/PID/stat``'s starttime): what tells a process from a
    later one with its pid. psutil's create_time adds the boot time as the system clock gives it *now*, so a step
    of the clock (NTP, a virtual machine resumed) moves it, and a live process would read as another one: its run
    missing from ``ps``, its processes swept as leftovers. This does not move. None once gone, or off Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the command name, in parentheses, may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


def supervisor_identity() -> dict[str, Any]:
    """This process, as state.json names its supervisor (``create_time`` for older readers)."""
    import psutil  # start-up: see the note at the top

    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "since_boot": since_boot(me.pid)}


def same_process(pid: int, create_time: float, cmdline: list[str] | None = None,
                 started: float | None = None) -> psutil.Process | None:
    """The live process with this pid *and* start time (and argv, when given): never a reused pid. ``started``:
    its :func:`since_boot` as recorded, compared instead of the wall-clock ``create_time`` (files written before
    it existed have only the latter)."""
    import psutil  # start-up: see the note at the top

    try:
        p = psutil.Process(pid)
        if started is not None:
            now = since_boot(pid)
            if now is None or abs(now - started) > 0.02:  # starttime counts clock ticks (10 ms)
                return None
        elif abs(p.create_time() - create_time) > 0.05:
            return None
        if cmdline is not None and p.cmdline() != cmdline:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def sweep(root: Path | None = None, grace: float = 3.0) -> list[int]:
    """Kill leftovers of runs whose supervisor is dead; returns the pids killed."""
    root = root or runs_root()
    killed: list[int] = []
    if not root.is_dir():
        return killed
    for state_file in root.glob("*/state.json"):
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not state.get("processes"):
            continue
        import psutil  # start-up: see the note at the top

        sup = state.get("supervisor") or {}
        if sup and same_process(int(sup.get("pid", -1)), float(sup.get("create_time") or 0),
                                started=_float(sup.get("since_boot"))):
            continue  # another arcsplit is running it
        victims = []
        for proc in state.get("processes", []):
            p = same_process(int(proc.get("pid", -1)), float(proc.get("create_time") or 0), list(proc.get("argv", [])),
                             started=_float(proc.get("since_boot")))
            if p is not None:
                victims.append(p)
        for p in victims:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, still = psutil.wait_procs(victims, timeout=grace)
        for p in still:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(still, timeout=grace)
        killed += [p.pid for p in victims]
        state["processes"] = []
        state["swept"] = time.time()
        try:
            tmp = state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
            tmp.replace(state_file)
        except OSError:
            pass
    return killed


@dataclass(frozen=True)
class RunRecord:
    """One run directory as its state.json left it: what `ps --all` lists, and where `logs` reads a finished run."""

    run_id: str
    path: Path
    started: float | None
    ended: float | None  # None: still running, or its supervisor died before it could write the end
    group: str | None  # the group's last state
    mode: str | None
    url: str | None
    model: str | None
    running: bool  # its supervisor is still the process that wrote the file
    faults: tuple[str, ...] = ()  # what went wrong, as fault_lines says it

    @property
    def state(self) -> str:
        """The group's last state; "died" for a run whose supervisor went without writing its end (killed)."""
        if self.running or self.ended is not None:
            return self.group or "unknown"
        return "died"

    def log_names(self) -> list[str]:
        """Its processes' log files by name: the rpc-servers and links, then llama-server (the order it starts)."""
        names = sorted(p.stem for p in self.path.glob("*.log"))
        return sorted(names, key=lambda n: n == "server")

    def log_lines(self, name: str, n: int) -> list[str]:
        return tail_lines(self.path / f"{name}.log", n)


def tail_lines(path: Path, n: int, window: int = 256 * 1024) -> list[str]:
    """The last ``n`` lines of a log file, reading at most its last ``window`` bytes (a log grows for days)."""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - window))
        lines = fh.read().decode("utf-8", "replace").splitlines()
    if size > window and lines:
        lines = lines[1:]  # the first one is cut
    return lines[-n:] if n else lines


def read_record(path: Path) -> RunRecord | None:
    """The run in ``path``; None for a directory without a readable state.json."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    sup = state.get("supervisor") or {}
    running = bool(sup) and state.get("ended") is None and same_process(
        int(sup.get("pid", -1)), float(sup.get("create_time") or 0), started=_float(sup.get("since_boot"))) is not None
    plan = state.get("plan") or {}
    return RunRecord(run_id=path.name, path=path, started=_float(state.get("started")),
                     ended=_float(state.get("ended")), group=state.get("group"), mode=state.get("mode"),
                     url=state.get("url"), model=plan.get("model") if isinstance(plan, dict) else None, running=running,
                     faults=tuple(fault_lines(state)))


def run_records(root: Path | None = None) -> list[RunRecord]:
    """Every run still on disk (the newest KEEP_RUNS and any still running), newest first."""
    root = root or runs_root()
    if not root.is_dir():
        return []
    found = [r for d in root.iterdir() if d.is_dir() for r in [read_record(d)] if r is not None]
    return sorted(found, key=lambda r: (r.started or 0.0, r.run_id), reverse=True)


def find_record(run: str | None, root: Path | None = None) -> RunRecord | None:
    """The run named by ``run`` (its id or a unique prefix; None: the newest); None when there is no such run."""
    records = run_records(root)
    if run is None:
        return records[0] if records else None
    matches = [r for r in records if r.run_id == run] or [r for r in records if r.run_id.startswith(run)]
    if len(matches) > 1:
        raise BadInput(f"{run!r} matches {len(matches)} runs", "give more of the run id (`arcsplit ps --all`)")
    return matches[0] if matches else None


def _prune(root: Path, keep: int) -> None:
    """Drop the oldest finished run dirs beyond ``keep``; a dir whose state lists live processes stays."""
    dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for d in dirs[:-keep] if len(dirs) > keep else []:
        try:
            state = json.loads((d / "state.json").read_text(encoding="utf-8"))
            if state.get("processes"):
                continue
        except (OSError, ValueError):
            pass
        shutil.rmtree(d, ignore_errors=True)
