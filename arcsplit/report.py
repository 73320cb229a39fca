"""``arcsplit report``: one redacted .tar.gz that an Arc user attaches to a bug report.

arcsplit's developers have no Arc card, so field failures come back through this bundle: the doctor's facts, verdict,
host checks and mode (text and JSON), cached probe results and recorded failures, the binaries' build, the last run's
state (plan, mode, last error) and the tails of its logs, the GPU-related environment and the system. Every file goes
through ``redact.Redactor`` first: credentials (by variable name, ``--api-key`` values and files, token shapes), the
home directory, the user name and the host name never leave the machine. The bundle is written to a temporary name
and renamed when complete, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import getpass
import io
import json
import os
import platform
import socket
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import __version__
from ._dirs import cache_dir
from .errors import BadInput
from .netaddr import ssh_identities
from .proc.rundir import fault_lines, runs_root
from .llama.source import llama_root
from .redact import Redactor, secret_env

LOG_TAIL_LINES = 400
BUILD_LOG_LINES = 60
# Variables that change what llama.cpp, SYCL, Level Zero, NEO or Vulkan do: shown (redacted) in env.json.
ENV_PREFIXES = ("ONEAPI_", "SYCL_", "ZE_", "ZES_", "GGML_", "LLAMA_", "NEO", "ForceZe", "UR_", "SYCL", "VK_",
                "MESA_", "ARCSPLIT_", "CUDA_", "OCL_", "LD_LIBRARY_PATH", "CMPLR_ROOT", "ONEAPI_ROOT", "XDG_RUNTIME")


def _tail(path: Path, n: int) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(not readable: {exc.strerror})\n"
    return "\n".join(data.splitlines()[-n:]) + "\n"


def find_run(run: str | None) -> Path | None:
    """The named run dir, or the newest one; None when there has been no run."""
    root = runs_root()
    if run is not None:
        path = root / run
        if not path.is_dir() or "/" in run:
            raise BadInput(f"no run {run!r} in {root}", "pass a run id from `arcsplit ps`, or leave it out for the last run")
        return path
    dirs = sorted((d for d in root.glob("*") if d.is_dir()), key=lambda d: d.stat().st_mtime) if root.is_dir() else []
    return dirs[-1] if dirs else None


def _argv_secrets(state: Mapping[str, Any]) -> list[str]:
    """--api-key values and the contents of --api-key-file files named in a run's argv."""
    out = []
    for proc in state.get("processes") or []:
        argv = list(proc.get("argv") or [])
        for flag, value in zip(argv, argv[1:]):
            if flag == "--api-key":
                out.append(value)
            elif flag == "--api-key-file":
                try:
                    out += [line.strip() for line in Path(value).read_text().splitlines() if line.strip()]
                except OSError:
                    pass
    return out


