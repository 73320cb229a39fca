"""The ground truth: load a tiny model onto the chosen cards in the mode in question, and see what happens.

Versions only say what was reported elsewhere; a probe runs the real llama.cpp (``llama-bench``, which loads the
model onto the devices, decodes one token and exits) on these cards, in one of the modes of mode.py, and
classifies what it printed: success, the allocation failure of ggml-org/llama.cpp#22885, a UR error code, a crash in context
creation, a timeout. Every process runs in its own process group and is killed, and the temp dir removed,
on every exit path: success, failure, timeout, Ctrl-C.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import backends
from .._dirs import cache_dir
from ..errors import BadInput, LlamaError
from ..modes import AUTO_ORDER, Mode
from ..netaddr import LOOPBACK, free_port
from ..route import Route
from .childenv import clean_env
from .locate import LlamaBinaries
from .logs import PINNED_OUTPUT_ENV, pinned_output_line
from .mode import NEO_WORKAROUND_ENV

PROBE_MODES: tuple[Mode, ...] = AUTO_ORDER  # what a probe can load: the modes auto chooses among
DEFAULT_TIMEOUT_S = 180.0
CACHE_VERSION = 1

# UR result codes named in the reports (ggml-org/llama.cpp#27063, intel/compute-runtime#916 and #921).
UR_CODES = {
    "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY": 39,
    "UR_RESULT_ERROR_OUT_OF_RESOURCES": 40,
    "UR_RESULT_ERROR_DEVICE_LOST": 20,
    "UR_RESULT_ERROR_UNKNOWN": 2147483646,
}
_UR_NUMERIC = re.compile(r"(?:error|returns):\s*(\d+)\s*\((UR_RESULT_[A-Z_]+)\)")
_UR_TRACE = re.compile(r"(ur[A-Z]\w+)\([^;]*?->\s*(UR_RESULT_ERROR_[A-Z_]+)", re.S)  # spans lines
_ALLOC = (
    re.compile(r"can't allocate (\d+) Bytes of memory on device"),
    re.compile(r"failed to allocate (\S+) buffer of size (\d+)"),
    re.compile(r"unable to allocate (\S+) buffer"),
)
_RPC_FAIL = re.compile(r"Failed to connect to \S+|Remote RPC server crashed|RPC server version mismatch|"
                       r"error: unknown device: \S+|No devices found")
_LOAD_BEGAN = re.compile(r"llama_prepare_model_devices|llama_model_load|load_tensors:|llama_model_loader:")
_ASSIGNED = re.compile(r"assigned to device (\S+?),")
_BUFFER = re.compile(r"^\S*?:\s+(\S+) model buffer size\s*=", re.M)


@dataclass(frozen=True)
class ProbeResult:
    """One probe run. ``status``: ok, alloc_failed, pinned_output (UR 39 copying the output off a card other than
    0: llama.cpp#28765, not NEO), ur_error, context_failed, context_crash, crash, rpc_error, incomplete (a card got
    nothing), error, timeout."""

    mode: str
    ok: bool
    status: str
    detail: str
    ur_code: int | None = None
    returncode: int | None = None
    seconds: float = 0.0
    devices: tuple[str, ...] = ()
    allocated: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    log_tail: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["env"] = dict(self.env)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        d = dict(d)
        d["env"] = tuple(sorted(d.get("env", {}).items()))
        d["devices"] = tuple(d.get("devices", ()))
        d["allocated"] = tuple(d.get("allocated", ()))
        return cls(**d)


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _line_at(text: str, pos: int) -> str:
    end = text.find("\n", pos)
    return text[text.rfind("\n", 0, pos) + 1:end if end >= 0 else len(text)].strip()


def classify(output: str, returncode: int | None, timed_out: bool, devices: Sequence[str] = (),
             device_tokens: dict[str, str] | None = None, timeout_s: float | None = None) -> tuple[str, str, int | None, tuple[str, ...]]:
    """(status, the deciding line, UR code, devices that allocated a model buffer). Pure; tested on real logs."""
    tokens = device_tokens or {}
    buffers = _BUFFER.findall(output)
    allocated = tuple(d for d in devices if any(b == d or (tokens.get(d) and tokens[d] in b) for b in buffers))
    ur_code, ur_line = None, ""
    m = _UR_NUMERIC.search(output)
    if m:
        ur_code, ur_line = int(m.group(1)), _line_at(output, m.start())
    else:
        m = _UR_TRACE.search(output)
        if m:
            ur_code, ur_line = UR_CODES.get(m.group(2)), " ".join(m.group(0).split())
    if timed_out:
        return "timeout", f"no result within {timeout_s:.0f} s" if timeout_s else "timed out", ur_code, allocated
    pinned = pinned_output_line(output)
    if pinned is not None:  # before the UR code: the same error 39, a different cause and remedy
        return ("pinned_output", f"{pinned} - llama.cpp#28765 (output copied off a card other than 0; not the NEO/"
                f"kernel bug): update llama.cpp or set {PINNED_OUTPUT_ENV}=0", ur_code, allocated)
    for pattern in _ALLOC:
        for line in output.splitlines():
            if pattern.search(line):
                return "alloc_failed", line.strip(), ur_code, allocated
    if ur_code is not None:
        status = "context_failed" if ur_code == UR_CODES["UR_RESULT_ERROR_UNKNOWN"] else "ur_error"
        return status, ur_line, ur_code, allocated
    m = _RPC_FAIL.search(output)
    if m:
        return "rpc_error", m.group(0), None, allocated
    crashed = returncode is not None and (returncode < 0 or returncode in (134, 139))
    if crashed and returncode is not None:
        how = _signal_name(returncode) if returncode < 0 else f"exit {returncode}"
        if not _LOAD_BEGAN.search(output):
            return "context_crash", f"crashed ({how}) before loading the model: device/context initialisation", None, allocated
        return "crash", f"crashed ({how}) while loading or running the model", None, allocated
    if returncode != 0:
        last = next((l.strip() for l in reversed(output.splitlines()) if l.strip()), "")
        return "error", f"exit {returncode}: {last[:200]}", None, allocated
    missing = [d for d in devices if d not in allocated]
    if buffers and missing:
        return "incomplete", f"no model buffer on {', '.join(missing)}: the probe did not test every card", None, allocated
    return "ok", "loaded on " + (", ".join(allocated) if allocated else "the devices (per-device buffers not shown)"), None, allocated


# ----------------------------------------------------------------------------------------------------------
# Process plumbing


@dataclass
class _Proc:
    popen: subprocess.Popen
    log: Path


def _spawn(argv: list[str], env: dict[str, str], log: Path, procs: list[_Proc], base: dict[str, str]) -> _Proc:
    """Own session (process group) so the whole tree can be killed; SIGPIPE stays ignored (rpc-server dies of
    it when a client vanishes: docs/llama-cpp-notes.md). ``base``: the cleaned environment (childenv.py), as
    served groups get it. Registered in ``procs`` at once, for the cleanup."""
    fh = open(log, "wb")
    try:
        proc = _Proc(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                      env={**base, **env}, start_new_session=True, restore_signals=False), log)
        procs.append(proc)
    finally:
        fh.close()
    return proc


def _kill(proc: _Proc, grace: float = 2.0) -> None:
    p = proc.popen
    try:
        pgid = os.getpgid(p.pid)
    except ProcessLookupError:
        pgid = None
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(timeout=wait)
            if sig == signal.SIGTERM and pgid is not None:
                try:  # the leader is gone; make sure nothing else of its group is left
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_listening(proc: _Proc, port: int, deadline: float) -> str | None:
    """None when the port accepts; else why not. A bare connect-and-close is safe before the client connects."""
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            return f"rpc-server exited {proc.popen.returncode}: {_tail(proc.log, 3)}"
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return None
        except OSError:
            time.sleep(0.1)
    return "rpc-server did not listen in time"


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


@dataclass(frozen=True)
class ProbePlan:
    """What one probe runs: rpc-servers (one per card, each seeing only its card) and one llama-bench."""

    mode: str
    servers: tuple[tuple[str, dict[str, str]], ...]  # (card label, env) per rpc-server
    bench_env: dict[str, str]
    local_devices: tuple[str, ...]
    env_extra: dict[str, str] = field(default_factory=dict)


def plan_probe(mode: str, backend: str, gpus: Sequence[int], env_extra: dict[str, str] | None = None) -> ProbePlan:
    """The probe of ``mode``: the same Route serve would run (rpc-servers, llama-bench in llama-server's place)."""
    if mode not in PROBE_MODES:
        raise BadInput(f"unknown probe mode {mode!r}", f"use one of {', '.join(PROBE_MODES)}")
    if len(gpus) < 2 and mode != Mode.RPC:
        raise BadInput(f"probing {mode} needs at least 2 cards", "pass --gpus with 2+ cards")
    be = backends.get(backend)
    extra = dict(env_extra or {})
    if mode == Mode.MULTI_WORKAROUND:
        if not be.one_context_workaround:
            having = ", ".join(b.name for b in backends.REGISTRY.values() if b.one_context_workaround)
            raise BadInput(f"the NEO workaround exists only for {having}", "probe multi, hybrid or rpc")
        extra = {**NEO_WORKAROUND_ENV, **extra}
    if be.on_cpu and mode != Mode.RPC:
        raise BadInput(f"the CPU backend has no {mode} mode to probe", "probe rpc (one rpc-server per CPU card)")
    route = Route.build(mode, backend, list(gpus))
    label = "CPU" if be.on_cpu else backend
    servers = tuple((f"{label} card {route.cards[p.cards[0]].index}", dict(p.env)) for p in route.rpc)
    # llama-bench sees what llama-server would see, so it never builds a context over more cards than that.
    return ProbePlan(mode, servers, {**dict(route.server.env), **extra}, route.server.devices, extra)


def run_probe(mode: str, backend: str, gpus: Sequence[int], binaries: LlamaBinaries, model: Path,
              timeout: float = DEFAULT_TIMEOUT_S, env_extra: dict[str, str] | None = None) -> ProbeResult:
    """Run one probe. Never raises for a failing runtime: that is a result. Cleans up on every path."""
    if binaries.bench is None:
        raise LlamaError(f"no llama-bench next to {binaries.server}", "rebuild with `arcsplit llama build` (it builds llama-bench)")
    plan = plan_probe(mode, backend, gpus, env_extra)
    start = time.monotonic()
    deadline = start + timeout
    workdir = Path(tempfile.mkdtemp(prefix="arcsplit-probe-"))
    procs: list[_Proc] = []
    base, _ = clean_env(backend, os.environ)
    try:
        endpoints: list[str] = []
        for i, (label, env) in enumerate(plan.servers):
            port = free_port()
            proc = _spawn([str(binaries.rpc_server), "-H", LOOPBACK, "-p", str(port)], env,
                          workdir / f"rpc-{i}.log", procs, base)
            why = _wait_listening(proc, port, deadline)
            if why is not None:
                timed_out = time.monotonic() >= deadline
                return ProbeResult(mode, False, "timeout" if timed_out else "rpc_error", f"{label}: {why}",
                                   seconds=round(time.monotonic() - start, 2), env=tuple(sorted(plan.env_extra.items())),
                                   log_tail=_tail(proc.log))
            endpoints.append(f"{LOOPBACK}:{port}")
        rpc_devices = tuple(f"RPC{k}" for k in range(len(endpoints)))
        devices = plan.local_devices + rpc_devices
        tokens = {f"RPC{k}": f"[{ep}]" for k, ep in enumerate(endpoints)}
        n = len(devices)
        argv = [str(binaries.bench), "-m", str(model)]
        if endpoints:
            argv += ["--rpc", ",".join(endpoints)]  # before -dev: llama-bench resolves devices while parsing
        argv += ["-dev", "/".join(devices), "-ngl", "99", "-ts", "/".join(["1"] * n),
                 "-p", "0", "-n", "1", "-r", "1", "--no-warmup", "-v", "-o", "md"]
        bench = _spawn(argv, plan.bench_env, workdir / "bench.log", procs, base)
        timed_out = False
        try:
            rc: int | None = bench.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
        output = bench.log.read_text(errors="replace")
        if not timed_out and rc != 0:  # a dying rpc-server explains a client failure
            output += "\n" + "\n".join(p.log.read_text(errors="replace") for p in procs[:-1])
        status, detail, code, allocated = classify(output, rc, timed_out, devices, tokens, timeout)
        return ProbeResult(mode, status == "ok", status, detail, code, rc, round(time.monotonic() - start, 2),
                           devices, allocated, tuple(sorted(plan.env_extra.items())), _tail(bench.log))
    finally:
        for proc in reversed(procs):
            _kill(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def probe_model(dest: Path, n_cards: int) -> Path:
    """A tiny GGUF with enough layers that every card gets some (arcsplit.synth writes it)."""
    from ..synth import write_llama  # start-up: numpy and gguf's writer; `arcsplit --help` imports this module

    path = dest / "probe.gguf"
    write_llama(path, n_layer=max(4, 2 * n_cards), n_embd=64)
    return path


def run_probes(modes: Sequence[str], backend: str, gpus: Sequence[int], binaries: LlamaBinaries,
               timeout: float = DEFAULT_TIMEOUT_S, stop_on_success: bool = True,
               workaround_env: dict[str, str] | None = None,
               progress: Callable[[str], None] = lambda line: None) -> list[ProbeResult]:
    """Probe ``modes`` in order (fastest first) with one generated model; stop at the first that works.
    ``progress`` hears a line before and after each probe: one can take up to ``timeout`` seconds."""
    workdir = Path(tempfile.mkdtemp(prefix="arcsplit-probe-model-"))
    results = []
    try:
        model = probe_model(workdir, len(gpus))
        for i, mode in enumerate(modes, 1):
            extra = workaround_env if mode == Mode.MULTI_WORKAROUND else None
            progress(f"probe {i}/{len(modes)}: {mode} on {len(gpus)} {backend} cards (up to {timeout:.0f} s) …")
            r = run_probe(mode, backend, gpus, binaries, model, timeout, extra)
            progress(f"probe {i}/{len(modes)}: {mode} {'works' if r.ok else r.status} after {r.seconds:.1f} s")
            results.append(r)
            if r.ok and stop_on_success:
                break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------------------------------------
# Cache: a probe costs a model load per mode; its answer only changes when the runtime or the cards do.


def cache_key(neo: str | None, kernel: str | None, llama_build: str | None, backend: str,
              cards: Sequence[str]) -> dict[str, Any]:
    return {"v": CACHE_VERSION, "neo": neo, "kernel": kernel, "llama_build": llama_build, "backend": backend,
            "cards": list(cards)}


def _cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "probe" / f"{digest}.json"


def load_cached(key: dict[str, Any]) -> tuple[list[ProbeResult], str] | None:
    """(results, ISO timestamp) or None; a damaged cache file is ignored, never fatal."""
    path = _cache_path(key)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        return [ProbeResult.from_dict(r) for r in data["results"]], str(data["timestamp"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(key: dict[str, Any], results: Sequence[ProbeResult]) -> Path:
    path = _cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    payload = {"key": key, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "results": [r.to_dict() for r in results]}
    try:
        tmp.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
