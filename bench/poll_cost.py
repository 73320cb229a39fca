"""What the RPC link's polling (patch 0005, ARCSPLIT_RPC_SPIN_US) costs in CPU: cores busy per token and idle.

    python bench/poll_cost.py [--modes hybrid,rpc] [--spin-us 20000] [--tokens 64] [--reps 3] [--idle 5] [--out FILE]
    python bench/poll_cost.py --backend cuda --same-card --model M.gguf   # one GPU: every process on card 0

Patch 0005 lets the threads that wait on an RPC link poll (yielding the core) for up to N microseconds before
they sleep. arcsplit sets N = 20000 on GPU groups of a machine with at least 8 cores, never on the CPU backend.
Its price is CPU time. On the CPU build (the default) the cards are the cores; with --backend cuda --same-card the
group's processes share one GPU (as bench/throughput.py --same-card), which is what arcsplit's default applies to.
For each mode, polling off (0) and on (N), every process of the group (llama-server and each rpc-server, all
threads, user + system time from /proc):

- during a greedy decode of --tokens tokens: CPU milliseconds per token and cores busy (CPU time / wall time);
- idle, for --idle seconds from the moment the last reply arrived (the polling tail after the last message
  included): cores busy.

The same build, the same run; only ARCSPLIT_RPC_SPIN_US differs. Writes bench/results/poll_cost.md
(poll_cost_<backend>.md for a GPU backend).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import arcsplit  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.patches import rpc_link_polling  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from throughput import build_line, same_card_rig  # noqa: E402
from _report import write_report  # noqa: E402  (bench/ is sys.path[0] when run as a script)

PROMPT = "Once upon a time"


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def measure(model: str, mode: str, spin_us: int, tokens: int, reps: int, idle: float, backend: str = "cpu",
            same_card: bool = False) -> dict[str, list[float]]:
    """Per repetition: CPU ms per token and cores busy while decoding, then cores busy while idle."""
    rig = same_card_rig(0, 2) if same_card else contextlib.nullcontext()
    threads = 1 if backend == "cpu" else None
    with rpc_link_polling(spin_us), rig, \
            arcsplit.serve(model, gpus=[0, 1], backend=backend, mode=mode, ctx=2048, parallel=1, threads=threads,
                           port=free_port(), bus=False) as server, httpx.Client(timeout=300) as client:
        procs = [psutil.Process(p["pid"]) for p in server.status()["processes"].values()]
        body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
        client.post(f"{server.url}/completion", json=body).raise_for_status()  # warm-up
        out: dict[str, list[float]] = {"ms/token": [], "cores decoding": [], "cores idle": [], "tok/s": []}
        for _ in range(reps):
            c0, t0 = cpu_seconds(procs), time.perf_counter()
            r = client.post(f"{server.url}/completion", json=body)
            r.raise_for_status()
            c1, t1 = cpu_seconds(procs), time.perf_counter()
            n = int(r.json()["timings"]["predicted_n"])
            out["ms/token"].append((c1 - c0) * 1000 / n)
            out["cores decoding"].append((c1 - c0) / (t1 - t0))
            out["tok/s"].append(float(r.json()["timings"]["predicted_per_second"]))
            time.sleep(idle)
            c2, t2 = cpu_seconds(procs), time.perf_counter()
            out["cores idle"].append((c2 - c1) / (t2 - t1))
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo Gemma 3 270M)")
    ap.add_argument("--modes", default="hybrid,rpc")
    ap.add_argument("--spin-us", type=int, default=20000, help="the polling row's ARCSPLIT_RPC_SPIN_US")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds measured idle after each decode")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--same-card", action="store_true",
                    help="one GPU: llama-server and the rpc-servers all on card 0 (as bench/throughput.py --same-card)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.spin_us < 1 or a.tokens < 1 or a.reps < 1 or a.idle <= 0:
        ap.error("--spin-us, --tokens, --reps and --idle must be positive")
    if a.same_card and a.backend == "cpu":
        ap.error("--same-card shares one GPU: give a GPU --backend")
    if a.out is None:
        name = "poll_cost.md" if a.backend == "cpu" else f"poll_cost_{a.backend}.md"
        a.out = str(ROOT / "bench" / "results" / name)
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    lines = ["# CPU cost of the RPC link's polling (patch 0005)", "",
             f"- Build: {build_line(None, a.backend)}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores), load average at start {os.getloadavg()[0]:.2f}",
             f"- Model: `{a.model}`; " + ("2 CPU cards, 1 thread per process" if a.backend == "cpu" else
                                          f"2 {a.backend} cards" + (" (one GPU, shared)" if a.same_card else "")) +
             f", ctx 2048, -np 1; greedy decode of "
             f"{a.tokens} tokens after a warm-up; medians of {a.reps} repetitions; idle = {a.idle:g} s from the "
             "last reply on",
             f"- Command: `{shlex.join(['python', 'bench/poll_cost.py', *(sys.argv[1:] if argv is None else argv)])}`",
             "- Figures: CPU time (user + system) of every process of the group; cores busy = CPU time / wall time",
             "",
             "| mode | ARCSPLIT_RPC_SPIN_US | CPU ms per token | cores busy decoding | cores busy idle | tok/s |",
             "|---|---|---|---|---|---|"]
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        for spin in (0, a.spin_us):
            print(f"{mode} spin {spin} us ...", flush=True)
            got = measure(a.model, mode, spin, a.tokens, a.reps, a.idle, a.backend, a.same_card)
            med = {k: statistics.median(v) for k, v in got.items()}
            lines.append(f"| {mode} | {spin} | {med['ms/token']:.2f} | {med['cores decoding']:.2f} | "
                         f"{med['cores idle']:.3f} | {med['tok/s']:.1f} |")
    if a.backend == "cpu":
        lines += ["", "On the CPU backend the cards are the cores, so arcsplit never turns polling on there; the rows "
                  "show what a polling thread costs, which on a GPU group is spare host cores. Tokens/s on 2 shared "
                  "cores is noise."]
    else:
        lines += ["", f"What arcsplit's default ({a.spin_us} us on GPU groups of 8+ cores) costs in host cores, and "
                  "what it buys in tokens/s, on this machine. The shared-memory link (patch 0008, on by default) "
                  "polls under the same budget."]
    lines.append("")
    text = "\n".join(lines)
    write_report(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
