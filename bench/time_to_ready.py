"""Time to ready: arcsplit's supervisor vs the same commands started by hand.

    python bench/time_to_ready.py [--runs 5] [--model PATH] [--gpus 0,1] [--mode rpc]

"By hand" starts the rpc-servers and llama-server with exactly the argv arcsplit would use, waits for each
rpc-server port to accept (else llama-server aborts), then polls /health every 50 ms until 200. arcsplit runs
the Supervisor (exec shim, line buffering, probes, health poll). Runs alternate; medians are compared
(target <= 1.05x). Also reports the full `arcsplit serve` command (Python start-up and planning included).
Writes bench/results/time_to_ready.md. Needs ARCSPLIT_LLAMA_DIR or a managed CPU build.

    python bench/time_to_ready.py --load [--runs 3] [--synth-gb 3] [--routes native,hybrid,rpc]

``--load`` compares instead how long a group takes to load over RPC: native (one llama-server) against hybrid and
all-RPC with the weights sent over the socket (``--no-rpc-seed``, stock llama.cpp's way) and read by the
rpc-servers from the GGUF (patch 0006, arcsplit's default), each run a fresh group, greedy tokens checked against
native. ``--synth-gb`` writes (once) a synthetic F16 Llama of that size under arcsplit's cache. Writes
bench/results/load_time.md.
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

from _group import group, prepared  # noqa: E402
from _report import write_report  # noqa: E402
from arcsplit.llama.patches import rpc_sets_in_pieces, rpc_sets_in_place  # noqa: E402
from arcsplit._api import Prepared, planned_specs  # noqa: E402
from arcsplit.decide.specs import ROUTER_PORT_ENV  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402


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


def serve_request(a: argparse.Namespace) -> Prepared:
    """What serve_argv asks for, prepared as ``arcsplit serve`` would."""
    return prepared(a.model, backend="cpu", gpus=a.gpus, mode=a.mode, ctx=a.ctx, threads=1, port=free_port())


def by_hand(p: Prepared) -> float:
    specs = planned_specs(p)  # the argv arcsplit would use, on ports free now
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


def through_arcsplit(p: Prepared) -> float:
    async def main() -> float:
        t0 = time.perf_counter()
        async with group(p):
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


def load_model(gb: float, wide: bool = False) -> Path:
    """A synthetic F16 Llama of about ``gb`` GB, written once under arcsplit's cache so every run and
    bench/recover.py load the same file: 2048 wide, 32k vocabulary (big tensors 2-22 MiB), or ``wide``, a 7B
    Llama's layers (4096 wide, feed-forward 11008: those tensors 86 MiB, embeddings and output 250 MiB each)."""
    from arcsplit._dirs import cache_dir
    from arcsplit.synth import write_llama

    if wide:  # 404 MB per layer, 524 MB of embeddings and output
        n_layer = max(1, round((gb * 1e9 - 524e6) / 404e6))
        shape = dict(n_embd=4096, n_head=32, n_head_kv=8, n_ff=11008)
        path = cache_dir() / "models" / f"bench-llama7bw-{n_layer}l-f16.gguf"
    else:  # 90.2 MB per layer, 262 MB of embeddings and output
        n_layer = max(2, round((gb * 1e9 - 262e6) / 90.2e6))
        shape = dict(n_embd=2048, n_head=16, n_head_kv=4, n_ff=5632)
        path = cache_dir() / "models" / f"bench-llama-{n_layer}l-f16.gguf"
    if not path.exists():
        tmp = path.with_suffix(".partial.gguf")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_llama(tmp, n_layer=n_layer, n_vocab=32000, ctx=4096, reuse_random=True, **shape)
        tmp.rename(path)
    return path


GREEDY_PROMPT = "The three primary colors are"


