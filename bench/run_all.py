"""Run every bench script in a quick mode, then assemble bench/RESULTS.md from bench/results/*.md.

    python bench/run_all.py [--full] [--assemble-only] [--skip NAME,...]

Each figure the project claims gets one row: its target, pass/fail and the current result, read from the first of
its results files (Figure.files lists the current run first), and a link to its history: bench/results/history/
<figure>.md, which holds every run's row and the full text of every results file behind it. The long runs (soak,
fuzz 100k, loadtool) are never started here; their results files are included when present. The plot of
throughput ratios (bench/results/throughput.png) is drawn with matplotlib, the `bench` extra
(`pip install -e ".[bench]"`). Needs ARCSPLIT_LLAMA_DIR or a managed CPU build.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"

# name -> (quick argv, full argv); scripts that are missing are skipped and said so.
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "plan_speed": ([], []),
    "plan_accuracy": ([], []),
    "moe_offload": (["--reps", "3"], []),
    "fit_context": ([], []),
    "time_to_ready": (["--runs", "3"], []),
    "idle_cpu": (["--seconds", "10"], []),
    "throughput": (["--backend", "cpu"], ["--backend", "cpu", "--full"]),
    "rpc_waits": ([], ["--reps", "5"]),
    "rpc_link": (["--runs", "1"], ["--runs", "3"]),
    "prompt_cache_link": ([], []),
    # dash_frame writes its file only with --out; its results file holds two hand-run rates, so the quick run
    # here only prints (see "This run") and the file is included as it is.
    "dash_frame": (["--seconds", "3"], ["--seconds", "5"]),
}
HYBRID_TARGETS = {"prefill": 0.75, "decode": 0.90, "4 streams": 0.90}


@dataclass(frozen=True)
class Verdict:
    status: str  # pass | FAIL | info | missing
    detail: str


def read(name: str) -> str | None:
    p = RESULTS / name
    return p.read_text(encoding="utf-8") if p.exists() else None


def table_rows(text: str) -> list[list[str]]:
    """Cells of every markdown table row except header separators."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| :]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def meets(text: str) -> Verdict | None:
    """The 'meets/misses the ... target' wording the bench scripts share."""
    if re.search(r"\bmisses\b", text):
        return Verdict("FAIL", "misses: " + first_line_with(text, "misses"))
    if re.search(r"\bmeets\b", text):
        return Verdict("pass", first_line_with(text, "meets"))
    return None


def first_line_with(text: str, word: str) -> str:
    line = next((ln for ln in text.splitlines() if word in ln), "")
    return re.sub(r"\s+", " ", line.replace("**", "")).strip()[:220]


def v_gate(text: str, pair: str = "rpc / rpc-gate", reading: str = "off over on") -> Verdict:
    """A paired row of bench/throughput.py (gated sets off over on, by default): its median per column (the middle of
    min / median / max)."""
    row = next((r for r in table_rows(text) if r and r[0] == pair), None)
    if row is None or len(row) < 4:
        return Verdict("info", f"no paired {pair} row in the file")
    medians = [cell.replace("**", "").split(" / ")[1] for cell in row[1:4]]
    return Verdict("info", f"{reading}, paired medians (prefill / decode / 4 streams): " + " / ".join(medians))


def v_ubatch_overlap(text: str) -> Verdict:
    """Prefill at the RPC routes' -ub 256 over -ub 512, paired per run (bench/throughput.py's rpc / rpc-ub512 and
    hybrid / hybrid-ub512 rows): pass when both medians are above 1."""
    found = []
    for route in ("rpc", "hybrid"):
        row = next((r for r in table_rows(text) if r and r[0] == f"{route} / {route}-ub512"), None)
        if row is None or len(row) < 2:
            return Verdict("info", f"no paired {route} / {route}-ub512 row in the file")
        found.append((route, row[1].replace("**", "")))
    ok = all(float(cell.split(" / ")[1]) > 1 for _, cell in found)
    return Verdict("pass" if ok else "FAIL", "prefill at -ub 256 over -ub 512, paired (min / median / max, runs where "
                   "256 was faster): " + "; ".join(f"{r} {c}" for r, c in found))


def v_in_place(text: str) -> Verdict:
    """bench/rpc_link.py's uploads with patch 0014 (sets sent from where their data lies) against the rows with it off
    ("sets copied first"), shared memory and TCP, each with polling: pass when every upload of 4 MiB or more is
    faster in place (medians over runs)."""
    rows = table_rows(text)
    header = next((r for r in rows if r and r[0] == "link"), None)
    if header is None:
        return Verdict("info", "no link table in the file")
    cols = [i for i, h in enumerate(header) if h.startswith("upload") and float(h.split()[1]) >= 4]
    by_name = {r[0]: r for r in rows if r and r[0] != "link"}
    found, ok = [], True
    for name, row in by_name.items():
        copied = by_name.get(name + ", sets copied first")
        if copied is None or not cols:
            continue
        for i in cols:
            us_in, us_copy = median_of(row[i]), median_of(copied[i])
            if us_in is None or us_copy is None:
                continue
            ok = ok and us_in < us_copy
            found.append(f"{name}, {header[i]}: {us_copy:.0f} -> {us_in:.0f} us")
    if not found:
        return Verdict("info", "no 'sets copied first' rows in the file (a run before patch 0014)")
    return Verdict("pass" if ok else "FAIL", "copied first -> in place (median us): " + "; ".join(found))


def v_plan_speed(text: str) -> Verdict:
    rows = [r for r in table_rows(text) if len(r) >= 8 and r[6].endswith("x")]
    ratios = [(r[0], float(r[6].rstrip("x")), float(r[7].rstrip("x"))) for r in rows]
    if not ratios:
        return Verdict("info", "no ratios found")
    cold = min(ratios, key=lambda x: x[1])
    warm = min(r[2] for r in ratios)
    measured = [float(r[9].rstrip("x")) for r in rows if len(r) >= 10 and r[9].endswith("x")]
    status = "pass" if cold[1] >= 20 else ("FAIL cold, pass warm" if warm >= 20 else "FAIL")
    more = f"; {min(measured):.0f}x with compute measured by llama.cpp and cached" if measured else ""
    return Verdict(status, f"worst cold case {cold[0]}: llama.cpp takes {cold[1]:.0f}x arcsplit's time with the "
                   f"header read each time; {warm:.0f}x at worst with the profile cache warm{more}; "
                   f"{len(ratios)} models")


def v_plan_accuracy(text: str) -> Verdict:
    oks = [r[-1] for r in table_rows(text) if r and r[-1] in ("yes", "NO")]
    if not oks:
        return Verdict("info", "no rows found")
    bad = oks.count("NO")
    margin = sum(1 for r in table_rows(text) if r and r[-1] == "margin")
    more = f"; {margin} cards of unchecked families above it with their +50 % margin" if margin else ""
    return Verdict("pass" if not bad else "FAIL", f"{len(oks) - bad}/{len(oks)} cards within max(2 %, 16 MiB), "
                   f"none below by more than 16 MiB{more}")


def v_fit_context(text: str) -> Verdict:
    m = re.search(r"Ratio arcsplit / fit: min ([\d.]+), max ([\d.]+) \(target >= 1\.0: (\w+)\); arcsplit's context "
                  r"loads and answers in (\d+)/(\d+); its allocation stays within the budget on every card in "
                  r"(\d+)/(\d+)", text)
    if not m:
        return Verdict("info", "no summary line found")
    ok = m.group(3) == "meets" and m.group(4) == m.group(5)
    return Verdict("pass" if ok else "FAIL", f"context ratio min {m.group(1)}, max {m.group(2)}; loads "
                   f"{m.group(4)}/{m.group(5)}; within budget {m.group(6)}/{m.group(7)}")


def throughput_ratios(text: str) -> dict[str, dict[str, float]]:
    """mode -> {prefill, decode, 4 streams} ratios to native, from a throughput_<backend>.md table."""
    out: dict[str, dict[str, float]] = {}
    for r in table_rows(text):
        m = re.match(r"(native|hybrid|rpc) \(", r[0]) if r else None
        if m and len(r) >= 9 and all(x.endswith("x") for x in r[6:9]):
            out[m.group(1)] = {k: float(v.rstrip("x")) for k, v in zip(("prefill", "decode", "4 streams"), r[6:9])}
    return out


