"""Where a decoded token's time goes on the RPC routes: a GPU timeline of every process of the group (issue 19).

    python bench/gpu_trace.py --trace-lib libcupti_trace.so --backend cuda --gpus 0 --same-card \
        --model M.gguf [--modes native,hybrid,rpc] [--tokens 64] [--out FILE]

Every mode is served through ``arcsplit.serve`` exactly as bench/throughput.py serves it (same flags, the same
one-GPU ``--same-card`` rig), with a CUPTI tracer injected into each of its CUDA processes
(bench/gpu/cupti_trace.c via CUDA_INJECTION64_PATH; Nsight Systems is not on the lent machines). After a warm-up,
one request decodes --tokens tokens (one stream, eos ignored). The tracer records every kernel, memcpy, memset
and CUDA runtime call of llama-server and each rpc-server in one clock; this script takes the decode request's
burst of GPU work (the last one, after an idle second) and divides it per decoded token:

- wall: first kernel to last, per token (the request's own t/s, traced, is beside it: tracing costs a little);
- busy: time the GPU ran work of that process (kernels, copies, memsets; the union of intervals);
- all busy: the union over processes; idle = wall - all busy: the GPU doing nothing while the token waits for
  a socket, a process waking up, a launch;
- handoffs: idle gaps where the GPU's next work belongs to another process than its last (llama-server ->
  rpc0 and back): the cost of crossing the link, per crossing;
- the runtime calls each process spends most host time in (a cudaStreamSynchronize is a wait for the GPU);
- llama-server's turnaround between two tokens, on its main thread (told apart by the runtime calls' thread ids):
  the token's result on the host -> its first CUDA call -> the next graph launch -> the GPU's next work.

--keep-raw DIR keeps each process's tracer lines (gzip) for a look the report does not take.

Tracing every kernel costs each process time per launch (on the H200 the traced native decode ran at 508 t/s
against 673 untraced), so the absolute figures are inflated and the split between routes is what to read.
``ARCSPLIT_CUPTI_LIGHT=1`` makes the tracer record a CUDA graph as one record instead of its kernels (far less
overhead; kernels outside graphs are then not seen; run on an H200: bench/results/gpu/trace_*_light.md).

--prompt-tokens N traces a prefill instead: the request is a prompt of exactly N tokens (the throughput bench's
prompt, no prompt cache) with n_predict 1, and every "per token" figure becomes per prompt: where a prompt's
time goes between the processes (its ubatches' activations crossing the link, the GPU idle meanwhile). A short
decode runs between the warm-up prompt and the traced one, as in the throughput bench (the results of
2026-12-03 were traced without it: each process re-captured a CUDA graph for the traced prompt).

Writes bench/results/gpu/trace_<model>.md (or --out; trace_<model>_prefill.md with --prompt-tokens).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import arcsplit  # noqa: E402
from throughput import (DECODE_PROMPT, argv_of, build_line, complete, long_prompt, machine,  # noqa: E402
                        mode_env, parse, same_card_rig, serve_kwargs, serve_mode)

BURST_GAP_NS = 300_000_000  # 0.3 s of no GPU work separates the decode request from the warm-up


@dataclass
class Rec:
    kind: str  # K kernel, M memcpy, S memset, R runtime call
    start: int
    end: int
    name: str
    nbytes: int = 0
    graph: int = 0
    tid: int = 0  # runtime calls: the calling thread


def read_trace(path: Path) -> list[Rec]:
    """A tracer's lines as records; a .gz file is one --keep-raw wrote."""
    out = []
    text = (gzip.open(path, "rt", encoding="utf-8", errors="replace").read() if path.suffix == ".gz"
            else path.read_text(encoding="utf-8", errors="replace"))
    for line in text.splitlines():
        f = line.split("\t")
        try:
            if f[0] == "K":
                out.append(Rec("K", int(f[1]), int(f[2]), f[5], graph=int(f[4])))
            elif f[0] == "M":
                out.append(Rec("M", int(f[1]), int(f[2]), f"memcpy kind {f[5]}", nbytes=int(f[4])))
            elif f[0] == "S":
                out.append(Rec("S", int(f[1]), int(f[2]), "memset", nbytes=int(f[4])))
            elif f[0] == "R":
                out.append(Rec("R", int(f[1]), int(f[2]), f[4], tid=int(f[3])))
        except (IndexError, ValueError):
            continue  # a line cut by a kill
    return out


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def total(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def clip(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def last_burst(gpu: list[tuple[int, int]]) -> tuple[int, int]:
    """The last stretch of GPU work without a pause of BURST_GAP_NS: the measured request."""
    u = union(gpu)
    lo = u[-1][0]
    for (s0, e0), (s1, _) in zip(reversed(u[:-1]), reversed(u[1:])):
        if s1 - e0 > BURST_GAP_NS:
            break
        lo = s0
    return lo, u[-1][1]


@dataclass
class Breakdown:
    mode: str
    tokens: int
    tps_traced: float
    wall_us: float = 0.0
    all_busy_us: float = 0.0
    per_proc: dict[str, dict[str, float]] = field(default_factory=dict)
    handoffs: dict[str, tuple[float, float]] = field(default_factory=dict)  # "a -> b": (per token, us each)
    runtime: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)  # top calls: us/token, n/token
    argv: dict[str, list[str]] = field(default_factory=dict)
    gaps: list[GapKind] = field(default_factory=list)  # the idle gaps by what ends and starts them, largest first
    turnaround: Turnaround | None = None  # llama-server's main thread between two tokens (modes where it launches)


@dataclass(frozen=True)
class Turnaround:
    """llama-server's main thread from a token's result on the host to the next token's graph on the GPU, medians
    over the request's tokens (us). The result is on the host when the last device-to-host copy before the next
    launch ends, whichever process made it (llama-server's own card in native, the last rpc-server otherwise); the
    main thread is the one that launches llama-server's CUDA graphs."""
    tokens: int
    to_first_call: float  # result on the host -> the main thread's first CUDA call (the link back, sampling)
    to_launch: float  # that call -> the next graph launch begins (the next token's inputs, the scheduler's syncs)
    launch: float  # the cudaGraphLaunch call itself
    to_gpu: float  # its start -> the next token's first GPU work of any process


COPY_KINDS = {1: "H2D", 2: "D2H", 8: "D2D", 10: "P2P"}  # CUpti_ActivityMemcpyKind


def what(r: Rec) -> str:
    """A GPU record as a gap's neighbour: kernel, graph (light mode), copy H2D/D2H, memset."""
    if r.kind == "K":
        return "graph" if r.name == "(cuda graph)" else "kernel"
    if r.kind == "M":
        code = r.name.rsplit(" ", 1)[-1]
        return "copy " + (COPY_KINDS.get(int(code), "?") if code.isdigit() else "?")
    return "memset"


@dataclass
class GapKind:
    """Idle gaps of one kind (what ran on the GPU before, what after) and where each process spent them."""
    label: str  # "rpc0 copy D2H -> server kernel"
    per_token: float
    median_us: float
    total_us: float  # per token
    # (process, runtime call, occurrence in the gap): median start and end offset from the gap's start (us),
    # and the share of these gaps that had it; calls that began before the gap start at a negative offset
    steps: list[tuple[str, str, float, float, float]] = field(default_factory=list)
    outside_us: dict[str, float] = field(default_factory=dict)  # median per gap: in no CUDA call of that process


def anatomy(label: str, gaps: list[tuple[int, int]], calls: dict[str, list[Rec]], tokens: int) -> GapKind:
    """What each process's CUDA runtime calls did inside gaps of one kind, as median offsets from the gap's start:
    a synchronize returning is that process seeing its GPU work end; a process's time in no CUDA call is its CPU
    (sampling, building the next graph) or a socket (the link) — the host side of the wait."""
    lens = [e - s for s, e in gaps]
    kind = GapKind(label, len(gaps) / tokens, statistics.median(lens) / 1e3, sum(lens) / 1e3 / tokens)
    seen: dict[tuple[str, str, int], list[tuple[int, int]]] = collections.defaultdict(list)
    outside: dict[str, list[int]] = collections.defaultdict(list)
    for gs, ge in gaps:
        for proc, recs in calls.items():
            inside = [r for r in recs if r.end > gs and r.start < ge]
            count: dict[str, int] = collections.Counter()
            for r in inside:
                seen[(proc, r.name, count[r.name])].append((r.start - gs, r.end - gs))
                count[r.name] += 1
            outside[proc].append(ge - gs - total(union(clip([(r.start, r.end) for r in inside], gs, ge))))
    for (proc, name, n), offs in seen.items():
        share = len(offs) / len(gaps)
        if share >= 0.9:
            kind.steps.append((proc, name if n == 0 else f"{name} #{n + 1}", statistics.median(o[0] for o in offs) / 1e3,
                               statistics.median(o[1] for o in offs) / 1e3, share))
    kind.steps.sort(key=lambda st: (st[2], st[3]))
    kind.outside_us = {proc: statistics.median(v) / 1e3 for proc, v in outside.items()}
    return kind


def condense(steps: list[tuple[str, str, float, float, float]]) -> list[tuple[str, str, int, float, float]]:
    """Runs of one call in a row by one process (26 cudaGetDevice before a graph launch) as one step with a count:
    (process, call without its _vNNNN suffix, count, first start, last end)."""
    out: list[tuple[str, str, int, float, float]] = []
    for proc, name, a, b, _ in steps:
        base = name.split(" #")[0].split("_v")[0]
        if out and out[-1][0] == proc and out[-1][1] == base:
            out[-1] = (proc, base, out[-1][2] + 1, out[-1][3], max(out[-1][4], b))
        else:
            out.append((proc, base, 1, a, b))
    return out


def gap_kinds(owner: list[tuple[int, int, str, str]], calls: dict[str, list[Rec]], tokens: int,
              top: int = 4) -> list[GapKind]:
    """Every idle gap inside the request, grouped by its neighbours (process and kind of the GPU work before and
    after), the ``top`` kinds by time per token with their anatomy. ``owner``: (start, end, process, what)."""
    by: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    ordered = sorted(owner)
    end, last = ordered[0][1], ordered[0][2:]
    for s, e, proc, w in ordered[1:]:
        if s > end:
            by[f"{last[0]} {last[1]} -> {proc} {w}"].append((end, s))
        if e > end:
            end, last = e, (proc, w)
    # a kind seen in fewer than half the tokens (the request's first token, its prompt) is not a per-token cost
    ranked = sorted(((k, v) for k, v in by.items() if len(v) * 2 >= tokens),
                    key=lambda kv: -sum(e - s for s, e in kv[1]))[:top]
    return [anatomy(label, gaps, calls, tokens) for label, gaps in ranked]


def analyse(mode: str, tokens: int, tps: float, traces: dict[str, list[Rec]]) -> Breakdown:
    b = Breakdown(mode, tokens, tps)
    gpu_all = [(r.start, r.end) for recs in traces.values() for r in recs if r.kind in "KMS"]
    if not gpu_all:
        return b
    lo, hi = last_burst(gpu_all)
    b.wall_us = (hi - lo) / 1e3 / tokens
    owner: list[tuple[int, int, str]] = []
    for name, recs in traces.items():
        gpu = clip([(r.start, r.end) for r in recs if r.kind in "KMS"], lo, hi)
        u = union(gpu)
        owner += [(s, e, name) for s, e in u]
        inside = [r for r in recs if r.kind in "KMS" and r.end > lo and r.start < hi]
        b.per_proc[name] = {
            "busy_us": total(u) / 1e3 / tokens,
            "kernels": sum(r.kind == "K" for r in inside) / tokens,
            "kernel_us": total(union([(r.start, r.end) for r in inside if r.kind == "K"])) / 1e3 / tokens,
            "copies": sum(r.kind == "M" for r in inside) / tokens,
            "copy_us": total(union([(r.start, r.end) for r in inside if r.kind == "M"])) / 1e3 / tokens,
            "copy_bytes": sum(r.nbytes for r in inside if r.kind == "M") / tokens,
        }
        calls: dict[str, list[int]] = collections.defaultdict(list)
        for r in recs:
            if r.kind == "R" and r.end > lo and r.start < hi:
                calls[r.name].append(min(r.end, hi) - max(r.start, lo))
        top = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:5]
        b.runtime[name] = [(n, sum(v) / 1e3 / tokens, len(v) / tokens) for n, v in top]
    b.all_busy_us = total(union([(s, e) for s, e, _ in owner])) / 1e3 / tokens
    # handoffs: walk the merged timeline in order; an idle gap whose neighbours belong to different processes
    owner.sort()
    gaps: dict[str, list[int]] = collections.defaultdict(list)
    end, last = owner[0][1], owner[0][2]
    for s, e, name in owner[1:]:
        if s > end and name != last:
            gaps[f"{last} -> {name}"].append(s - end)
        if e > end:
            end, last = e, name
    b.handoffs = {k: (len(v) / tokens, statistics.median(v) / 1e3) for k, v in sorted(gaps.items())}
    records = [(r.start, r.end, name, what(r)) for name, recs in traces.items() for r in recs
               if r.kind in "KMS" and r.end > lo and r.start < hi]
    calls = {name: [r for r in recs if r.kind == "R" and r.end > lo and r.start < hi] for name, recs in traces.items()}
    b.gaps = gap_kinds(records, calls, tokens)
    if "server" in traces:
        b.turnaround = turnaround(traces["server"], [r for recs in traces.values() for r in recs], lo, hi)
    return b


