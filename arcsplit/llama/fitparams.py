"""llama-fit-params as an oracle: what llama.cpp itself says a split needs per device, without loading weights.

Runs ``llama-fit-params -fitp on`` against ggml-rpc-servers on 127.0.0.1 and parses its
``<dev> <model MiB> <context MiB> <compute MiB>`` lines. ``arcsplit plan --measure`` takes each card's compute
buffer from it (``measure_compute``; cached by llama/compute_cache.py); bench/plan_accuracy.py and the accuracy
tests use it to keep the header-only formulas honest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import backends
from ..errors import BadInput, LlamaError
from ..memory import ctx_class
from ..modes import Mode
from ..netaddr import LOOPBACK, free_port
from ..roles import Role
from ..route import HOST_DEVICE, Route
from .childenv import clean_env
from .locate import LlamaBinaries

if TYPE_CHECKING:
    from ..planner import Plan


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


class RpcServers:
    """N rpc-servers on 127.0.0.1 for the oracle; a context manager that stops exactly what it started.

    ``envs``: each one's environment (the cards it may see, Route's visibility); default: this process's."""

    def __init__(self, binaries: LlamaBinaries, n: int = 2, envs: list[dict[str, str]] | None = None) -> None:
        self.binaries, self.n, self.envs = binaries, n, envs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.endpoints: list[str] = []

    def __enter__(self) -> "RpcServers":
        for k in range(self.n):
            port = free_port()
            proc = subprocess.Popen(
                [str(self.binaries.rpc_server), "-H", LOOPBACK, "-p", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.envs[k] if self.envs else None,
                preexec_fn=lambda: signal.signal(signal.SIGPIPE, signal.SIG_IGN),
            )
            self.procs.append(proc)
            self.endpoints.append(f"{LOOPBACK}:{port}")
        for ep, proc in zip(self.endpoints, self.procs):
            host, port_text = ep.split(":")
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    self.__exit__(None, None, None)
                    raise LlamaError(f"rpc-server on {ep} exited at start", "check the port and the build")
                try:
                    with socket.create_connection((host, int(port_text)), timeout=0.5):
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
              timeout: float = 120, env: dict[str, str] | None = None) -> tuple[dict[str, FitRow], float]:
    """Run ``llama-fit-params -fitp on`` over ``rpc``'s devices (and the ones ``env`` lets it see) with ``args``;
    returns (rows, seconds)."""
    if binaries.fit_params is None:
        raise LlamaError("this llama.cpp build has no llama-fit-params", "rebuild with the llama-fit-params target")
    cmd = [str(binaries.fit_params), "-m", str(model), *(["--rpc", ",".join(rpc.endpoints)] if rpc.endpoints else []),
           "-fitp", "on", *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    secs = time.perf_counter() - t0
    rows = parse_fit_print(out.stdout)
    if out.returncode != 0 or not rows:
        # its argument errors end with a usage text whose last line says nothing: name the "error" line instead
        lines = (out.stderr or out.stdout).strip().splitlines()
        why = next((ln.strip() for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output")
        raise LlamaError(f"llama-fit-params failed: {why}", "check the model and arguments")
    return rows, secs


def measure_compute(binaries: LlamaBinaries, plan: "Plan", route: Route | None = None, at: int | None = None,
                    timeout: float = 300) -> dict[tuple[int, ...], int]:
    """llama.cpp's own compute buffer of every offloaded card of ``plan``, from one ``llama-fit-params -fitp on`` dry
    run at context ``at`` (default: the top of the plan's context class, memory.ctx_class). Keys as in
    memory.MeasuredCompute.entries.

    ``route``: the plan's own Route, its cards present and ``binaries`` of its backend: each card where serve would
    have it (rpc-servers with their visibility, the dry run with llama-server's). None: every card an rpc-server
    of ``binaries`` (the CPU build: CPU devices standing in for cards that are absent).
    llama-fit-params prints whole MiB, rounded down: one MiB more keeps each value an upper bound.
    """
    o = plan.options
    if o.n_parallel > 1 and o.kv_unified:
        raise BadInput("llama-fit-params cannot measure a unified KV cache over several slots (it has no "
                       "--kv-unified)", "measure with --no-kv-unified, or plan without --measure")
    cards = [(j, c) for j, c in enumerate(plan.cards) if c.device != HOST_DEVICE]
    if route is None:
        route = Route.build(Mode.RPC, backends.CPU, list(range(len(cards))))
        names = [f"RPC{i}" for i in range(len(cards))]
    else:
        names = [c.device for _, c in cards]
    base, _ = clean_env(route.backend, os.environ)
    rpcs = [p for p in route.processes if p.role == Role.RPC]
    server = next(p for p in route.processes if p.role == Role.SERVER)
    args = plan.llama_server_args(names)
    drop = {"--kv-unified": 0, "--no-kv-unified": 0, "--fit": 1}
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in drop:
            i += 1 + drop[args[i]]
            continue
        out.append(str(at or ctx_class(plan.n_ctx)) if i and args[i - 1] == "-c" else args[i])
        i += 1
    cls = at or ctx_class(plan.n_ctx)
    with RpcServers(binaries, len(rpcs), [{**base, **dict(p.env)} for p in rpcs]) as rpc:
        rows, _ = fit_print(binaries, plan.model_path, rpc, out, timeout, env={**base, **dict(server.env)})
    got: dict[tuple[int, ...], int] = {}
    for name, (j, c) in zip(names, cards):
        row = rows.get(name)
        if row is None:
            raise LlamaError(f"llama-fit-params printed no line for {name}", "check the build and the model")
        got[(cls, o.moe_offload or 0, j, c.first_layer, c.end_layer)] = (row.compute_mib + 1) * 1024 * 1024
    return got
