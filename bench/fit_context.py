"""The largest context arcsplit plans vs what llama.cpp's --fit chooses for the same cards and margin; then load it.

    python bench/fit_context.py [--out FILE]

Per model and per-card budget B (MiB) on two CPU cards:
- arcsplit: ``arcsplit.plan(model, [0, 1], backend="cpu", cpu_memory_mib=B, ctx=None)`` (mode rpc: RPC0, RPC1).
- llama.cpp: ``llama-fit-params --fit on`` over two real ggml-rpc-servers, with -c unset (so it may shrink the
  context), -fitc 256 (arcsplit's own context granularity, instead of fit's 4096 floor) and the same -np/-ub/-fa.
  An rpc-server on CPU reports the machine's RAM as its free memory, not a card budget, so each device's fit
  target margin is set to (free RAM it reports - B): fit then has exactly B MiB per device to fill, as arcsplit does.
  Its own choice is then checked with ``-fitp on`` (fit-params' per-device MiB for that -c/-ngl/-ts).
- ratio = arcsplit context / fit context (target >= 1.0).
- Proof that arcsplit's context loads: ``arcsplit.serve`` with that plan (same budget), one /completion request,
  and the buffers llama-server actually allocated per card (from its own log lines) against B.

Writes bench/results/fit_context.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit import synth  # noqa: E402
from arcsplit.llama.fitparams import RpcServers, fit_print  # noqa: E402
from arcsplit.llama.devices import cpu_model, parse_list_devices  # noqa: E402
from arcsplit.llama.locate import LlamaBinaries, find_llama, server_build_info  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

MiB = 1024 * 1024
UBATCH = 512
FIT_MIN_CTX = 256
COMMON = ["-np", "1", "-fa", "on", "-ub", str(UBATCH), "-b", "2048", "-ctk", "f16", "-ctv", "f16"]


@dataclass
class Case:
    label: str
    path: Path
    budget_mib: int


@dataclass
class Row:
    case: Case
    plan_ctx: int = 0
    plan_ts: str = ""
    plan_mib: str = ""
    plan_ms: float = 0.0
    free_mib: tuple[int, ...] = ()
    drift_mib: int = 0
    fit_cmd: str = ""
    fit_ctx: int | None = None
    fit_args: str = ""
    fit_mib: str = ""
    fit_over: bool = False
    fit_ms: float = 0.0
    load: str = ""
    load_ok: bool = False
    within: bool = False
    served_argv: str = ""


def cases(tmp: Path) -> list[Case]:
    """The demo Gemma (SWA, 262k vocab) and two synthetic models whose context is memory-bound at these budgets."""
    from arcsplit.demo import ensure_demo_model

    demo = ensure_demo_model()
    llama = synth.write_llama(tmp / "llama.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=2, n_ff=1408,
                              n_vocab=8000, ctx=262144)
    moe = synth.write_qwen3moe(tmp / "moe.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
                               n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=8000, ctx=262144)
    out = [Case("gemma3 270M Q4_K_M (demo; SWA, 262k vocab, train ctx 32k)", demo, b) for b in (200, 300)]
    out += [Case("llama 8L GQA F16 (synthetic, 59 MiB, train ctx 256k)", llama, b) for b in (512, 1024)]
    out += [Case("qwen3moe 8L 8 experts F16 (synthetic, 73 MiB, train ctx 256k)", moe, b) for b in (384, 768)]
    return out


def rpc_free(bins: LlamaBinaries, rpc: RpcServers) -> tuple[int, ...]:
    """Free MiB each rpc-server reports (llama-server --list-devices through them)."""
    out = subprocess.run([str(bins.server), "--rpc", ",".join(rpc.endpoints), "--list-devices"],
                         capture_output=True, text=True, timeout=60)
    devs = [d for d in parse_list_devices(out.stdout + "\n" + out.stderr) if d.name.startswith("RPC")]
    if len(devs) != len(rpc.endpoints):
        raise SystemExit(f"--list-devices over the rpc-servers showed {len(devs)} RPC devices: {out.stderr[-300:]}")
    return tuple(d.free_mib for d in devs)


def per_card(rows: dict[str, Any], budget: int) -> tuple[str, bool]:
    """'RPC0 w+c+k=total' per device from -fitp rows; and whether any exceeds the budget."""
    parts, over = [], False
    for dev in ("RPC0", "RPC1"):
        r = rows.get(dev)
        if r is None:
            parts.append(f"{dev} -")
            continue
        total = r.model_mib + r.context_mib + r.compute_mib
        over |= total > budget
        parts.append(f"{dev} {total}{' (over)' if total > budget else ''}")
    return ", ".join(parts), over


def run_fit(bins: LlamaBinaries, model: Path, rpc: RpcServers, margins: list[int]) -> tuple[list[str], str, float, int]:
    cmd = [str(bins.fit_params), "-m", str(model), "--rpc", ",".join(rpc.endpoints), "--device", "RPC0,RPC1",
           "--fit", "on", "-fitt", ",".join(map(str, margins)), "-fitc", str(FIT_MIN_CTX), *COMMON]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    dt = time.perf_counter() - t0
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("-c ")), "")
    return cmd, line, dt, out.returncode


def measure(bins: LlamaBinaries, case: Case) -> Row:
    row = Row(case)
    t0 = time.perf_counter()
    plan = arcsplit.plan(case.path, [0, 1], backend="cpu", cpu_memory_mib=case.budget_mib, ctx=None, parallel=1,
                         ubatch=UBATCH, mode="rpc")
    row.plan_ms = (time.perf_counter() - t0) * 1e3
    row.plan_ctx = plan.n_ctx
    row.plan_ts = ",".join(map(str, plan.tensor_split))
    row.plan_mib = ", ".join(f"{c.device} {c.total / MiB:.0f}" for c in plan.cards)

    with RpcServers(bins, 2) as rpc:
        free = rpc_free(bins, rpc)
        margins = [f - case.budget_mib for f in free]
        cmd, line, dt, rc = run_fit(bins, case.path, rpc, margins)
        after = rpc_free(bins, rpc)
        row.free_mib, row.fit_ms = free, dt * 1e3
        row.drift_mib = max(abs(a - b) for a, b in zip(free, after))
        row.fit_cmd = shlex.join(cmd)
        m = re.match(r"-c (\d+) -ngl (\d+)(?: -ts ([\d,]+))?", line)
        if rc != 0 or not m:
            row.fit_args = f"failed (exit {rc})"
        else:
            row.fit_ctx, row.fit_args = int(m.group(1)), line.strip()
            args = ["-c", m.group(1), "-ngl", m.group(2), "--device", "RPC0,RPC1", *COMMON]
            if m.group(3):
                args += ["-ts", m.group(3)]
            rows, _ = fit_print(bins, case.path, rpc, args)
            row.fit_mib, row.fit_over = per_card(rows, case.budget_mib)

    with arcsplit.serve(case.path, gpus=[0, 1], backend="cpu", mode="rpc", ctx=plan.n_ctx, parallel=1,
                        ubatch=UBATCH, cpu_memory_mib=case.budget_mib, threads=1, port=free_port(),
                        bus=False) as server:
        same = server.plan.n_ctx == plan.n_ctx and server.plan.tensor_split == plan.tensor_split
        r = httpx.post(f"{server.url}/completion", json={"prompt": "Hello, my name is", "n_predict": 8,
                                                          "temperature": 0}, timeout=300)
        ok = r.status_code == 200 and r.json().get("tokens_predicted", 0) > 0
        status = server.status()
        actual = []
        row.within = True
        for c in status["buffers"]["cards"]:
            total = sum(c["actual"].values()) / MiB
            over = total - case.budget_mib
            row.within &= over <= 0
            actual.append(f"{c['device']} {total:.1f}" + (f" (**{over:+.1f} over**)" if over > 0 else ""))
        row.served_argv = shlex.join(status["processes"]["server"]["argv"])
    row.load_ok = same and ok
    row.load = (f"{'yes' if row.load_ok else 'NO'} (HTTP {r.status_code}); allocated {', '.join(actual)}"
                + ("" if same else " (served plan differs!)"))
    return row


def report(rows: list[Row], bins: LlamaBinaries, seconds: float) -> str:
    info = server_build_info(bins)
    ratios = [r.plan_ctx / r.fit_ctx for r in rows if r.fit_ctx]
    lines = ["# Largest context: arcsplit plan vs llama.cpp --fit, same cards and margin", "",
             f"- Build: llama.cpp {info.version}, {info.compiler} for {info.target}, in {bins.bin_dir}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores), two CPU cards (one ggml-rpc-server each, 127.0.0.1)",
             "- Command: `python bench/fit_context.py`" f" ({seconds:.0f} s)",
             f"- Settings for both: 2 devices RPC0,RPC1, -np 1, -fa on, -ub {UBATCH}, -b 2048, f16 KV; arcsplit "
             f"`arcsplit.plan(model, [0, 1], backend=\"cpu\", cpu_memory_mib=B, ctx=None, ubatch={UBATCH})`; fit "
             f"`llama-fit-params --fit on -fitt <free-B per device> -fitc {FIT_MIN_CTX}` with -c/-ngl/-ts unset.",
             "- Same margin: an rpc-server on CPU reports the machine's RAM as free memory (column free), not the CPU "
             "card's budget B, so fit's per-device target margin is free - B: fit may fill B MiB per device, as "
             "arcsplit does. Free RAM can move between the reading and fit's own (column drift: the largest change "
             "seen across the fit run).",
             "- fit MiB per card: `llama-fit-params -fitp on` at fit's own -c/-ngl/-ts (fit-params sizes the output "
             "card's compute for 2048 logits rows where llama-server reserves 1, so on the output card it reads "
             "high by about 512 x n_vocab x 4 B; docs/llama-cpp-notes.md). (over) = above B.",
             "- loads: `arcsplit.serve` with the same budget and context, one /completion request (8 tokens), and "
             "the buffers llama-server itself logged per card (model + KV + compute, MiB) against B.", "",
             "| model | B MiB/card | arcsplit ctx | arcsplit -ts | plan MiB/card | fit chose | fit MiB/card "
             "(-fitp) | ratio | arcsplit's context loads |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"**{r.plan_ctx / r.fit_ctx:.3f}**" if r.fit_ctx else "fit failed"
        fit = f"`{r.fit_args}`" + (" (no layer on the cards)" if re.search(r"-ngl 0\b", r.fit_args) else "")
        lines.append(f"| {r.case.label} | {r.case.budget_mib} | {r.plan_ctx} | {r.plan_ts} | {r.plan_mib} | "
                     f"{fit} | {r.fit_mib or '-'} | {ratio} | {r.load} |")
    lines += ["", "| model | free MiB seen (RPC0, RPC1) | drift MiB | plan ms | fit ms |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case.label} | {', '.join(map(str, r.free_mib))} | {r.drift_mib} | {r.plan_ms:.1f} | "
                     f"{r.fit_ms:.0f} |")
    if ratios:
        lines += ["", f"Ratio arcsplit / fit: min {min(ratios):.3f}, max {max(ratios):.3f} (target >= 1.0: "
                  f"{'meets' if min(ratios) >= 1.0 else 'misses'}); arcsplit's context loads and answers in "
                  f"{sum(r.load_ok for r in rows)}/{len(rows)}; its allocation stays within the budget on every card "
                  f"in {sum(r.within for r in rows)}/{len(rows)}. fit's own choice stays within the budget (by its own "
                  f"-fitp numbers) in {sum(bool(r.fit_mib) and not r.fit_over for r in rows)}/{len(rows)}."]
    over = [r for r in rows if r.fit_over]
    if over:
        lines += ["", "Where fit's choice is marked (over), llama.cpp's own accounting of its own choice exceeds the "
                  "budget it was given: fit shrinks the context by a linear estimate across all devices, then "
                  "places whole layers, and does not re-check the margin per device after placement."]
    lines += ["", "Commands:", ""]
    for r in rows:
        lines.append(f"- {r.case.label}, fit: `{r.fit_cmd}`")
        lines.append(f"- {r.case.label}, arcsplit served: `{r.served_argv}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fit_context.md"))
    ap.add_argument("--llama-dir", default=None)
    a = ap.parse_args()
    bins = find_llama(a.llama_dir, backend="cpu")
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(Path(tmp)):
            print(f"{case.label}, {case.budget_mib} MiB per card ...", flush=True)
            row = measure(bins, case)
            print(f"  arcsplit ctx {row.plan_ctx} (-ts {row.plan_ts}); fit {row.fit_args}; loads: {row.load}",
                  flush=True)
            rows.append(row)
    text = report(rows, bins, time.perf_counter() - t0)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(text)
    return 0 if all(r.load_ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