def v_throughput(text: str, backend: str) -> Verdict:
    ratios = throughput_ratios(text)
    if "hybrid" not in ratios:
        return Verdict("info", "no hybrid row")
    h = ratios["hybrid"]
    desc = ", ".join(f"{k} {h[k]:.2f}x (>= {t})" for k, t in HYBRID_TARGETS.items())
    rpc = ratios.get("rpc")
    if rpc:
        desc += "; all-RPC " + ", ".join(f"{k} {v:.2f}x" for k, v in rpc.items())
    eq = "greedy output equal in every mode" if not re.search(r"\| NO \(", text) else "greedy output DIFFERS"
    desc += f"; {eq}"
    if backend == "cpu":
        return Verdict("info", f"CPU cards (targets are for GPUs): hybrid {desc}")
    ok = all(h[k] >= t for k, t in HYBRID_TARGETS.items())
    return Verdict("pass" if ok else "FAIL", f"hybrid {desc}")


def v_patch_ab(text: str) -> Verdict:
    """Ratios to native of each arcsplit change against the same build without it, from one side-by-side run:
    ``X`` vs ``X-stock`` (patches off), ``X-last`` vs ``X-last-stock``, ``X`` vs ``X-nospin`` (link polling off)."""
    rows: dict[str, dict[str, float]] = {}
    for r in table_rows(text):
        m = re.match(r"((?:hybrid|rpc)(?:-last|-local)?(?:-stock|-nospin)?) \(", r[0]) if r else None
        if m and len(r) >= 9 and all(x.endswith("x") for x in r[6:9]):
            rows[m.group(1)] = {k: float(v.rstrip("x")) for k, v in zip(("prefill", "decode", "4 streams"), r[6:9])}
    parts = []
    for new, old, what in [(f"{route}{place}", f"{route}{place}{off}", label)
                           for route in ("hybrid", "rpc") for place in ("", "-last", "-local")
                           for off, label in (("-stock", "patches"), ("-nospin", "polling"))]:
        if new in rows and old in rows:
            a, b = rows[new], rows[old]
            parts.append(f"{new} without -> with {what}: " + ", ".join(f"{k} {b[k]:.2f} -> {a[k]:.2f}x" for k in a))
    if not parts:
        return Verdict("info", "no stock/patched pair in the file")
    eq = "greedy output equal in every mode" if not re.search(r"\| NO \(", text) else "greedy output DIFFERS"
    return Verdict("info", "ratios to native: " + "; ".join(parts) + f"; {eq}")


def spread_columns(text: str) -> dict[str, dict[str, str]]:
    """mode -> {column header: cell} of bench/throughput.py's tables, read by header (column order has changed)."""
    out: dict[str, dict[str, str]] = {}
    header: list[str] = []
    for r in table_rows(text):
        if r and r[0] == "mode":
            header = r
        elif header and r and re.match(r"\S+ \(", r[0]):
            out.setdefault(r[0].split(" (")[0], dict(zip(header, r)))
    return out


def median_of(cell: str) -> float | None:
    """The median of a ``min / **median** / max`` cell, or a single ``1.23x`` value; None for ``-``."""
    m = re.search(r"\*\*([-+]?\d[\d.]*)\*\*", cell) or re.fullmatch(r"([-+]?\d[\d.]*)x?", cell.strip())
    return float(m.group(1)) if m else None


TTFT_TARGET = 1.2  # time to first token of a 512-token prompt on an RPC route, over native's (cache on and off)


def v_ttft(text: str) -> Verdict:
    """TTFT / native (cache off and on) of every RPC mode, median over runs, and the card the file names."""
    cols = spread_columns(text)
    card = re.search(r"GPU 0: (NVIDIA [^(]+?) \(", text)
    parts, ok, seen = [], True, False
    for mode, c in cols.items():
        if mode == "native":
            continue
        off, on = median_of(c.get("TTFT / native", "-")), median_of(c.get("TTFT cache on / native", "-"))
        if off is None:
            continue
        seen = True
        if not mode.endswith(("-nospan", "-nocram", "-load")):  # a patch switched off: shown, not judged
            ok &= off <= TTFT_TARGET and (on is None or on <= TTFT_TARGET)
        parts.append(f"{mode} {off:.2f}" + (f" / {on:.2f}" if on is not None else "") +
                     f" ({c.get('TTFT ms', '-')}" + (f" / {c.get('TTFT ms, cache on')}" if on is not None else "")
                     + " ms)")
    if not seen:
        return Verdict("info", "no TTFT columns in the file")
    where = card.group(1).strip() if card else "CPU"
    return Verdict("pass" if ok else "FAIL", f"{where}, TTFT over native's, cache off / on (medians over runs; "
                   f"-nospan: patch 0010 off; -load: 0011 off; -nocram: no prompt cache; -gate: gated sets on): "
                   + "; ".join(parts))


def v_token_us(text: str) -> Verdict:
    """Decode microseconds per token over native per RPC mode (min / median / max over runs), with the card."""
    cols = spread_columns(text)
    card = re.search(r"GPU 0: (NVIDIA [^(]+?) \(", text)
    mps = "under MPS" if re.search(r"_mps", text) else "time-sliced"
    us = {m: c["decode us/token over native"] for m, c in cols.items() if "decode us/token over native" in c}
    if not us and "native" in cols:  # a one-run table: from its decode t/s
        base = median_of(cols["native"].get("decode t/s", "-"))
        us = {m: f"{1e6 / d - 1e6 / base:+.0f}" for m, c in cols.items()
              if base and (d := median_of(c.get("decode t/s", "-")))}
    parts = [f"{m} {v}" for m, v in us.items() if m != "native"]
    if not parts:
        return Verdict("info", "no us/token column in the file")
    # the routes' own rows; a file of variants only (rpc-bs, hybrid-bs) is judged by those
    meds = [median_of(v) for m, v in us.items() if m in ("hybrid", "rpc")] or \
        [median_of(v) for m, v in us.items() if m.split("-")[0] in ("hybrid", "rpc")]
    ok = bool(meds) and all(x is not None and x <= 100 for x in meds)
    runs = re.search(r"(\d+) independent runs", text)
    return Verdict("pass" if ok and mps == "under MPS" else ("FAIL" if mps == "under MPS" else "info"),
                   f"{card.group(1).strip() if card else '?'}, {mps}, {runs.group(1) if runs else 1} runs, us/token "
                   "over native (min / median / max): " + "; ".join(parts).replace("**", ""))


def v_twin_us(text: str) -> Verdict:
    """bench/twin_cost.py on one file: each split mode's decode us/token over native with the same tag (rpc-bs over
    native-bs), per run; pass when every plain route's twin median (hybrid-bs, rpc-bs; not -alt rows) is <= 100."""
    from throughput import us_cell
    from twin_cost import card, twin_costs

    costs = twin_costs(text)
    if not costs:
        return Verdict("info", "no mode with a native twin in the file")
    judged = [statistics.median(xs) for (m, _), xs in costs.items() if not m.endswith("-alt")]
    ok = bool(judged) and all(x <= 100 for x in judged)
    return Verdict("pass" if ok else "FAIL", f"{card(text)}, us/token over the native twin (min / median / max over "
                   "runs): " + "; ".join(f"{m} over {t} {us_cell(xs)}" for (m, t), xs in costs.items()).replace("**", ""))


def v_link_calls(text: str) -> Verdict:
    """bench/link_bytes.py --after-streams: calls and bytes per request on rpc0, KV state per run of cells vs spans
    (0010), and without the load a cache_prompt false request does not use (0011)."""
    rows = [r for r in table_rows(text) if len(r) >= 9 and r[2] == "rpc0"]
    if not rows:
        return Verdict("info", "no rows")

    def label(first: str) -> str:
        return ("spans + 0011" if "0011" in first else "spans" if "spans" in first else "per run")

    parts = [f"{label(r[0])}, cache_prompt {r[1]}: {r[3].split(' / ')[1]} calls, "
             f"{r[7].split(' / ')[1]} bytes" for r in rows]
    return Verdict("info", "rpc0 per request (medians): " + "; ".join(parts))


