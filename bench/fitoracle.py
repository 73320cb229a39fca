"""llama-fit-params as an oracle: what llama.cpp itself says a split needs per device, without loading weights.

Runs ``llama-fit-params -fitp on`` against ggml-rpc-servers on 127.0.0.1 (the CPU build has no other devices)
and parses its ``<dev> <model MiB> <context MiB> <compute MiB>`` lines. Used by bench/plan_accuracy.py,
plan_speed.py, fit_context.py and tests/test_plan_accuracy.py to keep the planner honest; never by arcsplit itself,
so it lives here, beside its users, not in the package.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from arcsplit.errors import LlamaError
from arcsplit.llama.locate import LlamaBinaries


@dataclass(frozen=True)
class FitRow:
    device: str
    model_mib: int
    context_mib: int
    compute_mib: int


def parse_fit_print(text: str) -> dict[str, FitRow]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and all(p.lstrip("-").isdigit() for p in parts[1:]):
            rows[parts[0]] = FitRow(parts[0], int(parts[1]), int(parts[2]), int(parts[3]))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServers:
    """N CPU rpc-servers on 127.0.0.1 for the oracle; a context manager that stops exactly what it started."""

    def __init__(self, binaries: LlamaBinaries, n: int = 2) -> None:
        self.binaries, self.n = binaries, n
        self.procs: list[subprocess.Popen[bytes]] = []
        self.endpoints: list[str] = []

    def __enter__(self) -> "RpcServers":
        for _ in range(self.n):
            port = _free_port()
            proc = subprocess.Popen(
                [str(self.binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=lambda: signal.signal(signal.SIGPIPE, signal.SIG_IGN),
            )
            self.procs.append(proc)
            self.endpoints.append(f"127.0.0.1:{port}")
        for ep, proc in zip(self.endpoints, self.procs):
            host, port = ep.split(":")
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    self.__exit__(None, None, None)
                    raise LlamaError(f"rpc-server on {ep} exited at start", "check the port and the build")
                try:
                    with socket.create_connection((host, int(port)), timeout=0.5):
                        break  # a bare connect-and-close is a safe readiness probe before a client connects
                except OSError:
                    if time.monotonic() > deadline:
                        self.__exit__(None, None, None)
                        raise LlamaError(f"rpc-server on {ep} did not listen", "check the build") from None
                    time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def fit_print(binaries: LlamaBinaries, model: str | Path, rpc: RpcServers, args: list[str],
              timeout: float = 120) -> tuple[dict[str, FitRow], float]:
    """Run ``llama-fit-params -fitp on`` over ``rpc``'s devices with ``args``; returns (rows, seconds)."""
    if binaries.fit_params is None:
        raise LlamaError("this llama.cpp build has no llama-fit-params", "rebuild with the llama-fit-params target")
    cmd = [str(binaries.fit_params), "-m", str(model), "--rpc", ",".join(rpc.endpoints), "-fitp", "on", *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    secs = time.perf_counter() - t0
    rows = parse_fit_print(out.stdout)
    if out.returncode != 0 or not rows:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LlamaError(f"llama-fit-params failed: {tail[0]}", "check the model and arguments")
    return rows, secs