def turnaround(server: list[Rec], everyone: list[Rec], lo: int, hi: int) -> Turnaround | None:
    """Per token of the burst [lo, hi]: where llama-server's main thread spends the time between a token's result
    reaching the host and the next token's graph starting on the GPU (Turnaround). None where llama-server
    launches no CUDA graph (all-RPC: it holds no card) or the burst has fewer than two tokens."""
    launches = sorted((r for r in server if r.kind == "R" and r.name.startswith("cudaGraphLaunch")
                       and lo <= r.start <= hi), key=lambda r: r.start)
    if len(launches) < 2:
        return None
    main = collections.Counter(r.tid for r in launches).most_common(1)[0][0]
    calls = sorted((r for r in server if r.kind == "R" and r.tid == main and lo <= r.start <= hi),
                   key=lambda r: r.start)
    d2h = sorted(r.end for r in everyone if r.kind == "M" and what(r) == "copy D2H" and lo <= r.end <= hi)
    gpu = sorted(r.start for r in everyone if r.kind in "KMS" and lo <= r.start <= hi)
    rows = []
    for prev, launch in zip(launches, launches[1:]):
        ends = [e for e in d2h if prev.start < e < launch.start]
        if not ends:
            continue
        t0 = ends[-1]
        first = next((c.start for c in calls if t0 < c.start <= launch.start), launch.start)
        work = next((g for g in gpu if g >= launch.start), None)
        rows.append((first - t0, launch.start - first, launch.end - launch.start,
                     (work - launch.start) if work is not None else 0))
    if not rows:
        return None
    med = [statistics.median(col) / 1e3 for col in zip(*rows)]
    return Turnaround(len(rows), *med)