def v_lru(text: str) -> Verdict:
    """--pattern lru: no mode's prefill repetitions more than 2x apart (the bimodal prefill), and TTFT over native.
    A TTFT spread is said but not the bimodal figure: it shows in native too (the prompt cache's slot save)."""
    spread = re.search(r"within 2x of each other[^:]*: (yes|\*\*FAILED\*\*.*)", text)
    failed = spread.group(1) if spread and spread.group(1) != "yes" else ""
    prefill_ok = bool(spread) and ", prefill:" not in failed
    ttft = v_ttft(text)
    note = ("no mode's prefill repetitions more than 2x apart" if prefill_ok else "prefill repetitions more than 2x apart")
    if failed and prefill_ok:
        note += " (TTFT repetitions more than 2x apart: " + "; ".join(re.findall(r"run \d+, [\w-]+, ttft", failed)) + ")"
    return Verdict("pass" if prefill_ok and ttft.status == "pass" else "FAIL", note + "; " + ttft.detail)


def v_offload_gpu(text: str) -> Verdict:
    """bench/moe_offload.py --by-hand on a GPU: arcsplit's greedy tokens equal llama.cpp's own at each N (the last
    column; files before it had only "= first row"), and each row's decode / prefill medians."""
    rows = [r for r in table_rows(text) if len(r) >= 6 and re.match(r"(arcsplit|llama-server)", r[0])]
    if not rows:
        return Verdict("info", "no rows")
    paired = len(rows[0]) >= 7
    ok = all((r[6] if paired else r[5]).strip() != "NO" for r in rows)
    what = "arcsplit's greedy tokens = llama.cpp's at each N" if paired else "greedy tokens = no offload"
    return Verdict("pass" if ok else "FAIL", f"{what}: {'yes' if ok else 'NO'}; decode / prefill t/s (median): " +
                   "; ".join(f"{r[0]} {median_of(r[3])} / {median_of(r[4])}" for r in rows))


ONE_GPU_TARGETS = {"hybrid": {"prefill": 0.85, "decode": 0.93, "4 streams": 0.93},
                   "rpc": {"prefill": 0.75, "decode": 0.85}}


def v_one_gpu(text: str) -> Verdict:
    """Issue 19's one-GPU targets against the median over runs (``min / **median** / max`` cells of
    bench/merge_runs.py or throughput.py --runs), and whether any route is slower with the patches than without."""
    med: dict[str, dict[str, float]] = {}
    for r in table_rows(text):
        m = re.match(r"((?:hybrid|rpc)(?:-stock)?) \(", r[0]) if r else None
        cells = [c for c in r if "**" in c]  # prefill, decode, 4 streams (then ready time, ready / native)
        if m and len(cells) >= 3:
            med[m.group(1)] = {k: float(c.split("**")[1]) for k, c in zip(("prefill", "decode", "4 streams"), cells)}
    if not med:
        return Verdict("info", "no spread table in the file")
    parts, ok = [], True
    for route, targets in ONE_GPU_TARGETS.items():
        if route not in med:
            continue
        got = med[route]
        ok &= all(got[k] >= t for k, t in targets.items())
        parts.append(f"{route} " + ", ".join(f"{k} {got[k]:.2f}" + (f" (>= {targets[k]})" if k in targets else "")
                                            for k in got))
        if f"{route}-stock" in med:
            slower = [k for k in got if got[k] < med[f"{route}-stock"][k]]
            parts[-1] += f"; stock {', '.join(f'{v:.2f}' for v in med[f'{route}-stock'].values())}" + (
                f", slower with the patches: {', '.join(slower)}" if slower else "")
    eq = "greedy output equal in every mode" if not re.search(r"NO \(", text) else "greedy output DIFFERS"
    runs = re.search(r"(\d+) independent runs", text)
    if ok and runs and int(runs.group(1)) < 3:  # met, but on fewer runs than the figure asks: said, not passed
        return Verdict("info", f"targets met on {runs.group(1)} runs only (3+ asked): " + "; ".join(parts) + f"; {eq}")
    return Verdict("pass" if ok else "FAIL", "medians over runs: " + "; ".join(parts) + f"; {eq}")


def v_generic(text: str) -> Verdict:
    return meets(text) or Verdict("info", "no target stated in the file")


def v_fuzz(text: str) -> Verdict:
    for r in table_rows(text):
        if len(r) >= 5 and r[0].replace(",", "").isdigit():
            crash, timeout = r[3].replace(",", ""), r[4].replace(",", "")
            ok = crash == "0" and timeout == "0"
            return Verdict("pass" if ok else "FAIL", f"{r[0]} cases: {crash} crashes, {timeout} timeouts")
    return v_generic(text)


def v_load(text: str) -> Verdict:
    """load_time.md: the seeded routes' time to ready against native's (the target: hybrid <= 2x native)."""
    ratio = {(r[0], r[1]): r[3] for r in table_rows(text) if len(r) >= 5 and r[1] in ("socket", "seed")}
    same = all(r[4] == "yes" for r in table_rows(text) if len(r) >= 5 and r[1] in ("-", "socket", "seed"))
    parts = [f"{route} {ratio[(route, 'socket')]} -> {ratio[(route, 'seed')]}" for route in ("hybrid", "rpc")
             if (route, "socket") in ratio and (route, "seed") in ratio]
    if not parts:
        return v_generic(text)
    ok = same and float(ratio.get(("hybrid", "seed"), "99x").rstrip("x")) <= 2.0
    return Verdict("pass (CPU)" if ok else "FAIL", f"median / native, socket -> seeded: {'; '.join(parts)}; "
                   f"greedy identical: {'yes' if same else 'NO'}")


def v_load_in_place(text: str) -> Verdict:
    """load_time_inplace.md: time to ready with the weights over the socket, each sent from where it lies (patch
    0014) against copied first: info, the medians per route."""
    med = {(r[0], r[1]): r[2] for r in table_rows(text) if len(r) >= 5 and r[1].startswith("socket")}
    parts = [f"{route} {median_of(med[(route, 'socket, copied first')])} -> {median_of(med[(route, 'socket')])} s"
             for route in ("hybrid", "rpc") if (route, "socket") in med and (route, "socket, copied first") in med]
    same = all(r[4] == "yes" for r in table_rows(text) if len(r) >= 5 and r[1] != "weights")
    if not parts:
        return v_generic(text)
    return Verdict("info", f"ready (median), copied first -> in place: {'; '.join(parts)}; greedy identical: "
                   f"{'yes' if same else 'NO'}")


def v_load_pieces(text: str) -> Verdict:
    """load_time_pieces.md: time to ready and the rpc-servers' peak memory with every weight over the socket, each
    above 64 MiB received in pieces (patch 0003) against whole: info, the medians per route."""
    rows = {(r[0], r[1]): r for r in table_rows(text) if len(r) >= 6 and r[1].startswith("socket")}
    whole = "socket, received whole"
    parts = [f"{route} {median_of(rows[(route, whole)][2])} -> {median_of(rows[(route, 'socket')][2])} s, peak "
             f"{rows[(route, whole)][4]} -> {rows[(route, 'socket')][4]} MiB"
             for route in ("hybrid", "rpc") if (route, "socket") in rows and (route, whole) in rows]
    same = all(r[-1] == "yes" for r in table_rows(text) if len(r) >= 6 and r[1] != "weights")
    if not parts:
        return v_generic(text)
    return Verdict("info", f"received whole -> in pieces (ready median, rpc-server peak): {'; '.join(parts)}; greedy "
                   f"identical: {'yes' if same else 'NO'}")


def _rpc0_bytes(text: str) -> dict[int, float]:
    """link_bytes files: rpc0's measured bytes per request (median), by prompt length."""
    return {int(r[1]): float(r[3].split("/")[1].strip(" *").replace(",", ""))  # "min / median / max", plain
            for r in table_rows(text) if len(r) >= 8 and r[0] == "rpc0" and r[1].isdigit()}


def v_link_input(text: str) -> Verdict:
    """link_bytes_input_on_card.md against link_bytes.md (same bench, the embeddings on llama-server): what the
    first rpc-server's socket carries per request with the token ids crossing instead (patch 0015): info."""
    card = _rpc0_bytes(text)
    path = RESULTS / "link_bytes.md"
    host = _rpc0_bytes(path.read_text(encoding="utf-8")) if path.is_file() else {}
    parts = [f"{n}-token prompt {host[n] / 1e6:.2f} -> {card[n] / 1e6:.2f} MB" for n in sorted(card) if n in host]
    if not parts:
        return v_generic(text)
    return Verdict("info", f"rpc0's socket per request (16 tokens decoded), embeddings on llama-server -> on the "
                   f"first card: {'; '.join(parts)}")


