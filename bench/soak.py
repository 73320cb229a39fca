"""Soak: steady streaming load on a served demo model, no faults; the supervisor must stay flat.

    python bench/soak.py [--minutes 30] [--concurrency 8] [--pause 1.0] [--max-tokens 16]

Starts the real `arcsplit serve <demo model> --backend cpu --gpus 0,1` (rpc mode: two rpc-servers + llama-server),
runs bench/loadgen.py against it for the whole time and samples the supervisor process (RSS, open file
descriptors, threads, children) every ``--sample`` seconds. Pass: zero failed requests, no request past its
timeout, supervisor RSS and fds flat (the figures go to bench/results/soak.md), nothing left after stop.
Needs ARCSPLIT_LLAMA_DIR (or a managed build) like every serve.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import ROOT, LoadGen, Served, demo_model, summarize  # noqa: E402

MiB = 1 << 20


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per second)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pause", type=float, default=1.0, help="mean pause of each worker between requests (s)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="client timeout per request (s)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between supervisor samples")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.md"))
    args = ap.parse_args()

    served = Served(demo_model())
    served.start()
    try:
        ready_s = served.wait_ready()
        print(f"ready in {ready_s:.1f} s on {served.url}", flush=True)
        samples: list[dict[str, float]] = []
        gen = LoadGen(served.url, concurrency=args.concurrency, max_requests=10**7, max_seconds=args.minutes * 60,
                      timeout=args.timeout, max_tokens=args.max_tokens, pause=args.pause)

        async def sampler() -> None:
            while True:
                s = served.sample()
                s["in_flight"] = gen.in_flight
                s["done"] = len(gen.results)
                samples.append(s)
                if len(samples) % 6 == 1:
                    print(f"{(s['time'] - samples[0]['time']) / 60:5.1f} min  rss {s['rss'] / MiB:6.1f} MiB  "
                          f"fds {s['fds']}  requests {s['done']}  failed "
                          f"{sum(r.outcome != 'ok' for r in gen.results)}", flush=True)
                await anyio.sleep(args.sample)

        async def go() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sampler)
                await gen.run()
                tg.cancel_scope.cancel()

        t0 = time.time()
        anyio.run(go)
        elapsed = time.time() - t0
        samples.append(served.sample())
        alive_children = len(served.children())
    finally:
        rc = served.stop(signal.SIGTERM)
    left = served.leftovers()
    summary = summarize(gen.results)
    _write(args, served, ready_s, elapsed, samples, summary, gen, rc, left, alive_children)
    print(json.dumps({"summary": summary, "leftovers": left, "rc": rc}, indent=1))
    failed = summary["errors"] + summary["timeouts"]
    served.cleanup()
    return 1 if failed or any(left.values()) else 0


def _write(args, served, ready_s, elapsed, samples, summary, gen, rc, left, alive_children) -> None:  # noqa: ANN001
    warm = [s for s in samples if s["time"] - samples[0]["time"] >= 120] or samples  # after 2 min of warm-up
    rss = [s["rss"] / MiB for s in samples]
    fds = [s["fds"] for s in samples]
    slope_h = _slope([(s["time"], s["rss"] / MiB) for s in warm]) * 3600
    fd_slope_h = _slope([(s["time"], s["fds"]) for s in warm]) * 3600
    tokens_s = summary["tokens"] / elapsed if elapsed else 0
    rows = []
    step = max(1, len(samples) // 10)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        rows.append(f"| {(s['time'] - samples[0]['time']) / 60:5.1f} | {s['rss'] / MiB:.1f} | {s['fds']} | "
                    f"{s['threads']} | {s.get('done', '')} |")
    lines = [
        "# Soak",
        "",
        f"`python bench/soak.py --minutes {args.minutes:g} --concurrency {args.concurrency} --pause {args.pause:g} "
        f"--max-tokens {args.max_tokens}` ({time.strftime('%Y-%m-%d')}, 2-core VM shared with other work).",
        "",
        f"`arcsplit serve` of the demo model (Gemma 3 270M Q4_K_M), `--backend cpu --gpus 0,1 --cpu-memory 1024 "
        f"--parallel {served.parallel} --ctx {served.ctx}`: mode rpc, two ggml-rpc-servers + llama-server. "
        f"Ready in {ready_s:.1f} s. {args.concurrency} workers, each sending one streaming chat completion "
        f"(max {args.max_tokens} tokens) at a time with a mean pause of {args.pause:g} s; client timeout "
        f"{args.timeout:g} s. No faults injected.",
        "",
        "| duration | requests | ok | failed (error / timeout) | tokens | tokens/s | latency p50 / p95 / max |",
        "|---|---|---|---|---|---|---|",
        f"| {elapsed / 60:.1f} min | {summary['requests']:,} | {summary['ok']:,} | {summary['errors']} / "
        f"{summary['timeouts']} | {summary['tokens']:,} | {tokens_s:.1f} | {summary['p50_s'] or 0:.2f} / "
        f"{summary['p95_s'] or 0:.2f} / {summary['max_s'] or 0:.2f} s |",
        "",
        "Supervisor process (`python -m arcsplit serve`):",
        "",
        f"- RSS: {rss[0]:.1f} MiB at start, {min(rss):.1f}-{max(rss):.1f} MiB over the run, {rss[-1]:.1f} MiB at the end; "
        f"trend after the first 2 min {slope_h:+.2f} MiB/hour.",
        f"- open file descriptors: {fds[0]} at start, {min(fds)}-{max(fds)} over the run, {fds[-1]} at the end "
        f"(trend {fd_slope_h:+.2f}/hour).",
        f"- children alive at the end of the load: {alive_children} (llama-server + 2 rpc-servers, never restarted).",
        "",
        "| minute | RSS MiB | fds | threads | requests done |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Stop (SIGTERM): exit {rc}; left behind: processes {left['processes'] or 'none'}, listening ports "
        f"{left['ports'] or 'none'}, temp files {left['temp_files'] or 'none'}, state files listing processes "
        f"{left['state_files'] or 'none'}.",
    ]
    if summary["errors"] or summary["timeouts"]:
        lines += ["", "Failures:", ""] + [f"- {r.outcome}: {r.error}" for r in gen.results if r.outcome != "ok"][:20]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