def peak_mib(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), in MiB; 0 where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ready_and_tokens(p: Prepared, n_predict: int) -> tuple[float, list[int], float]:
    """Seconds until the Supervisor's group answers /health 200, greedy tokens from it, and the largest peak
    resident memory of its rpc-servers in MiB (0 without one)."""
    async def main() -> tuple[float, list[int], float]:
        t0 = time.perf_counter()
        async with group(p) as inst:
            dt = time.perf_counter() - t0
            async with httpx.AsyncClient(timeout=600) as client:
                r = await client.post(f"{p.config.url}/completion", json={
                    "prompt": GREEDY_PROMPT, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "return_tokens": True})
                r.raise_for_status()
            procs = inst.supervisor.status()["processes"].values()
            peak = max((peak_mib(m["pid"]) for m in procs if m["role"] == "rpc" and m["pid"]), default=0.0)
            return dt, r.json()["tokens"], peak

    return anyio.run(main)


COPIED = "socket, copied first"  # --copied's case: weights over the socket, each copied first (patch 0014 off)
WHOLE = "socket, received whole"  # --whole-sets' case: each set above 64 MiB received whole (patch 0003's pieces off)


def load_bench(a: argparse.Namespace) -> int:
    """--load: time to ready per route, weights over the socket vs read from the GGUF (patch 0006)."""
    from arcsplit.decide import weightcache
    from arcsplit.llama import seeding

    ways = ("socket",) + (COPIED,) * a.copied + (WHOLE,) * a.whole_sets + ("seed",)
    cases = [("native", "-")] + [(r, w) for r in a.routes.split(",") if r != "native" for w in ways]

    def config_of(route: str, weights: str) -> Prepared:
        gpus = a.gpus.split(",")[0] if route == "native" else a.gpus
        p = prepared(a.model, backend="cpu", gpus=gpus, mode="single" if route == "native" else route, ctx=a.ctx,
                     threads=1, port=free_port(), cpu_memory_mib=a.cpu_memory, rpc_seed=not weights.startswith("socket"))
        if weights == "seed" and not p.config.rpc_seed:
            raise SystemExit(f"{p.config.rpc_bin} cannot seed its cache (a build without patch "
                             f"{seeding.PATCH}); `arcsplit llama build` makes one")
        return p

    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    same: dict[tuple[str, str], list[bool]] = {c: [] for c in cases}
    peaks: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    first_seed: list[str] = []
    for route, weights in cases:  # the first start of a seeded group indexes the file: timed once, apart
        if weights == "seed":
            index = weightcache.index_of(a.model, config_of(route, weights).config.rpc_cache_dir)
            if index is not None:
                index.unlink(missing_ok=True)
            t0 = time.perf_counter()
            config = config_of(route, weights)  # serve's preparation indexes the new file (rpc-server --seed-only)
            took = time.perf_counter() - t0
            dt, _, _ = ready_and_tokens(config, 1)
            first_seed.append(f"{route}: preparation {took:.2f} s (indexing included), then ready after {dt:.2f} s")
            print(f"{route} seed, first start: {first_seed[-1]}", flush=True)
    for i in range(a.runs):
        for k in range(len(cases)):  # rotate the order: whoever runs first after a teardown pays for it
            case = cases[(i + k) % len(cases)]
            with rpc_sets_in_place(case[1] != COPIED), rpc_sets_in_pieces(case[1] != WHOLE):
                dt, tokens, peak = ready_and_tokens(config_of(*case), a.n_predict)
            times[case].append(dt)
            peaks[case].append(peak)
            same[case].append(tokens)  # compared with native's below
            print(f"run {i + 1}: {case[0]} {case[1]}: ready after {dt:.2f} s", flush=True)
    ref = same[("native", "-")][0]
    nat = statistics.median(times[("native", "-")])
    rows = []
    for case in cases:
        xs = times[case]
        ident = all(t == ref for t in same[case])
        peak = f"{max(peaks[case]):.0f}" if max(peaks[case]) else "-"
        rows.append(f"| {case[0]} | {case[1]} | {min(xs):.2f} / **{statistics.median(xs):.2f}** / {max(xs):.2f} | "
                    f"{statistics.median(xs) / nat:.2f}x | {peak} | {'yes' if ident else '**no**'} |")
    size = Path(a.model).stat().st_size / 1e9
    text = f"""# Time to ready over RPC: weights over the socket vs read from the GGUF (patch 0006)

Model `{Path(a.model).name}` ({size:.2f} GB, F16), backend cpu, native = mode single on one CPU card; hybrid and
all-RPC on --gpus {a.gpus} (CPU cards, rpc-servers on loopback, -t 1), ctx {a.ctx}; {a.runs} runs, every case a fresh
group per run, order rotated; {os.cpu_count()} cores shared with other work. Ready = the Supervisor's /health 200.
rpc-server peak MiB = the largest of the group's rpc-servers' peak resident memory (VmHWM), highest over the runs.
The GGUF sits in the page cache in every run (so does native's), so "disk speed" here is page-cache speed.
socket = `--no-rpc-seed` (stock llama.cpp: every weight through the socket); seed = arcsplit's default with a
build carrying patch 0006 (`rpc-server -c --seed-cache <gguf>`, llama-server with GGML_RPC_FNV_INDEX).
socket, copied first = socket with ARCSPLIT_RPC_IN_PLACE=0: llama-server copies every weight into a zero-filled block
of its own before it is sent, as stock does (the socket rows send each from where it lies, patch 0014).
socket, received whole = socket with ARCSPLIT_RPC_SET_PIECES=0: each rpc-server receives a weight above 64 MiB into a
zero-filled block of its whole size before copying it, as stock does (the socket rows receive it in pieces, patch 0003).

| route | weights | ready s, min / **median** / max | median / native | rpc-server peak MiB | greedy tokens = native ({a.n_predict}) |
|---|---|---|---|---|---|
{chr(10).join(rows)}

First start of a seeded group (serve's preparation indexes the file with `rpc-server --seed-only`: FNV-1a over
every tensor from 1 MiB, on all cores; later starts and restarts reuse the index): {'; '.join(first_seed)}.

Command: `python bench/time_to_ready.py --load --runs {a.runs} --model {a.model} --gpus {a.gpus}{' --copied' if a.copied else ''}{' --whole-sets' if a.whole_sets else ''}`
"""
    name = "load_time_pieces.md" if a.whole_sets else "load_time_inplace.md" if a.copied else "load_time.md"
    write_report(ROOT / "bench" / "results" / name, text)
    return 0 if all(t == ref for ts in same.values() for t in ts) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--mode", default="rpc")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--load", action="store_true", help="time to ready per route, weights over the socket vs seeded")
    ap.add_argument("--routes", default="native,hybrid,rpc", help="--load: the routes (native always runs)")
    ap.add_argument("--synth-gb", type=float, default=None, help="a synthetic F16 model of about this size")
    ap.add_argument("--cpu-memory", type=int, default=8192, help="--load: MiB per CPU card")
    ap.add_argument("--n-predict", type=int, default=4, help="--load: greedy tokens compared with native")
    ap.add_argument("--copied", action="store_true",
                    help="--load: a case with each weight copied before it is sent too (patch 0014 off); written to "
                         "bench/results/load_time_inplace.md")
    ap.add_argument("--whole-sets", action="store_true",
                    help="--load: a case with each set above 64 MiB received whole by the rpc-servers (patch 0003's "
                         "pieces off); written to bench/results/load_time_pieces.md")
    ap.add_argument("--synth-wide", action="store_true",
                    help="--synth-gb: a 7B Llama's layer shapes (feed-forward tensors of 86 MiB) instead of 2048 wide")
    a = ap.parse_args()
    if a.synth_gb:
        a.model = str(load_model(a.synth_gb, wide=a.synth_wide))
    if a.load:
        return load_bench(a)
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    hand, sup, cli = [], [], []
    for i in range(a.runs):
        p = serve_request(a)
        routes = [(hand, lambda: by_hand(p)), (sup, lambda: through_arcsplit(p)), (cli, lambda: through_cli(a))]
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