def v_input_link(text: str) -> Verdict:
    """input_on_card_link*.md: every card on another host, the token embeddings there against on llama-server: info,
    the median bytes sent and first token per case."""
    rows = [r for r in table_rows(text) if len(r) >= 5 and r[0].startswith("on ")]
    if len(rows) != 2:
        return v_generic(text)
    (host, card) = rows
    t_host, t_card = median_of(host[3]), median_of(card[3])
    same = all(r[4] == "yes" for r in rows)
    if not (t_host and t_card):
        return v_generic(text)
    return Verdict("info", f"on llama-server -> on b's first card: {host[2].split('**')[1]} -> {card[2].split('**')[1]} "
                   f"bytes to b a request, first token {t_host:.0f} -> {t_card:.0f} ms ({t_card / t_host:.2f}x; "
                   f"layers per card {host[1]} -> {card[1]}); greedy identical: {'yes' if same else 'NO'}")


def v_plan_accuracy_cuda(text: str) -> Verdict:
    """plan_accuracy_cuda.md: no card more than 16 MiB under llama.cpp's CUDA allocation (the plan-accuracy
    target); "over" cards are the backend row's stated margin."""
    v = [r[-1] for r in table_rows(text) if r and r[-1] in ("yes", "over", "NO")]
    if not v:
        return Verdict("info", "no rows found")
    return Verdict("pass" if "NO" not in v else "FAIL",
                   f"{v.count('yes')}/{len(v)} cards within max(2 %, 16 MiB), {v.count('over')} above it (the "
                   f"safe side), {v.count('NO')} under by more than 16 MiB")


def v_gpu_load(text: str, name: str) -> Verdict:
    """One GPU, 14 GB model: hybrid ready within 2x native (a throughput file's ready column), or an rpc-server
    killed and serving again within 10 s (a recover file)."""
    if name.startswith("gpu/recover"):
        m = re.search(r"Ready again after min / \*\*median\*\* / max ([\d.]+) / \*\*([\d.]+)\*\* / ([\d.]+) s", text)
        if not m:
            return Verdict("info", "no summary line found")
        ok = float(m.group(3)) <= 10.0 and "| False |" not in text
        return Verdict("pass" if ok else "FAIL", f"ready again after SIGKILL: {m.group(1)} / {m.group(2)} / "
                       f"{m.group(3)} s (min / median / max; target <= 10 s); same greedy tokens after")
    rows = {r[0].split(" (")[0]: r for r in table_rows(text) if len(r) >= 12 and "**" in r[-1]}
    if "hybrid" not in rows:
        return Verdict("info", "no ready column")
    ready = {k: r[-1].split("**")[1] for k, r in rows.items() if k != "native"}
    ok = float(ready["hybrid"]) <= 2.0
    return Verdict("pass" if ok else "FAIL", "time to ready / native, median over runs: "
                   + ", ".join(f"{k} {v}x" for k, v in ready.items()) + " (hybrid target <= 2x)")


def v_trace(text: str) -> Verdict:
    """gpu/trace_*.md (bench/gpu_trace.py): each route's extra time per token over native, split into GPU work
    and GPU idle, and its largest idle crossing between processes."""
    extra = re.findall(r"^- (\S+): \+(\d+) us per token = GPU work \+?(-?\d+) .* idle \+?(-?\d+)$", text, re.M)
    hand = re.findall(r"^- (\S+): (\S+ -> \S+): [\d.]+ per token, (\d+) us each$", text, re.M)
    if not extra:
        return Verdict("info", "no route against native in the file")
    parts = []
    for mode, total, work, idle in extra:
        worst = max(((int(us), k) for m, k, us in hand if m == mode), default=None)
        parts.append(f"{mode} +{total} us/token (GPU work {work}, GPU idle {idle}"
                     + (f"; largest crossing {worst[1]} {worst[0]} us" if worst else "") + ")")
    return Verdict("info", "traced (CUPTI slows every process): " + "; ".join(parts))


def v_loadtool(text: str) -> Verdict:
    """Locust's row against loadgen's: every request answered, and the median output tokens/s of each."""
    rows = {r[0]: r for r in table_rows(text) if len(r) >= 7 and r[0] in ("Locust", "bench/loadgen.py")}
    if set(rows) != {"Locust", "bench/loadgen.py"}:
        return Verdict("missing", "no Locust and loadgen rows in the file")
    failed = {k: r[1].rsplit("(", 1)[-1].rstrip(")") for k, r in rows.items()}
    tok = {k: r[3].split(" / ")[1] for k, r in rows.items()}
    return Verdict("pass" if set(failed.values()) == {"0"} else "FAIL",
                   f"Locust: {failed['Locust']} failed, median {tok['Locust']} output tokens/s; bench/loadgen.py: "
                   f"{failed['bench/loadgen.py']} failed, {tok['bench/loadgen.py']} tokens/s "
                   "(same server, alternating)")


def v_wait_word(text: str) -> Verdict:
    """bench/gpu/wait_host_word.cu's line: every round held until the store and read the new value back."""
    m = re.search(r"(\d+) rounds; the stream held until the store in (\d+), the new value came back in (\d+); "
                  r"store -> stream done: ([\d.]+) / ([\d.]+) / ([\d.]+) us", text)
    if not m:
        return Verdict("FAIL", "no wait_host_word line in the file")
    rounds, held, back = (int(m.group(i)) for i in (1, 2, 3))
    ok = rounds > 0 and held == rounds == back
    return Verdict("pass" if ok else "FAIL", f"held {held}/{rounds}, new value back {back}/{rounds}; store to the "
                   f"stream's end {m.group(4)} / {m.group(5)} / {m.group(6)} us (min / median / max)")


def v_setup(text: str) -> Verdict:
    rows = [r for r in table_rows(text) if r and r[0].startswith("`./scripts/")]
    return Verdict("info", "; ".join(f"{r[0]} {r[1]} s, .venv {r[2]} MiB (min / median / max)" for r in rows)
                   or "no rows found")


def v_chaos(text: str) -> Verdict:
    """chaos.md: no request lost after a recovery and no process left on either host, every fault and config."""
    faults = [r for r in table_rows(text) if len(r) >= 6 and r[2].isdigit()]
    left = [r for r in table_rows(text) if len(r) == 3 and r[0] != "config"]
    if not faults:
        return Verdict("missing", "no fault rows found")
    lost = sum(int(r[5]) for r in faults)
    stray = sum(int(c) for r in left for c in r[1:] if c.strip().isdigit())
    medians = [float(r[3].split("/")[1].strip(" *")) for r in faults]
    ok = lost == 0 and stray == 0
    return Verdict("pass" if ok else "FAIL", f"{len(faults)} fault rows (3+ runs each): recovery medians {min(medians):.1f}-"
                   f"{max(medians):.1f} s; {lost} requests lost after recovery, {stray} processes left")


def v_hangs(text: str) -> Verdict:
    """hangs.md: each hang kind noticed within 30 s of a request's last progress (busy) or 60 s (idle), and serving
    the same tokens again within 60 s of the freeze, every run."""
    rows = [r for r in table_rows(text) if len(r) >= 7 and r[1].isdigit() and int(r[1]) > 0]
    if not rows:
        return Verdict("missing", "no hang rows found")

    def worst(cell: str) -> float:
        return float(cell.split("/")[2].strip(" *"))

    ok = all(worst(r[2]) <= (60.0 if "idle" in r[0] else 30.0) and worst(r[3]) <= 60.0 for r in rows)
    return Verdict("pass" if ok else "FAIL", "; ".join(f"{r[0]}: noticed {r[2]} s, serving again {r[3]} s"
                                                       for r in rows) + " (min / median / max)")


