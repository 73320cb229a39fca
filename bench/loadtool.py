"""A maintained load-testing tool from PyPI (Locust) driving the split, beside bench/loadgen.py on the same server.

    python bench/loadtool.py [--rounds 3] [--seconds 60] [--concurrency 4] [--max-tokens 16]

Starts the real `arcsplit serve <demo model> --backend cpu --gpus 0,1` (rpc mode: two rpc-servers and
llama-server), then alternates the two load generators on it, ``--rounds`` times each, ``--seconds`` each, with
the same concurrency, prompts, max_tokens and temperature: bench/loadgen.py (httpx, in this process) and Locust
(headless, its own process, bench/loadtool_locustfile.py). Locust is installed the bench's way: a venv of its own
under the arcsplit cache (``bench/locust-<version>``), made on first use, never in the test venv. Each round's
requests/s, output tokens/s and latency are printed as min/median/max over rounds; Locust's own table (its
median, p95, request count) is kept beside. The result goes to bench/results/loadtool.md.

Only loopback is targeted (LoadGen refuses anything else; Locust gets the same URL).
Needs ARCSPLIT_LLAMA_DIR (or a managed CPU build) like every serve.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_report  # noqa: E402
from loadgen import PROMPTS, ROOT, LoadGen, Result, Served, demo_model, summarize  # noqa: E402

LOCUST = "locust==2.47.0"  # pinned: the numbers below name it
TEMPERATURE = 0.7  # what LoadGen.one sends


def locust_venv() -> Path:
    """The bench's own venv with Locust (made once; Locust and gevent stay out of the test venv)."""
    sys.path.insert(0, str(ROOT))
    from arcsplit._dirs import cache_dir

    venv = cache_dir() / "bench" / f"locust-{LOCUST.split('==')[1]}"
    exe = venv / "bin" / "locust"
    if not exe.exists():
        print(f"installing {LOCUST} into {venv} …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", LOCUST], check=True)
    return exe


def run_locust(exe: Path, url: str, users: int, seconds: int, max_tokens: int, timeout: float,
               work: Path) -> tuple[list[Result], dict[str, dict[str, str]]]:
    """One headless Locust run: its per-request trace (as loadgen Results) and its own CSV rows (the whole
    stream, and its own timing of the HTTP call, which ends at the headers)."""
    trace = work / "trace.jsonl"
    trace.unlink(missing_ok=True)
    env = dict(os.environ, LOADTOOL_TRACE=str(trace), LOADTOOL_BODY=json.dumps(
        {"prompts": list(PROMPTS), "max_tokens": max_tokens, "temperature": TEMPERATURE, "timeout": timeout}))
    argv = [str(exe), "-f", str(ROOT / "bench" / "loadtool_locustfile.py"), "--headless", "--host", url,
            "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", str(int(timeout)),
            "--csv", str(work / "locust"), "--only-summary", "--loglevel", "WARNING"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + timeout + 60)
    if r.returncode not in (0, 1):  # 1: some requests failed, which the table shows
        raise RuntimeError(f"locust exited {r.returncode}: {r.stderr[-2000:]}")
    results = []
    for line in trace.read_text().splitlines() if trace.exists() else []:
        d = json.loads(line)
        results.append(Result(d["start"], d["end"], d["outcome"], 200 if d["outcome"] == "ok" else None, "",
                              d["tokens"], d["ttft"]))
    with open(work / "locust_stats.csv", newline="") as fh:
        rows = {r["Name"]: r for r in csv.DictReader(fh)}
    return results, {"whole": rows["chat: whole stream"], "headers": rows["chat: headers"]}