def _remote_identities(state: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The other hosts of a run (state.json ``hosts``): (their names, ssh destinations and machine names; the
    users those destinations log in as)."""
    hosts: list[str] = []
    users: list[str] = []
    for name, info in (state.get("hosts") or {}).items():
        dest = str((info or {}).get("ssh") or "") if isinstance(info, dict) else ""
        user, machine = ssh_identities(dest) if dest else (None, "")
        hosts += [str(name), dest, machine]
        users += [user] if user else []
    return hosts, users


def _state_without_destinations(state: dict[str, Any]) -> str:
    """state.json with each host's ssh destination replaced whole, however short (an alias like "b")."""
    for info in (state.get("hosts") or {}).values():
        if isinstance(info, dict) and info.get("ssh"):
            info["ssh"] = "<host>"
    return json.dumps(state, indent=1)


def redactor(environ: Mapping[str, str] = os.environ, extra: Sequence[str] = (), hosts: Sequence[str] = (),
             users: Sequence[str] = ()) -> Redactor:
    """The redactor for this machine: its credentials, home, user and host names, plus ``extra`` secrets and the
    run's other ``hosts`` and their ``users``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    names = {socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return Redactor.of([*secret_env(environ), *extra], environ.get("HOME"), user, [*names, *hosts], users)


def collect(run: str | None, doctor: tuple[dict[str, Any], str] | None, which: dict[str, Any] | None,
            environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Every file of the bundle (name -> text), not yet redacted."""
    files: dict[str, str] = {}
    run_dir = find_run(run)
    extra: list[str] = []
    remote: tuple[list[str], list[str]] = ([], [])
    if run_dir is not None:
        state_text = _tail(run_dir / "state.json", 100_000)
        state: Any = {}
        try:
            state = json.loads(state_text)
            extra, remote = _argv_secrets(state), _remote_identities(state)
            if fault_lines(state):  # the last error with its log lines, failures by card, cards to reset
                files[f"run/{run_dir.name}/faults.txt"] = "\n".join(fault_lines(state)) + "\n"
            state_text = _state_without_destinations(state)
        except (ValueError, AttributeError):
            pass
        files[f"run/{run_dir.name}/state.json"] = state_text
        mismatch = ((state if isinstance(state, dict) else {}).get("canary") or {}).get("mismatch")
        if mismatch:  # the output canary's evidence: what the route answered against its reference
            files[f"run/{run_dir.name}/canary-mismatch.json"] = json.dumps(mismatch, indent=1)
        for log in sorted(run_dir.glob("*.log")):
            files[f"run/{run_dir.name}/{log.name}"] = _tail(log, LOG_TAIL_LINES)
    if doctor is not None:
        files["doctor.json"] = json.dumps(doctor[0], indent=1, default=str)
        files["doctor.txt"] = doctor[1] + "\n"
    if which is not None:
        files["build.json"] = json.dumps(which, indent=1, default=str)
    for log in sorted(llama_root().glob("build-*.log")) if llama_root().is_dir() else []:
        files[f"builds/{log.name}"] = _tail(log, BUILD_LOG_LINES)
    for sub in ("probe", "observed"):
        for f in sorted((cache_dir() / sub).glob("*.json")) if (cache_dir() / sub).is_dir() else []:
            files[f"{sub}/{f.name}"] = _tail(f, 10_000)
    env = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES)}
    r = redactor(environ, extra, *remote)
    files["env.json"] = json.dumps(r.env(env), indent=1)
    files["system.json"] = json.dumps({"platform": platform.platform(), "python": sys.version.split()[0],
                                       "arcsplit": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       "cpus": os.cpu_count()}, indent=1)
    files["README.txt"] = (
        "arcsplit report: attach this file to a bug report.\n"
        "Credentials, your home directory, user and host names (this machine's and the run's other hosts': their\n"
        "ssh destinations, users and names) were replaced by <redacted>, ~, <user>, <host>.\n"
        "doctor.*: runtime facts, verdict, host checks, mode; probe/, observed/: what was probed or failed here;\n"
        "build.json, builds/: the llama.cpp binaries; run/: the last run's state (its routes, why each was left,\n"
        "and the output canary's evidence of a mismatch: canary-mismatch.json) and log tails (faults.txt: its last\n"
        "error, failures by card and the cards that need a driver reset); env.json: the GPU-related environment.\n")
    return {name: r.text(text) for name, text in files.items()}


def write_bundle(files: Mapping[str, str], out: Path) -> Path:
    """A .tar.gz of ``files`` under one top directory; written beside ``out`` and renamed when complete."""
    if out.is_dir():
        raise BadInput(f"--output {out} is a directory", "name the .tar.gz file to write")
    if not out.parent.is_dir():
        raise BadInput(f"cannot write {out}: {out.parent} does not exist", "pick an existing directory")
    top = out.name.removesuffix(".tar.gz").removesuffix(".tgz") or "arcsplit-report"
    partial = out.with_name(out.name + ".partial")
    try:
        with tarfile.open(partial, "w:gz") as tar:
            for name, text in sorted(files.items()):
                data = text.encode("utf-8")
                info = tarfile.TarInfo(f"{top}/{name}")
                info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
                tar.addfile(info, io.BytesIO(data))
        os.chmod(partial, 0o600)
        partial.replace(out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out
