"""Kill one rpc-server of a serving group (SIGKILL) and measure how long until the group serves again.

    python bench/recover.py [--backend cpu|cuda] [--gpus 0,1] [--model PATH | --synth-gb G] [--mode rpc|hybrid]
                            [--repeat N] [--rpc-cache] [--no-rpc-seed]

Prints: time from the kill to /health 200 with a new rpc-server, time to the first good completion, and
whether the greedy tokens after recovery equal those before, and min/median/max over the kills. By default the
new rpc-server reads the weights from the GGUF (patch 0006, when the build has it); ``--no-rpc-seed`` sends them
over the socket as stock llama.cpp does. Writes bench/results/recover_<backend>[_<mode>_<weights>].md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import arcsplit  # noqa: E402
from arcsplit.demo import ensure_demo_model  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

PROMPT = "The three primary colors are"


def greedy(url: str, n: int = 16) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=300)
    r.raise_for_status()
    return r.json()["tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--model")
    ap.add_argument("--mode", default="rpc")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cpu-memory", type=int, default=1024)
    ap.add_argument("--rpc-cache", action="store_true", help="serve with rpc-server -c (weights cached on disk)")
    ap.add_argument("--no-rpc-seed", action="store_true", help="weights over the socket, not read from the GGUF")
    ap.add_argument("--synth-gb", type=float, default=None,
                    help="a synthetic F16 model of about this size (bench/time_to_ready.py writes it once)")
    ap.add_argument("--same-card", action="store_true",
                    help="GPU backends: the group's two cards are the one GPU --gpus names, shared by llama-server "
                         "and the rpc-servers (bench/throughput.py --same-card), for a machine with one GPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.synth_gb:
        from time_to_ready import load_model

        a.model = str(load_model(a.synth_gb))
    model = a.model or str(ensure_demo_model())
    rows = []
    gpus = a.gpus
    rig: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if a.same_card:
        from throughput import same_card_rig

        rig, gpus = same_card_rig(int(a.gpus.split(",")[0]), 2), "0,1"
    with rig, arcsplit.serve(model, gpus=gpus, backend=a.backend, mode=a.mode, ctx=a.ctx, port=free_port(),
                        cpu_memory_mib=a.cpu_memory if a.backend == "cpu" else None,
                        threads=1 if a.backend == "cpu" else None, max_restarts=10, rpc_cache=a.rpc_cache,
                        rpc_seed=not a.no_rpc_seed) as server:
        seeded = any("Seeded cache from" in line for line in server.logs("rpc0", 500))  # the rpc-server says so
        before = greedy(server.url)
        for i in range(a.repeat):
            status = server.status()
            victim = status["processes"]["rpc0"]["pid"]
            generation = status["generation"]
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while True:
                s = server.status()
                if s["generation"] > generation and s["state"] == "ready":
                    break
                if s["state"] == "stopped":
                    raise SystemExit("the group gave up instead of recovering")
                time.sleep(0.02)
            ready = time.monotonic() - t0
            after = greedy(server.url)
            served = time.monotonic() - t0
            rows.append((ready, served, after == before, s["processes"]["rpc0"]["pid"] != victim))
            print(f"kill {i + 1}: ready again after {ready:.2f} s, first completion after {served:.2f} s, "
                  f"same tokens: {after == before}", flush=True)
    med_ready = statistics.median(r[0] for r in rows)
    med_served = statistics.median(r[1] for r in rows)
    weights = "seeded from the GGUF (patch 0006)" if seeded else "over the socket"
    try:  # an argv, never a shell
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        smi = ""
    gpu = smi.strip().replace("\n", "; ") or "none"
    text = "\n".join([
        f"# Recovery after SIGKILL of an rpc-server ({a.backend}, mode {a.mode}"
        f"{', rpc-server -c' if a.rpc_cache else ''}, weights {weights})",
        "",
        f"- machine: {platform.node()} ({os.cpu_count()} cores), GPUs: {gpu}",
        f"- model: {model} ({Path(model).stat().st_size / 1e9:.2f} GB)",
        f"- command: `python bench/recover.py --backend {a.backend} --gpus {a.gpus} --mode {a.mode} "
        f"{'--same-card ' if a.same_card else ''}"
        f"--repeat {a.repeat}{' --rpc-cache' if a.rpc_cache else ''}{' --no-rpc-seed' if a.no_rpc_seed else ''}"
        f"{f' --synth-gb {a.synth_gb:g}' if a.synth_gb else ''}`",
        "",
        "| kill | ready again (s) | first completion (s) | same greedy tokens | new rpc-server pid |",
        "|---|---|---|---|---|",
        *[f"| {i + 1} | {r[0]:.2f} | {r[1]:.2f} | {r[2]} | {r[3]} |" for i, r in enumerate(rows)],
        "",
        f"Ready again after min / **median** / max {min(r[0] for r in rows):.2f} / **{med_ready:.2f}** / "
        f"{max(r[0] for r in rows):.2f} s; serving after {min(r[1] for r in rows):.2f} / **{med_served:.2f}** / "
        f"{max(r[1] for r in rows):.2f} s.",
        "",
    ])
    default = f"recover_{a.backend}.md" if not a.synth_gb else \
        f"recover_{a.backend}_{a.mode}_{'seed' if seeded else 'socket'}.md"
    out = Path(a.out or Path(__file__).parent / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0 if all(r[2] and r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