def v_corrupt(text: str) -> Verdict:
    """corrupt.md: the route that turned wrong left for the next one within one canary interval and one check (10 s),
    every run, and no wrong answer after the recovery."""
    rows = [r for r in table_rows(text) if len(r) >= 6 and r[1].isdigit() and int(r[1]) > 0]
    m = re.search(r"--canary-every (\d+(?:\.\d+)?)", text)
    if not rows or m is None or "/" not in rows[0][2]:
        return Verdict("missing", "no corruption row found")
    r = rows[0]
    worst = float(r[2].split("/")[2].strip(" *"))
    ok = worst <= float(m.group(1)) + 10.0 and r[5].strip() == "0"
    return Verdict("pass" if ok else "FAIL", f"{r[0]}: caught {r[2]} s, correct again {r[3]} s (min / median / max, "
                   f"{r[1]} runs, canary every {m.group(1)} s); requests in the window errored / wrong / all: {r[4]}; "
                   f"wrong after: {r[5]}")


def v_tune(text: str, ratio: str = "pick/default") -> Verdict:
    """tune.md's first table: tune's pick re-measured against the default order's route, and no wrong route
    (``ratio``: how the file's ratio reads; default/pick where the objective is a time)."""
    rows = []
    for r in table_rows(text):
        if r[0] in ("rig", "candidate"):  # a header: the rig table's own, or a per-candidate table after it
            if rows:
                break
            continue
        if len(r) >= 7:
            rows.append(r)
    if not rows:
        return Verdict("missing", "no rig rows found")
    worst = min(float(r[3].split("/")[0]) for r in rows)
    rejected = sum(int(r[6]) for r in rows)
    # the 8th column (picks correct, "k/n") came with --corrupt-rpc; before it every rig's routes were all correct
    bad_picks = sum(int(r[7].split("/")[1]) - int(r[7].split("/")[0]) for r in rows if len(r) >= 8) \
        if any(len(r) >= 8 for r in rows) else rejected
    ok = worst >= 0.95 and bad_picks == 0  # a ratio at 1.00 is the default kept; short runs: 5 % noise
    return Verdict("pass" if ok else "FAIL", "; ".join(f"{r[0]}: {ratio} {r[3]}, wall {r[4]} s" for r in rows)
                   + f"; wrong routes rejected: {rejected}; wrong picks: {bad_picks}")


def v_startup(text: str) -> Verdict:
    """startup.md: each entry point's median in this tree (last column) against the base tree's, same run."""
    def median(cell: str) -> float:
        return float(cell.split("/")[1].strip(" *"))

    rows = [r for r in table_rows(text) if len(r) == 3 and r[0] != "what"]
    if not rows:
        return Verdict("missing", "no rows found")
    slower = [r[0] for r in rows if median(r[2]) > median(r[1])]
    detail = "; ".join(f"{r[0]}: median {median(r[1]):.0f} -> {median(r[2]):.0f} ms" for r in rows)
    return Verdict("FAIL" if slower else "pass", detail)


@dataclass(frozen=True)
class Figure:
    title: str
    target: str
    files: tuple[str, ...]
    judge: Callable[[str, str], Verdict]  # (text, file name) -> verdict


# the one-H100 files under MPS (2026-12-07 and 12-08), newest first: a figure's current result is its first file
MOE_MPS = tuple(f"gpu/ttft/throughput_cuda_onecard_moe16x32_mps{t}.md"
                for t in ("_s22", "_s17c", "_s17b", "_s17", "_s18", "_s18b", "_s19", "_default", "_0011", "_b", ""))
DENSE_MPS = tuple(f"gpu/ttft/throughput_cuda_onecard_model7b_mps{t}.md" for t in ("_s22", "_s17c", "_s17b", "_s17", "_s18", "_0011", "_c"))