def figures(results: list[Result], client_cpu: float) -> dict[str, Any]:
    """loadgen's summary plus rates over the requests' own span (first start to last end): a tool's start-up and
    drain (Locust's process, its --stop-timeout) do not count against it. ``client_cpu``: the tool's own CPU
    seconds for the round, which on 2 shared cores is taken from the server."""
    s = summarize(results)
    seconds = max(r.end for r in results) - min(r.start for r in results) if results else 1.0
    s["client_cpu_ms"] = 1000 * client_cpu / max(1, len(results))
    ok = [r for r in results if r.outcome == "ok"]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    return {**s, "req_s": s["ok"] / seconds, "tok_s": s["tokens"] / seconds,
            "ttft_p50": ttfts[len(ttfts) // 2] if ttfts else None}


def mmm(values: list[float], fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "loadtool.md"))
    args = ap.parse_args()

    exe = locust_venv()
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout.split(" from ")[0]
    served = Served(demo_model(), parallel=args.concurrency)
    served.start()
    work = Path(tempfile.mkdtemp(prefix="arcsplit-loadtool-"))
    rows: dict[str, list[dict[str, Any]]] = {"bench/loadgen.py": [], "Locust": []}
    locust_rows: list[dict[str, dict[str, str]]] = []
    try:
        ready = served.wait_ready()
        print(f"ready in {ready:.1f} s on {served.url}", flush=True)
        for rnd in range(args.rounds):
            gen = LoadGen(served.url, concurrency=args.concurrency, max_requests=10**7, max_seconds=args.seconds,
                          timeout=args.timeout, max_tokens=args.max_tokens)
            cpu = time.process_time()  # this process runs loadgen; serve is a child that has not exited
            res = anyio.run(gen.run)
            rows["bench/loadgen.py"].append(figures(res, time.process_time() - cpu))
            before = resource.getrusage(resource.RUSAGE_CHILDREN)  # counts exited children: the Locust run
            res, row = run_locust(exe, served.url, args.concurrency, args.seconds, args.max_tokens, args.timeout, work)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            rows["Locust"].append(figures(res, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
            locust_rows.append(row)
            print(f"round {rnd + 1}: loadgen {rows['bench/loadgen.py'][-1]['tok_s']:.1f} tok/s, "
                  f"locust {rows['Locust'][-1]['tok_s']:.1f} tok/s", flush=True)
    finally:
        code = served.stop()
        leftovers = served.leftovers()
        served.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if code != 0 or any(leftovers.values()):
        print(f"serve exited {code}; left behind: {leftovers}", file=sys.stderr)
        return 1

    lines = [
        "# A load-testing tool from PyPI (Locust) beside bench/loadgen.py",
        "",
        f"`python bench/loadtool.py --rounds {args.rounds} --seconds {args.seconds} --concurrency {args.concurrency} "
        f"--max-tokens {args.max_tokens}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core VM shared with other "
        f"work; {version}).",
        "",
        "`arcsplit serve` of the demo model (Gemma 3 270M Q4_K_M), `--backend cpu --gpus 0,1 --cpu-memory 1024 "
        f"--parallel {args.concurrency} --ctx 4096`: mode rpc, two ggml-rpc-servers + llama-server. Both tools send "
        f"streaming chat completions (the same prompts, max_tokens {args.max_tokens}, temperature {TEMPERATURE}) "
        f"with {args.concurrency} in flight and no pause, {args.seconds} s per round, alternating on one server. "
        "Figures per round, min / median / max over rounds; latency is each tool's own per-request wall time "
        "(Locust's from the trace its user writes, the same summary code as loadgen's); rates are over each "
        "round's requests, first start to last end.",
        "",
        "| tool | requests ok (failed) per round | requests/s | output tokens/s | latency p50 s | latency p95 s "
        "| time to first token p50 s | client CPU ms per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tool, rs in rows.items():
        failed = sum(r["errors"] + r["timeouts"] for r in rs)
        lines.append(f"| {tool} | {mmm([r['ok'] for r in rs], '{:.0f}')} ({failed}) | {mmm([r['req_s'] for r in rs])} "
                     f"| {mmm([r['tok_s'] for r in rs], '{:.1f}')} | {mmm([r['p50_s'] or 0 for r in rs])} "
                     f"| {mmm([r['p95_s'] or 0 for r in rs])} | {mmm([r['ttft_p50'] or 0 for r in rs], '{:.3f}')} "
                     f"| {mmm([r['client_cpu_ms'] for r in rs], '{:.0f}')} |")
    lines += [
        "",
        "The two tools differ by less than the rounds differ among themselves (2 cores shared with other work); "
        "one known difference: loadgen opens a new connection per request (`max_keepalive_connections=0`), "
        "Locust keeps its connections.",
        "",
        "Locust's own table per round (its CSV, times in ms; its histogram rounds them). \"whole stream\" is the "
        "completion to [DONE], fired by the locustfile; \"headers\" is Locust's own timing of a `stream=True` "
        "call, which ends when llama-server sends the response headers (before the first token), so it is not "
        "the completion time:",
        "",
        "| round | requests | failures | whole stream: median / p95 / average ms | headers: median / p95 ms "
        "| requests/s |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(locust_rows, 1):
        w, h = row["whole"], row["headers"]
        lines.append(f"| {i} | {w['Request Count']} | {w['Failure Count']} | {w['Median Response Time']} / {w['95%']} "
                     f"/ {float(w['Average Response Time']):.0f} | {h['Median Response Time']} / {h['95%']} "
                     f"| {float(w['Requests/s']):.2f} |")
    lines += [
        "",
        "Incompatibilities found (none is arcsplit's):",
        "",
        "- guidellm 0.8.1 (the LLM-specific candidate) depends on `torch` unconditionally; from PyPI that is the "
        "CUDA build with its `nvidia-*` wheels, several GB, on a 2-core CPU machine; it also wants a Hugging Face "
        "tokenizer (a hub download unless a local one is given). Not installed here.",
        "- Locust's timing of streamed responses ends at the headers (above); the locustfile times the stream "
        "itself.",
        "- Locust's request count for a run stops at `-t`: requests still streaming are finished during "
        "`--stop-timeout` and appear in the trace (and the first table), not always in its CSV.",
    ]
    lines += ["", "Nothing was left running after stop (processes, ports, temp files checked)."]
    write_report(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