def run_mode(a: argparse.Namespace, mode: str, tdir: Path) -> Breakdown:
    os.environ["CUDA_INJECTION64_PATH"] = str(Path(a.trace_lib).resolve())
    os.environ["ARCSPLIT_CUPTI_DIR"] = str(tdir)
    try:
        # A prefill trace is of the prompt alone: llama-server's host-memory prompt cache would save the decode
        # request's idle slot and restore the warm-up's KV (the traced prompt is its twin) at slot selection, just
        # before the prompt and inside its burst (64 MiB of copies on the 7.2B model; outside the throughput
        # bench's prompt timings). Off here, and said so in the file.
        gpus, kw = serve_kwargs(a, mode, ("--cache-ram", "0") if a.prompt_tokens else ())
        with mode_env(mode), arcsplit.serve(a.model, gpus=gpus, **kw) as server, \
                httpx.Client(timeout=a.timeout) as client:
            argv = argv_of(server)
            pids = {name: p.get("pid") for name, p in server.status()["processes"].items()}
            body: dict[str, object] = {"prompt": "Write a long story about a lighthouse keeper.",
                                       "n_predict": a.tokens, "ignore_eos": True}
            if a.prompt_tokens:
                body = {"prompt": long_prompt(client, server.url, a.prompt_tokens), "n_predict": 1}
            complete(client, server.url, body)  # warm-up: graphs built, CUDA graphs captured
            if a.prompt_tokens:
                # as in bench/throughput.py, where decode requests run between two prompts: a prompt that repeated
                # the one before it exactly would complete llama.cpp's CUDA-graph warm-up and re-capture its graph
                complete(client, server.url, {"prompt": DECODE_PROMPT, "n_predict": 16, "ignore_eos": True})
            time.sleep(1.0)
            r = complete(client, server.url, body)
            tps = float(r["timings"]["prompt_per_second" if a.prompt_tokens else "predicted_per_second"])
            time.sleep(1.0)
    finally:
        os.environ.pop("CUDA_INJECTION64_PATH", None)
        os.environ.pop("ARCSPLIT_CUPTI_DIR", None)
    traces = {}
    for name, pid in pids.items():
        f = tdir / f"{pid}.tsv"
        if pid and f.exists():
            traces[name] = read_trace(f)
            if a.keep_raw:  # the tracer's own lines, for a look this report does not take
                Path(a.keep_raw).mkdir(parents=True, exist_ok=True)
                with f.open("rb") as src, gzip.open(Path(a.keep_raw) / f"{mode}_{name}.tsv.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    br = analyse(mode, 1 if a.prompt_tokens else a.tokens, tps, traces)
    br.argv = argv
    return br


def report(a: argparse.Namespace, rows: list[Breakdown], cmdline: str) -> str:
    native = next((r for r in rows if r.mode == "native"), None)
    lines = ["# Where a decoded token's time goes on one GPU (CUPTI timeline of every process)", "",
             f"- Build: {build_line(a.llama_dir, a.backend)}", f"- Machine: {machine(a.backend)}",
             f"- Model: `{Path(a.model).name}`; every mode served by `arcsplit.serve` as bench/throughput.py "
             f"serves it{' (--same-card: llama-server and the rpc-servers share one GPU)' if a.same_card else ''}; "
             + (f"one prompt of {a.prompt_tokens} tokens (n_predict 1, no prompt cache, llama-server's host-memory "
                "prompt cache off: `--cache-ram 0`; every per-prompt figure is that one prompt's) " if a.prompt_tokens
                else f"one request of {a.tokens} decoded tokens (one stream) ")
             + "after a warm-up, traced with CUPTI "
             "(bench/gpu/cupti_trace.c): kernels, copies, memsets, runtime calls of each process, one clock"
             + ("; light mode (ARCSPLIT_CUPTI_LIGHT=1): a CUDA graph is one record, kernels outside graphs are not "
                "seen, so GPU busy is a lower bound and the gaps' timing is closer to an untraced run."
                if os.environ.get("ARCSPLIT_CUPTI_LIGHT") == "1" else "."),
             f"- Command: `{cmdline}`", "- One run per mode: a profile of where time goes, not a speed figure "
             "(tracing every kernel slows each process a little; the t/s column is the traced request's).", "",
             "| mode | traced t/s | wall us/token | GPU busy, all processes | GPU idle | per process: busy us "
             "(kernels us, copies us), kernels, copies, bytes copied per token |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        procs = "; ".join(f"{n}: {p['busy_us']:.0f} ({p['kernel_us']:.0f}, {p['copy_us']:.0f}), "
                          f"{p['kernels']:.0f} k, {p['copies']:.1f} c, {p['copy_bytes'] / 1024:.1f} KiB"
                          for n, p in r.per_proc.items())
        idle = r.wall_us - r.all_busy_us
        lines.append(f"| {r.mode} | {r.tps_traced:.1f} | {r.wall_us:.0f} | {r.all_busy_us:.0f} | {idle:.0f} "
                     f"({idle / r.wall_us:.0%}) | {procs} |" if r.wall_us else f"| {r.mode} | - | - | - | - | - |")
    lines += ["", "Idle gaps at a change of process (the GPU waiting while the token crosses the link): "
              "crossings per token, median us each.", ""]
    for r in rows:
        for k, (n, us) in r.handoffs.items():
            lines.append(f"- {r.mode}: {k}: {n:.1f} per token, {us:.0f} us each")
    lines += ["", "Host time in CUDA runtime calls inside the request, per token (top 5 per process; a "
              "synchronize is a wait for the GPU):", ""]
    for r in rows:
        for n, calls in r.runtime.items():
            lines.append(f"- {r.mode} / {n}: " + ", ".join(f"{c} {us:.0f} us ({k:.1f}x)" for c, us, k in calls))
    lines += ["", "Idle gaps by what ends and starts them (the largest kinds, per token), and what each process did "
              "meanwhile: its CUDA runtime calls found in at least 90% of these gaps, as median offsets from the "
              "gap's start (us; negative: begun before; xN: N calls in a row), and its median time in no CUDA call "
              "(CPU work: sampling, the next graph; or a socket).", ""]
    for r in rows:
        for g in r.gaps:
            shown = [f"{p} {n}{f' x{k}' if k > 1 else ''} {a:+.0f}..{b:+.0f}" for p, n, k, a, b in condense(g.steps)]
            if len(shown) > 16:
                shown = shown[:8] + [f"({len(shown) - 16} more)"] + shown[-8:]
            steps = "; ".join(shown)
            free = ", ".join(f"{p} {us:.0f}" for p, us in g.outside_us.items())
            lines.append(f"- {r.mode}: {g.label}: {g.per_token:.1f} per token, median {g.median_us:.0f} us, "
                         f"{g.total_us:.0f} us per token. Calls: {steps or 'none'}. In no CUDA call: {free}")
    if any(r.turnaround for r in rows):
        lines += ["", "llama-server's main thread between two tokens (medians over the request's tokens, us): from "
                  "the token's result on the host (the end of the last device-to-host copy before the next launch, "
                  "whichever process made it) to the main thread's first CUDA call (the link back, sampling), from "
                  "there to the next graph launch (the next token's inputs, the scheduler's syncs), the launch call, "
                  "and from its start to the next token's first GPU work:", "",
                  "| mode | tokens | result -> first CUDA call | -> launch | launch call | launch -> GPU | in all |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if (t := r.turnaround) is not None:
                lines.append(f"| {r.mode} | {t.tokens} | {t.to_first_call:.0f} | {t.to_launch:.0f} | {t.launch:.0f} "
                             f"| {t.to_gpu:.0f} | {t.to_first_call + t.to_launch + t.to_gpu:.0f} |")
    if native and native.wall_us:
        lines += ["", "Against native (us per token):", ""]
        for r in rows:
            if r is native or not r.wall_us:
                continue
            extra = r.wall_us - native.wall_us
            work = r.all_busy_us - native.all_busy_us
            lines.append(f"- {r.mode}: +{extra:.0f} us per token = GPU work +{work:.0f} (kernels and copies of every "
                         f"process) + idle +{extra - work:.0f}")
    lines += ["", "## Commands", ""]
    for r in rows:
        for n, argv in r.argv.items():
            lines.append(f"- {r.mode} / {n}: `{shlex.join(argv)}`")
    text = "\n".join(lines) + "\n"
    if a.prompt_tokens:
        text = (text.replace("a decoded token's time", "a prompt's time").replace("per token", "per prompt")
                .replace("us/token", "us/prompt").replace("the token crossing", "the prompt's activations crossing")
                .replace("| traced t/s |", "| traced prefill t/s |"))
    return text


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--trace-lib", required=True, help="libcupti_trace.so built from bench/gpu/cupti_trace.c")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=0)
    ap.add_argument("--keep-raw", default="", help="a folder for each process's tracer lines (gzip)")
    ours, rest = ap.parse_known_args(raw)
    a = parse(rest)
    a.trace_lib, a.tokens, a.prompt_tokens, a.keep_raw = ours.trace_lib, ours.tokens, ours.prompt_tokens, ours.keep_raw
    if a.prompt_tokens < 0:
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens}: give a prompt length in tokens (512, say)")
    if not Path(a.trace_lib).is_file():
        raise SystemExit(f"--trace-lib {a.trace_lib}: no such file (build bench/gpu/cupti_trace.c first)")
    if a.model is None:
        raise SystemExit("--model is needed (a GGUF on the GPU machine)")
    rows = []
    with same_card_rig(a.gpu_list[0], a.same_card_cards) if a.same_card else contextlib.nullcontext():
        for mode in a.mode_list:
            serve_mode(mode, a.backend, a.same_card)
            with tempfile.TemporaryDirectory(prefix=f"trace-{mode}-") as d:
                print(f"{mode}: serving and tracing ...", flush=True)
                rows.append(run_mode(a, mode, Path(d)))
                print(f"  {mode}: {rows[-1].wall_us:.0f} us/token wall, {rows[-1].all_busy_us:.0f} busy", flush=True)
    stem = f"trace_{Path(a.model).stem}{'_prefill' if a.prompt_tokens else ''}"
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / "gpu" / f"{stem}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report(a, rows, shlex.join(["python", "bench/gpu_trace.py", *raw]))
    out.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