FIGURES = [
    Figure("1. Plan time vs llama-fit-params", "arcsplit's plan in at most 1/20 of llama-fit-params' time",
           ("plan_speed.md",), lambda t, f: v_plan_speed(t)),
    Figure("2. Plan accuracy per card vs llama.cpp",
           "every card within max(2 %, 16 MiB) of llama-fit-params, never below by more than 16 MiB",
           ("plan_accuracy.md",), lambda t, f: v_plan_accuracy(t)),
    Figure("2a. Plan accuracy per card vs llama.cpp's CUDA allocator (one H200; --replan keeps it current)",
           "no card below llama.cpp by more than 16 MiB; within max(2 %, 16 MiB) where the cuda row allows",
           ("gpu/plan_accuracy_cuda.md",), lambda t, f: v_plan_accuracy_cuda(t)),
    Figure("2b. MoE experts in host RAM (--moe-offload), CPU cards", "greedy output identical to no offload",
           ("moe_offload.md",), lambda t, f: Verdict("pass" if "| NO |" not in t and "| yes |" in t else "FAIL",
                                                     "decode t/s and bytes read from host per token in the file")),
    Figure("3. Largest context vs --fit, same margin", "arcsplit / fit >= 1.0, and arcsplit's context loads",
           ("fit_context.md",), lambda t, f: v_fit_context(t)),
    Figure("4. Time to ready vs the same commands by hand", "at most 1.05x", ("time_to_ready.md",),
           lambda t, f: v_generic(t)),
    Figure("4b. Load over RPC on one host: weights over the socket vs read from the GGUF (patch 0006)",
           "hybrid ready within 2x native (a target set for a 14 GB model on a GPU)", ("load_time.md",),
           lambda t, f: v_load(t)),
    Figure("4b2. Load over RPC with every weight over the socket: each sent from where it lies (patch 0014) against "
           "copied first (CPU; not started by run_all)", "measured (the copy's share of a load over the link)",
           ("load_time_inplace.md",), lambda t, f: v_load_in_place(t)),
    Figure("4b3. Load over RPC with every weight over the socket: each above 64 MiB received in pieces (patch 0003) "
           "against whole, a 7B model's layer shapes (CPU; not started by run_all)",
           "measured (ready time and the rpc-servers' peak memory)",
           ("load_time_pieces.md",), lambda t, f: v_load_pieces(t)),
    Figure("4c. Recovery after SIGKILL of an rpc-server, weights over the socket vs read from the GGUF (CPU)",
           "<= 10 s on the 14 GB GPU model; on CPU: measured",
           ("recover_cpu_rpc_socket.md", "recover_cpu_rpc_seed.md", "recover_cpu_hybrid_socket.md",
            "recover_cpu_hybrid_seed.md"), lambda t, f: Verdict("info", first_line_with(t, "Ready again after"))),
    Figure("4d. Load and recovery on one GPU (H200, 14.5 GB F16, weights read from the GGUF by the rpc-servers)",
           "hybrid ready within 2x native; serving again <= 10 s after SIGKILL of an rpc-server",
           ("gpu/load_cuda_onecard_dense.md", "gpu/recover_cuda_onecard_hybrid.md"), v_gpu_load),
    Figure("5. Throughput per mode (prefill, decode, 4 streams)",
           "hybrid >= 0.75x prefill, >= 0.90x decode, >= 0.90x 4 streams of native, on 2 real GPUs",
           ("throughput_cuda.md", "throughput_cpu.md"),
           lambda t, f: v_throughput(t, f.removeprefix("throughput_").removesuffix(".md"))),
    Figure("5b. arcsplit's llama.cpp patches, with vs without in one run (2x H200)",
           "a gain over the same build with the change switched off (docs/patches.md)",
           ("gpu/throughput_cuda_spin_0001-0005.md", "gpu/throughput_cuda_0001-0004.md",
            "gpu/throughput_cuda_np128_0001-0004.md", "gpu/throughput_cuda_rpc_0001-0004.md",
            "gpu/throughput_cuda_ab_hybrid.md", "gpu/throughput_cuda_ab_hybrid_np128.md",
            "gpu/throughput_cuda_ab_rpc.md"), lambda t, f: v_patch_ab(t)),
    Figure("5c. Blocking waits per token on the RPC routes, stock vs patched (CPU, hardware-independent)",
           "fewer waits with the patch (its mechanism; tokens/s on 2 shared cores is noise)",
           ("rpc_waits.md",), lambda t, f: Verdict("info", first_line_with(t, "Result:").removeprefix("Result: "))),
    Figure("5d. The RPC route's tax on one GPU (H200, llama-server and rpc-servers share it; 3+ runs)",
           "hybrid >= 0.85 prefill, >= 0.93 decode and 4 streams; all-RPC >= 0.75 prefill, >= 0.85 decode, "
           "and no route slower with the patches",
           ("gpu/throughput_cuda_onecard_model7b_mps_final.md", "gpu/throughput_cuda_onecard_moe16x32_mps_final_6runs.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_final.md", "gpu/throughput_cuda_onecard_moe16x32_mps_final2.md",
            "gpu/throughput_cuda_onecard_moe16x32_final2.md", "gpu/throughput_cuda_onecard_model7b_final2.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_srvasync_4runs.md", "gpu/throughput_cuda_onecard_moe16x32_mps_srvasync.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_srvasync2.md",
            "gpu/throughput_cuda_onecard_model7b_mps_asyncread.md", "gpu/throughput_cuda_onecard_moe16x32_mps_asyncread_6runs.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_asyncrelay.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_asyncread.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_asyncread2.md", "gpu/throughput_cuda_onecard_moe16x32_asyncread2.md",
            "gpu/throughput_cuda_onecard_model7b_mps_ub2.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_pinned.md", "gpu/throughput_cuda_onecard_model7b_mps_pinned.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_nopin.md", "gpu/throughput_cuda_onecard_model7b_mps_nopin.md",
            "gpu/throughput_cuda_onecard_moe16x32_pinned.md",
            "gpu/throughput_cuda_onecard_moe_0787496fbe.md", "gpu/throughput_cuda_onecard_moe16x32_mps.md",
            "gpu/throughput_cuda_onecard_moe16x32_outlocal.md", "gpu/throughput_cuda_onecard_moe16x32_mps_outlocal.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_ub512.md", "gpu/throughput_cuda_onecard_moe16x32_mps_v2index.md",
            "gpu/throughput_cuda_onecard_model7b_mps_v2index.md", "gpu/throughput_cuda_onecard_model7b_mps_ub.md",
            "gpu/throughput_cuda_onecard_model7b_mps_relay.md", "gpu/throughput_cuda_onecard_model7b_mps_aa.md",
            "gpu/throughput_cuda_onecard_moe16x32_mps_aa.md", "gpu/throughput_cuda_onecard_moe16x32_mps_shm.md",
            "gpu/throughput_cuda_onecard_dense_0787496fbe.md", "gpu/throughput_cuda_onecard_moe.md",
            "gpu/throughput_cuda_onecard_dense.md"), lambda t, f: v_one_gpu(t)),
    Figure("5h. One RPC link on one host, shared memory (patch 0008) against loopback TCP (CPU; the host of a rented H200)",
           "a 4-byte round trip and 4 MiB transfers faster through shared memory (what a same-host link buys)",
           ("rpc_link_cpu.md", "gpu/rpc_link_cuda.md", "rpc_link_cpu_2026-12-03.md"),
           lambda t, f: Verdict("info", first_line_with(t, "Throughput of"))),
    Figure("5h2. An upload of 4 MiB or more from where its data lies (patch 0014) against copied first, one link on "
           "one host (CPU, hardware-independent)",
           "every such upload faster in place, shared memory and TCP (the copy's cost on llama-server's side)",
           ("rpc_link_cpu.md",), lambda t, f: v_in_place(t)),
    Figure("5h3. Sets sent from where their data lies (patch 0014) against copied first on the all-RPC route, paired in "
           "the same runs (CPU cards: compute-bound; not started by run_all)",
           "no slower in place (its GPU gain, the dense all-RPC first token, needs a GPU run: not yet measured)",
           ("throughput_cpu_inplace.md",),
           lambda t, f: v_gate(t, "rpc / rpc-copyset", "in place over copied first")),
    Figure("5i. What llama-server's host-memory prompt cache sends over the RPC link (CPU, hardware-independent)",
           "counted, cache on against --cache-ram 0 (not a patch: llama.cpp's default is kept)",
           ("prompt_cache_link.md",), lambda t, f: Verdict("info", first_line_with(t, "The GETs"))),
    Figure("5j. Gated sets (ARCSPLIT_RPC_GATE=1) against off, paired in the same runs (CPU: the host path; not started "
           "by run_all)", "no slower with gates on where the device cannot wait (their CUDA gain needs a GPU run: not "
           "yet measured)", ("throughput_cpu_gate.md",),
           lambda t, f: v_gate(t)),
    Figure("5l. A prompt's embeddings gated too (ARCSPLIT_RPC_GATE_HOST_KIB), against the same set without, paired "
           "(CPU: the host path; not started by run_all)", "no slower where the device cannot wait (the CUDA gain "
           "needs a GPU run: not yet measured)", ("throughput_cpu_gate_host.md",),
           lambda t, f: v_gate(t, "rpc-gate / rpc-gatenohost", "host inputs gated over not")),
    Figure("5k. Gated sets' device-side wait alone (patch 0009's primitive, bench/gpu/wait_host_word.cu, one H200; not "
           "started by run_all)", "the stream holds the copy and a captured CUDA graph until the host stores the word, "
           "every round", ("gpu/wait_host_word.md",), lambda t, f: v_wait_word(t)),
    Figure("5m. Time to first token, 512-token prompt right after parallel streams, cache off and on (one H100, "
           "time-sliced, MoE; patch 0010 on and off; not started by run_all)",
           "at most 1.2x native on every RPC route, cache on and off",
           ("gpu/ttft/throughput_cuda_onecard_moe16x32.md",), lambda t, f: v_ttft(t)),
    Figure("5n. Time to first token under NVIDIA MPS (one H100, MoE; not started by run_all)",
           "at most 1.2x native on every RPC route, cache on and off",
           MOE_MPS,
           lambda t, f: v_ttft(t)),
    Figure("5n2. Time to first token under NVIDIA MPS, dense 7.2B F16 (one H100; not started by run_all)",
           "at most 1.2x native on every RPC route, cache on and off",
           DENSE_MPS,
           lambda t, f: v_ttft(t)),
    Figure("5o. The request pattern that made all-RPC MoE prefill bimodal (random ids, 64-token warm-up, 3-token "
           "prompts between prefills, -np 4 LRU; one H100, time-sliced; --pattern lru; not started by run_all)",
           "no mode's repetitions more than 2x apart (--max-rep-spread), TTFT at most 1.2x native",
           ("gpu/ttft/throughput_cuda_onecard_moe16x32_lru_recount.md",), lambda t, f: v_lru(t)),
    Figure("5o2. The same request pattern under NVIDIA MPS, patch 0011 on and off (one H100, MoE; not started by "
           "run_all)", "no mode's prefill repetitions more than 2x apart, TTFT at most 1.2x native",
           ("gpu/ttft/throughput_cuda_onecard_moe16x32_mps_lru.md",), lambda t, f: v_lru(t)),
    Figure("5p. Link calls and bytes of a prompt after parallel streams (prompt cache save and restore; CPU, "
           "hardware-independent; bench/link_bytes.py --after-streams)", "fewer calls with patch 0010 (its mechanism)",
           ("link_bytes_prompt_cache.md",), lambda t, f: v_link_calls(t)),
    Figure("5p2. Token ids instead of embeddings to the first rpc-server (patch 0015, ARCSPLIT_INPUT_ON_CARD=1; CPU, "
           "hardware-independent; bench/link_bytes.py --input-on-card; not started by run_all)",
           "fewer bytes to the first rpc-server per request (its mechanism; auto does it where that card is on another "
           "host)", ("link_bytes_input_on_card.md",), lambda t, f: v_link_input(t)),
    Figure("5p3. Every card on another host (a network namespace, the veth shaped by tc): the token embeddings on its "
           "first card (patch 0015, auto there) against on llama-server (CPU; bench/input_on_card.py; root; not "
           "started by run_all)", "measured: bytes to that host and the first token of a 512-token prompt",
           ("input_on_card_link.md", "input_on_card_link_1gbit.md"), lambda t, f: v_input_link(t)),
    Figure("5q. Time to first token on CPU cards (demo model; patch 0010 on and off, paired; not started by run_all)",
           "at most 1.2x native (targets are for GPUs: 2 shared cores)", ("throughput_cpu_ttft.md",),
           lambda t, f: Verdict("info", v_ttft(t).detail)),
    Figure("5u. A prompt's micro-batches overlapping across rpc-servers: prefill at -ub 256 against 512 (CPU cards, "
           "one core each; hardware-independent mechanism; not started by run_all)",
           "faster at the RPC routes' -ub 256 than at 512 (why arcsplit keeps 256 on RPC routes)",
           ("throughput_cpu_ubatch_overlap.md",), lambda t, f: v_ubatch_overlap(t)),
    Figure("5r. Decode cost per token over native, time-sliced (one H100, MoE; not started by run_all)",
           "measured beside the MPS row", ("gpu/ttft/throughput_cuda_onecard_moe16x32.md",),
           lambda t, f: v_token_us(t)),
    Figure("5s. Decode cost per token over native under NVIDIA MPS (one H100, MoE; not started by run_all)",
           "at most 100 us per token over native, hybrid and all-RPC, 3+ runs",
           MOE_MPS,
           lambda t, f: v_token_us(t)),
    Figure("5s2. Decode cost per token over native under NVIDIA MPS, dense 7.2B F16 (one H100; not started by run_all)",
           "at most 100 us per token over native, hybrid and all-RPC, 3+ runs",
           DENSE_MPS,
           lambda t, f: v_token_us(t)),
    Figure("5s3. Decode cost per token over native under NVIDIA MPS, the MoE with Qwen3's 151,936-token vocabulary "
           "(one H100; not started by run_all)",
           "at most 100 us per token over native, hybrid and all-RPC, 3+ runs (the second file: with --backend-sampling)",
           ("gpu/ttft/throughput_cuda_onecard_moe16x32v152k_mps_s19b.md",
            "gpu/ttft/throughput_cuda_onecard_moe16x32v152k_mps_s19c.md"),
           lambda t, f: v_token_us(t)),
    Figure("5s4. Decode cost per token over native with the sampling on the card in both (--backend-sampling; "
           "one H100, MoE with a 151,936-token vocabulary; not started by run_all)",
           "at most 100 us per token over native, hybrid and all-RPC, 3+ runs",
           ("gpu/ttft/throughput_cuda_onecard_moe16x32v152k_mps_s22.md",
            "gpu/ttft/throughput_cuda_onecard_moe16x32v152k_mps_s19c.md",
            "gpu/ttft/throughput_cuda_onecard_moe16x32v152k_mps_s19b.md",
            "gpu/ttft/throughput_cuda_onecard_moe16x32_mps_s18.md"),
           lambda t, f: v_twin_us(t)),
    Figure("5t. Experts in host RAM on a GPU: arcsplit --moe-offload 0/8/16 against llama.cpp's --n-cpu-moe by hand "
           "(one H100, MoE; not started by run_all)", "measured, decode and 512-token prefill; greedy tokens equal",
           ("gpu/ttft/moe_offload_cuda_b.md", "gpu/ttft/moe_offload_cuda_0011.md"), lambda t, f: v_offload_gpu(t)),
    Figure("5e. CPU cost of the RPC link's polling (patch 0005)", "measured (cores busy per token and idle)",
           ("poll_cost.md", "poll_cost_shm.md", "gpu/poll_cost_cuda_onecard_mps.md"), lambda t, f: v_generic(t)),
    Figure("5f. Where a decoded token's time goes on one GPU (CUPTI timeline of every process, H200)",
           "find where the RPC route's per-token time goes: GPU work vs GPU idle, per crossing",
           ("gpu/trace_cuda_onecard_moe16x32_mps_turn_light.md", "gpu/trace_cuda_onecard_model7b_mps_turn_light.md",
            "gpu/trace_cuda_onecard_moe16x32_mps_final_light.md", "gpu/trace_cuda_onecard_model7b_mps_final_prefill.md",
            "gpu/trace_cuda_onecard_model7b_mps_prefill_pinned.md", "gpu/trace_cuda_onecard_moe16x32_mps_pinned_light.md",
            "gpu/trace_cuda_onecard_moe16x32_light.md", "gpu/trace_cuda_onecard_moe16x32_run2_light.md",
            "gpu/trace_cuda_onecard_moe16x32_mps_light.md", "gpu/trace_cuda_onecard_model7b_light.md",
            "gpu/trace_cuda_onecard_moe16x32.md", "gpu/trace_cuda_onecard_model7b.md",
            "gpu/trace_cuda_onecard_model7b_mps_prefill.md", "gpu/trace_cuda_onecard_model7b_mps_prefill_ub512.md"),
           lambda t, f: v_trace(t)),
    Figure("5g. Each llama.cpp patch alone on the pinned tree, with vs switched off (one H200, MoE; all-RPC and hybrid)",
           "a row per patch: it applies and builds alone, and its speed on vs off in one run",
           ("gpu/patches_alone.md", "gpu/patches_alone_hybrid.md"),
           lambda t, f: Verdict("info", first_line_with(t, "Reading"))),
    Figure("6. Several hosts: two \"hosts\" (network namespaces on this machine) over SSH vs one (not started by "
           "run_all: root, sshd)", "over SSH decode >= 0.90x and time to ready <= 1.2x of the same split on one host",
           ("multihost.md", "multihost_ready_final.md", "multihost_ready_r9.md", "multihost_ready_index64k.md", "multihost_ready_stockrc.md", "multihost_ready_stockrc_1.md", "multihost_ready_machinerc.md",
            "multihost_ready_morning_machinerc.md", "multihost_ready_morning_stockrc.md", "multihost_ready_repeat.md", "multihost_ab_early_after.md", "multihost_ab_early_before.md",
            "multihost_quick_after.md", "multihost_quick_before.md", "multihost_quick_repeat.md"),
           lambda t, f: v_generic(t)),
    Figure("6b. Several hosts, time to ready on a 1.5 GB model with real-sized tensors (not started by run_all)",
           "time to ready <= 1.2x of the same split on one host", ("multihost_big.md",), lambda t, f: v_generic(t)),
    Figure("6c. The node agent's start: exec to its rpc-server ready, with and without its first phase (the agent "
           "alone, no ssh; not started by run_all)", "sooner with the first phase (node/quick.py)",
           ("node_start.md", "node_start_hello_after.md", "node_start_hello_after_before.md"),
           lambda t, f: Verdict("info", first_line_with(t, "Median exec to ready"))),
    Figure("Set-up of ./scripts/demo and ./scripts/test on a fresh clone (not started by run_all)",
           "measured: time and .venv size (README)", ("setup_cost.md",), lambda t, f: v_setup(t)),
    Figure("Faults across two hosts under load (bench/chaos.py; network namespaces, not started by run_all)",
           "no request lost after a recovery, no process left on either host", ("chaos.md",),
           lambda t, f: v_chaos(t)),
    Figure("Hangs with every process alive, the progress watchdog at its defaults (bench/hangs.py; root for the "
           "cgroup freezer, not started by run_all)",
           "noticed within 30 s of a request's last progress, 60 s when idle; serving again within 60 s",
           ("hangs.md",), lambda t, f: v_hangs(t)),
    Figure("A hang across two hosts under load: host b's rpc-server frozen (bench/chaos.py --faults 'freeze rpc-server "
           "on b'; not started by run_all)", "no request lost after a recovery, no process left on either host",
           ("chaos_hang.md",), lambda t, f: v_chaos(t)),
    Figure("A route that turns wrong mid-serve under load, the output canary's catch (bench/corrupt.py; not started "
           "by run_all)", "left for the next correct route within one canary interval and a check; no wrong answer "
           "after", ("corrupt.md",), lambda t, f: v_corrupt(t)),
    Figure("arcsplit tune's pick against the fixed default order (CPU cards; not started by run_all)",
           "at least as fast as the default order's route, never a wrong route", ("tune.md",),
           lambda t, f: v_tune(t)),
    Figure("arcsplit tune --objective ttft: its pick by time to first token against the fixed default order (CPU "
           "cards; the ratio is the default's time over the pick's; not started by run_all)",
           "a first token at least as soon as the default order's route's, never a wrong route", ("tune_ttft.md",),
           lambda t, f: v_tune(t, "default/pick")),
    Figure("arcsplit tune on two Vulkan devices (Mesa's lavapipe; -sm layer and tensor, hybrid, all-RPC; the second "
           "file with a bit-flipping forwarder behind every rpc-server; not started by run_all)",
           "at least as fast as the default order's route, never a wrong route",
           ("tune_vulkan.md", "tune_vulkan_corrupt.md"), lambda t, f: v_tune(t)),
    Figure("arcsplit tune on one H100 (native, hybrid and all-RPC sharing the card; the second file a MoE planned on "
           "2.5 GiB cards, so --n-cpu-moe; the third with a bit-flipping forwarder behind every rpc-server; not "
           "started by run_all)",
           "at least as fast as the default order's route, never a wrong route",
           ("gpu/tune/tune_cuda.md", "gpu/tune/tune_cuda_ncmoe.md", "gpu/tune/tune_cuda_corrupt.md"),
           lambda t, f: v_tune(t)),
    Figure("Start-up: arcsplit --help, plan, the node agent's exec to ready (bench/startup.py)",
           "none slower than before the code's reshape", ("startup.md",), lambda t, f: v_startup(t)),
    Figure("Supervisor CPU while idle", "< 0.5 % of one core", ("idle_cpu.md",), lambda t, f: v_generic(t)),
    Figure("Dashboard frame time under a log flood", "frames under 50 ms at realistic log rates",
           ("dash_frame.md",), lambda t, f: v_generic(t)),
    Figure("Soak (long run, not started by run_all)", "no hang, no leak, nothing left behind", ("soak.md",),
           lambda t, f: v_generic(t)),
    Figure("A load-testing tool from PyPI (Locust) driving the split (not started by run_all)",
           "every request answered; its numbers beside bench/loadgen.py's", ("loadtool.md",),
           lambda t, f: v_loadtool(t)),
    Figure("GGUF header fuzzing (not started by run_all)", "no crash, no timeout", ("fuzz.md",),
           lambda t, f: v_fuzz(t)),
]


