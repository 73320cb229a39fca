"""Time to ready: arcsplit's supervisor vs the same commands started by hand.

    python bench/time_to_ready.py [--runs 5] [--model PATH] [--gpus 0,1] [--mode rpc]

"By hand" starts the rpc-servers and llama-server with exactly the argv arcsplit would use, waits for each
rpc-server port to accept (else llama-server aborts), then polls /health every 50 ms until 200. arcsplit runs
the Supervisor (exec shim, line buffering, probes, health poll). Runs alternate; medians are compared
(target <= 1.05x). Also reports the full `arcsplit serve` command (Python start-up and planning included).
Writes bench/results/time_to_ready.md. Needs ARCSPLIT_LLAMA_DIR or a managed CPU build.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arcsplit.cli import build_parser  # noqa: E402
from arcsplit.cli.serve import build_config  # noqa: E402
from arcsplit.run.ports import free_port  # noqa: E402
from arcsplit.run.specs import ROUTER_PORT_ENV, build_specs, n_rpc_servers  # noqa: E402
from arcsplit.run.supervisor import Supervisor  # noqa: E402


def serve_argv(a: argparse.Namespace, port: int) -> list[str]:
    return ["serve", a.model, "--backend", "cpu", "--gpus", a.gpus, "--mode", a.mode, "--ctx", str(a.ctx),
            "--threads", "1", "--port", str(port)]


def wait_port(host: str, port: int) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.02)


def by_hand(config) -> float:
    ports = [free_port() for _ in range(n_rpc_servers(config))]
    specs = build_specs(config, ports)
    t0 = time.perf_counter()
    procs = []
    try:
        for s in specs[:-1]:
            procs.append(subprocess.Popen(s.argv, env={**os.environ, **s.env_dict}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        for s in specs[:-1]:
            wait_port(s.host, s.port)
        server = specs[-1]
        env = {k: v for k, v in server.env if k != ROUTER_PORT_ENV}  # by hand: no router protocol on stdin
        procs.append(subprocess.Popen(server.argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{server.port}/health"
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def through_arcsplit(config) -> float:
    async def main() -> float:
        t0 = time.perf_counter()
        async with Supervisor(config):
            return time.perf_counter() - t0

    return anyio.run(main)


def through_cli(a: argparse.Namespace) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "arcsplit", *serve_argv(a, free_port())], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    dt = time.perf_counter() - t0
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    if "serving" not in line:
        raise SystemExit(f"arcsplit serve did not become ready: {line!r}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--mode", default="rpc")
    ap.add_argument("--ctx", type=int, default=1024)
    a = ap.parse_args()
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    hand, sup, cli = [], [], []
    for i in range(a.runs):
        config, _, _, _ = build_config(build_parser().parse_args(serve_argv(a, free_port())))
        routes = [(hand, lambda: by_hand(config)), (sup, lambda: through_arcsplit(config)), (cli, lambda: through_cli(a))]
        for k in range(3):  # rotate the order: whoever runs first after a teardown pays for it
            results, fn = routes[(i + k) % 3]
            results.append(fn())
        print(f"run {i + 1}: by hand {hand[-1]:.3f} s, supervisor {sup[-1]:.3f} s, arcsplit serve {cli[-1]:.3f} s",
              flush=True)
    mh, ms, mc = statistics.median(hand), statistics.median(sup), statistics.median(cli)
    ratio = ms / mh
    verdict = "meets" if ratio <= 1.05 else "misses"
    text = f"""# Time to ready: arcsplit vs by hand

Model `{Path(a.model).name}`, backend cpu, --gpus {a.gpus}, mode {a.mode}, ctx {a.ctx}, rpc-server -t 1,
{a.runs} runs each, order rotated per run; {os.cpu_count()} cores. Ready = /health 200 (by hand: the same argv, rpc ports
polled every 20 ms, /health every 50 ms).

| route | median s | runs |
|---|---|---|
| by hand | {mh:.3f} | {', '.join(f'{x:.3f}' for x in hand)} |
| arcsplit Supervisor | {ms:.3f} | {', '.join(f'{x:.3f}' for x in sup)} |
| `arcsplit serve` (incl. Python start-up, model header, plan) | {mc:.3f} | {', '.join(f'{x:.3f}' for x in cli)} |

Supervisor / by hand: **{ratio:.3f}x** ({verdict} the 1.05x target). `arcsplit serve` / by hand: {mc / mh:.3f}x.
"""
    out = ROOT / "bench" / "results" / "time_to_ready.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
