"""arcsplit tune's pick against the fixed default order, on the rigs this machine has (CPU cards).

    python bench/tune.py [--runs N] [--rigs demo,llama,moe] [--budget S] [--per-candidate S] [--remeasure S]
                         [--objective decode] [--out FILE]

Per rig and run: a fresh tune (its own results directory, so nothing is reused), then the pick and the default
order's route (what serve runs untuned: mode auto, default settings) are each served again and measured for
--remeasure seconds, independently of tune's own figures (tune's best-of-several is biased upward); the ratio is
pick / default for the objective (1.0 without measuring when they are the same candidate). Then tune runs again
on the same directory: how many results it reuses and how long that takes. Rigs: demo = the demo model
(gemma-3 270M Q4_K_M) on 2 CPU cards; llama = a synthetic llama (arcsplit/synth.py, untied output, f16) on 2 CPU
cards; moe = a synthetic qwen3moe on 2 CPU cards. Writes bench/results/tune.md with min/median/max over runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arcsplit.decide.prepare import ServeRequest, preview  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.tune.candidates import Candidate  # noqa: E402
from arcsplit.tune.runner import TuneRequest, run_candidate, tune  # noqa: E402


def rig_model(name: str, work: Path) -> Path:
    if name == "demo":
        from arcsplit.demo import ensure_demo_model

        return ensure_demo_model()
    from arcsplit import synth

    if name == "llama":
        return synth.write_llama(work / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_head_kv=4, n_ff=768,
                                 n_vocab=4096)
    if name == "moe":
        return synth.write_qwen3moe(work / "moe.gguf", n_layer=6, n_embd=256, n_head=8, n_head_kv=4, head_dim=32,
                                    n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=4096)
    raise SystemExit(f"unknown rig {name!r}: use demo, llama or moe")


def remeasure(req: ServeRequest, key: str, results: dict[str, Any], seconds: float, objective: str) -> float | None:
    c = Candidate.from_dict(results[key]["candidate"])
    res = run_candidate(preview(req), c, seconds, None)
    return res.get(objective)


def one_run(req: ServeRequest, a: argparse.Namespace, k: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        os.environ["ARCSPLIT_TUNE_DIR"] = d
        treq = TuneRequest(req, a.objective, a.budget, a.per_candidate)
        first = tune(treq, say=lambda line: print(f"    {line}", flush=True))
        again = tune(treq)
    out: dict[str, Any] = {"pick": first.pick, "default": first.default, "wall": first.wall_s,
                           "again_wall": again.wall_s, "reused": again.reused, "tried": len(again.order),
                           "wrong": sum(1 for r in first.results.values() if r.get("status") == "wrong"),
                           "measured": sum(1 for r in first.results.values() if "decode" in r)}
    if first.pick is None or first.default is None:
        out["ratio"] = None
        return out
    if first.pick == first.default:
        out["ratio"] = 1.0
        return out
    # alternate the order per run so neither side always goes first
    keys = [first.pick, first.default] if k % 2 else [first.default, first.pick]
    got = {key: remeasure(req, key, first.results, a.remeasure, a.objective) for key in keys}
    p, dflt = got[first.pick], got[first.default]
    out["ratio"] = p / dflt if p and dflt else None
    out["pick_fig"], out["default_fig"] = p, dflt
    return out


def spread(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    return f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}"


def report(a: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], cmd: str, started: str) -> str:
    lines = ["# arcsplit tune: its pick against the fixed default order", "",
             f"- Command: `{cmd}`", f"- Run at {started} UTC on {platform.node()} ({cpu_model()}, "
             f"{os.cpu_count()} cores). The machine was shared with other work while this ran: absolute figures "
             "are low and noisy; the ratios compare two routes measured back to back.",
             f"- Objective {a.objective}; tune budget {a.budget:.0f} s, {a.per_candidate:.0f} s measuring per "
             f"candidate; pick and default re-measured independently for {a.remeasure:.0f} s each.", "",
             "| rig | runs | picks | pick / default (min / median / max) | tune wall s (min / median / max) | "
             "rerun on kept results: wall s, reused | wrong routes |",
             "|---|---|---|---|---|---|---|"]
    for rig, runs in rows.items():
        ratios = [r["ratio"] for r in runs if r.get("ratio")]
        picks = ", ".join(sorted({str(r["pick"]) for r in runs}))
        reuse = f"{spread([r['again_wall'] for r in runs], 1)}; {sum(r['reused'] for r in runs)}/" \
                f"{sum(r['tried'] for r in runs)}"
        lines.append(f"| {rig} | {len(runs)} | {picks} | {spread(ratios)} | {spread([r['wall'] for r in runs], 0)} "
                     f"| {reuse} | {sum(r['wrong'] for r in runs)} |")
    lines += ["", "Per run:", ""]
    for rig, runs in rows.items():
        for i, r in enumerate(runs, 1):
            figs = (f"pick {r['pick_fig']:.1f} t/s vs default {r['default_fig']:.1f} t/s"
                    if r.get("pick_fig") and r.get("default_fig") else "same candidate: ratio 1.0, not re-measured"
                    if r.get("ratio") == 1.0 else "not measured")
            lines.append(f"- {rig} run {i}: pick `{r['pick']}`, default `{r['default']}`; {figs}; "
                         f"{r['measured']} candidates measured in {r['wall']:.0f} s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rigs", default="demo,llama,moe")
    p.add_argument("--budget", type=float, default=240.0)
    p.add_argument("--per-candidate", type=float, default=3.0)
    p.add_argument("--remeasure", type=float, default=6.0)
    p.add_argument("--objective", default="decode", choices=("decode", "prefill", "streams"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tune.md"))
    a = p.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rows: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as work:
        for rig in a.rigs.split(","):
            model = rig_model(rig, Path(work))
            req = ServeRequest(model=str(model), gpus=[0, 1], backend="cpu", ctx=2048, parallel=2)
            for k in range(1, a.runs + 1):
                print(f"{rig} run {k}/{a.runs}", flush=True)
                rows.setdefault(rig, []).append(one_run(replace(req), a, k))
                print(f"  {rows[rig][-1]}", flush=True)
    text = report(a, rows, "python bench/tune.py " + " ".join(argv if argv is not None else sys.argv[1:]), started)
    Path(a.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