def run_scripts(full: bool, skip: set[str]) -> list[tuple[str, str, float, int | None]]:
    log = []
    for name, (quick, long) in SCRIPTS.items():
        script = BENCH / f"{name}.py"
        argv = [sys.executable, str(script), *(long if full else quick)]
        shown = " ".join(["python", f"bench/{name}.py", *(long if full else quick)])
        if name in skip or not script.exists():
            log.append((name, shown, 0.0, None))
            print(f"== {name}: {'skipped' if name in skip else 'not present'}", flush=True)
            continue
        print(f"== {shown}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        secs = time.perf_counter() - t0
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        print("\n".join(f"   {ln}" for ln in tail), flush=True)
        print(f"   exit {proc.returncode} in {secs:.0f} s", flush=True)
        log.append((name, shown, secs, proc.returncode))
    return log


def demote(text: str) -> str:
    """A results file's headings one level below its section's."""
    return "\n".join("###" + ln[1:] if ln.startswith("# ") else ("#" + ln if ln.startswith("##") else ln)
                     for ln in text.strip().splitlines())


def plot(out_dir: Path) -> tuple[Path | None, str]:
    """Throughput ratios per backend, mode and metric, with the hybrid targets (matplotlib, the bench extra)."""
    series = {b: throughput_ratios(t) for b in ("cpu", "cuda") if (t := read(f"throughput_{b}.md"))}
    series = {b: s for b, s in series.items() if s}
    if not series:
        return None, "no throughput results to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, 'matplotlib is not installed: `pip install -e ".[bench]"` draws the plot'
    bars = [(f"{b} {m}", k, v) for b, s in series.items() for m in ("hybrid", "rpc") if m in s
            for k, v in s[m].items()]
    groups = list(dict.fromkeys(g for g, _, _ in bars))
    metrics = list(HYBRID_TARGETS)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(metrics)
    for i, metric in enumerate(metrics):
        xs = [g + i * width for g in range(len(groups))]
        ys = [next((v for g2, k, v in bars if g2 == g and k == metric), 0) for g in groups]
        ax.bar(xs, ys, width, label=metric)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.01, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    for t in sorted(set(HYBRID_TARGETS.values())):
        ax.axhline(t, linestyle="--", linewidth=0.8, color="grey")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("ratio to native")
    ax.set_ylim(0, max([1.2] + [v for _, _, v in bars]) + 0.25)  # room for the legend above the bars
    ax.set_title("Throughput vs native (dashed: hybrid targets 0.75 / 0.90)")
    ax.legend(loc="upper center", ncol=len(metrics))
    path = out_dir / "throughput.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, "matplotlib"


def slug(title: str) -> str:
    """A figure's history file name: its number, else its words ("5d", "supervisor-cpu-while-idle")."""
    m = re.match(r"(\d+[a-z]?)\. ", title)
    words = re.sub(r"\(.*?\)", "", title.lower()).replace("./scripts/", "").split()[:5]
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", " ".join(words)).strip("-")


def history(title: str, target: str, rows: list[tuple[str, Verdict, str]]) -> str:
    """A figure's history file: every run's row, newest first as Figure.files lists them, then each file's text."""
    lines = [f"# History: {title}", "", f"Target: {target}.", "",
             "Every run behind this figure, the current one first; bench/RESULTS.md shows the first row.", "",
             "| status | result | source |", "|---|---|---|"]
    lines += [f"| **{v.status}** | {v.detail} | [bench/results/{f}](../{f}) |" for f, v, _ in rows]
    for f, v, text in rows:
        lines += ["", f"## bench/results/{f}", "", f"Status: **{v.status}** ({v.detail}).", "", demote(text)]
    return "\n".join(lines) + "\n"


def assemble(log: list[tuple[str, str, float, int | None]]) -> str:
    """RESULTS.md: one current row per figure, linking its history; writes the history files and the plot."""
    from arcsplit.llama.devices import cpu_model

    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = ["# arcsplit: measured figures", "",
             f"Assembled by `python bench/run_all.py` on {now} ({cpu_model()}, {os.cpu_count()} cores) from "
             "bench/results/*.md. One row per figure: its current result, from the first results file it lists "
             "(a run of the current code; a file spread over several runs gives min / median / max). Every "
             "earlier run is in the figure's history file, with the full text of each results file; each results "
             "file names its build, machine, model and command.", "",
             "| figure | target | status | current result | history |", "|---|---|---|---|---|"]
    out = RESULTS / "history"
    out.mkdir(exist_ok=True)
    figures = [(fig.title, fig.target, fig.files, fig.judge) for fig in FIGURES]
    others = sorted(p.name for p in RESULTS.glob("*.md") if p.name not in {f for fig in FIGURES for f in fig.files})
    figures += [(name.removesuffix(".md"), "(as stated in the file)", (name,), lambda t, f: v_generic(t))
                for name in others]
    for title, target, files, judge in figures:
        rows = [(f, judge(t, f), t) for f in files if (t := read(f)) is not None]
        if not rows:
            lines.append(f"| {title} | {target} | missing | no results file | - |")
            continue
        name = slug(title)
        (out / f"{name}.md").write_text(history(title, target, rows), encoding="utf-8")
        f, v, _ = rows[0]
        runs = f"{len(rows)} run{'s' if len(rows) > 1 else ''}"
        lines.append(f"| {title} | {target} | **{v.status}** | {v.detail} ([{f}](results/{f})) | "
                     f"[{runs}](results/history/{name}.md) |")
    path, how = plot(RESULTS)
    lines += [""]
    if path is not None:
        lines += [f"![throughput ratios](results/{path.name})", "",
                  f"Throughput ratios to native per backend and mode (bench/results/{path.name}, drawn with {how}).",
                  ""]
    else:
        lines += [f"No plot: {how}.", ""]
    if log:
        lines += ["## This run", "", "| script | command | seconds | exit |", "|---|---|---|---|"]
        for name, shown, secs, rc in log:
            lines.append(f"| {name} | `{shown}` | {secs:.0f} | {'skipped / not present' if rc is None else rc} |")
        lines += ["", "Long runs (bench/soak.py, bench/fuzz_gguf.py --cases 100000, bench/loadtool.py) are not started "
                  "here; their results files are included as they are. dash_frame's quick run only prints; its "
                  "results file is from a hand run.", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="each script's full settings instead of the quick ones")
    ap.add_argument("--assemble-only", action="store_true", help="only rebuild RESULTS.md from bench/results")
    ap.add_argument("--skip", default="", help="comma-separated script names not to run")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    log = [] if a.assemble_only else run_scripts(a.full, {s for s in a.skip.split(",") if s})
    text = assemble(log)
    (BENCH / "RESULTS.md").write_text(text, encoding="utf-8")
    print(f"wrote {BENCH / 'RESULTS.md'}")
    return 0 if all(rc in (0, None) for _, _, _, rc in log) else 1


if __name__ == "__main__":
    sys.exit(main())
