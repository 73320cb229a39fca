"""arcsplit tune's pick against the fixed default order, on the rigs this machine has (CPU cards, or one GPU).

    python bench/tune.py [--runs N] [--rigs demo,llama,moe] [--budget S] [--per-candidate S] [--remeasure S]
                         [--objective decode|prefill|streams|ttft] [--out FILE]
    python bench/tune.py --backend cuda --same-card [--card-mib N] --rigs gpu-llama,gpu-moe   # one GPU
    python bench/tune.py --backend vulkan --lavapipes --rigs tiny    # two Vulkan devices on Mesa's CPU driver

Per rig and run: a fresh tune (its own results directory, so nothing is reused), then the pick and the default
order's route (what serve runs untuned: mode auto, default settings) are each served again and measured for
--remeasure seconds, independently of tune's own figures (tune's best-of-several is biased upward); the ratio is
pick / default for the objective (default / pick for ttft, a time: above 1 is the pick's gain either way; 1.0
without measuring when they are the same candidate). Then tune runs again
on the same directory: how many results it reuses and how long that takes. Rigs: demo = the demo model
(gemma-3 270M Q4_K_M) on 2 CPU cards; llama = a synthetic llama (arcsplit/synth.py, untied output, f16) on 2 CPU
cards; moe = a synthetic qwen3moe on 2 CPU cards (BENCH_WORK=DIR keeps the models there). Writes bench/results/tune.md with min/median/max over runs.

--same-card (a GPU --backend, one GPU): the rig is that GPU named twice (bench/throughput.py's same_card_rig), so
every route tune knows runs there: the whole model on the card (native), hybrid and all-RPC with llama-server and
the rpc-servers sharing it. A one-context route over the same card twice is not a route any user has, so those
candidates are left out, and the default order's route is the whole model on the one card (what ``serve --gpus 0``
runs). --card-mib plans each card as that size: a MoE that does not fit, so the planner keeps experts in host RAM
(--n-cpu-moe) and tune varies that count. Rigs gpu-llama (a 1.3B f16 synthetic llama) and gpu-moe (a 3.8 GiB f16
synthetic qwen3moe, 16 layers of 32 experts) are sized for a GPU.

--lavapipes (--backend vulkan): Mesa's CPU Vulkan driver (lavapipe, mesa-vulkan-drivers) as two Vulkan devices,
its manifest listed twice (as tests/test_vulkan.py does), with the managed Vulkan build (scripts/test-vulkan):
one context with -sm layer and -sm tensor, hybrid and all-RPC all run for real. Rig tiny (a 4-layer llama of
n_embd 128) keeps lavapipe's per-process pipeline compiles short. Lavapipe's speed says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from arcsplit import durations  # noqa: E402
from arcsplit.objectives import LOWER_IS_BETTER, OBJECTIVES, gain, unit  # noqa: E402
from arcsplit.decide.prepare import ServeRequest, preview  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.tuning.candidates import Candidate  # noqa: E402
from arcsplit.tuning.runner import TuneRequest, run_candidate, tune  # noqa: E402


def rig_model(name: str, work: Path) -> Path:
    if name == "demo":
        from arcsplit.demo import ensure_demo_model

        return ensure_demo_model()
    from arcsplit import synth

    if (work / f"{name}.gguf").exists():  # BENCH_WORK kept it from an earlier invocation (or linked it there)
        return work / f"{name}.gguf"
    if name == "llama":
        return synth.write_llama(work / "llama.gguf", n_layer=8, n_embd=256, n_head=8, n_head_kv=4, n_ff=768,
                                 n_vocab=4096)
    if name == "tiny":
        return synth.write_llama(work / "tiny.gguf", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=384,
                                 n_vocab=2048)
    if name == "gpu-llama":
        return synth.write_llama(work / "gpu-llama.gguf", n_layer=16, n_embd=2048, n_head=16, n_head_kv=8,
                                 n_ff=5632, n_vocab=32000, ctx=8192, reuse_random=True)
    if name == "gpu-moe":
        return synth.write_qwen3moe(work / "gpu-moe.gguf", n_layer=16, n_embd=2048, n_head=32, n_head_kv=4,
                                    head_dim=128, n_expert=32, n_expert_used=4, n_ff_exp=512, n_vocab=32000, ctx=8192)
    if name == "moe":
        return synth.write_qwen3moe(work / "moe.gguf", n_layer=6, n_embd=256, n_head=8, n_head_kv=4, head_dim=32,
                                    n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=4096)
    raise SystemExit(f"unknown rig {name!r}: use demo, llama, moe, tiny, gpu-llama or gpu-moe")


def corrupting_build(work: Path, backend: str) -> Path:
    """--corrupt-rpc: a llama.cpp dir whose llama-server is the build's and whose ggml-rpc-server is the real one
    behind the bit-flipping forwarder (as tests/test_tune_real.py plants it); weights cross the socket (no shared
    memory, no seeding from the GGUF), where the forwarder flips them."""
    from arcsplit.llama.locate import find_llama

    bins = find_llama(None, backend=backend)
    d = work / f"corrupt-{backend}"
    d.mkdir(exist_ok=True)
    if not (d / "llama-server").exists():
        (d / "llama-server").symlink_to(bins.server)
    rpc = d / "ggml-rpc-server"
    rpc.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / '_corrupt_rpc.py'} {bins.rpc_server} \"$@\"\n")
    rpc.chmod(0o755)
    os.environ["ARCSPLIT_RPC_SHM"] = "0"
    return d


@contextlib.contextmanager
def two_lavapipes() -> Iterator[None]:
    """--lavapipes: VK_ICD_FILENAMES names lavapipe's manifest twice (two copies), so the loader shows two devices."""
    manifest = next(iter(sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json"))), None)
    if manifest is None:
        raise SystemExit("no lavapipe manifest in /usr/share/vulkan/icd.d: apt-get install mesa-vulkan-drivers")
    old = {k: os.environ.get(k) for k in ("VK_ICD_FILENAMES", "XDG_RUNTIME_DIR")}
    with tempfile.TemporaryDirectory() as tmp:
        icds = [Path(tmp) / "lvp_a.json", Path(tmp) / "lvp_b.json"]
        for icd in icds:
            icd.write_bytes(manifest.read_bytes())
        os.environ["VK_ICD_FILENAMES"] = ":".join(map(str, icds))
        os.environ.setdefault("XDG_RUNTIME_DIR", tmp)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextlib.contextmanager
def one_gpu(card_mib: int | None) -> Iterator[None]:
    """--same-card: the GPU as two twin cards, one-context routes left out, the whole model on the card as the
    default order's route (see the module docstring)."""
    from throughput import same_card_rig

    from arcsplit.modes import Mode
    from arcsplit.tuning import runner

    real_routes, real_default, real_request = runner.routes, runner.default_key, runner.request_for

    def routes(*args: Any, **kw: Any) -> list[Candidate]:
        return [c for c in real_routes(*args, **kw) if c.one_card or c.mode not in (Mode.MULTI, Mode.MULTI_WORKAROUND)]

    def default_key(p: Any, cands: list[Candidate]) -> str | None:
        return next((c.key for c in cands if c.one_card), None) or real_default(p, cands)

    def request_for(*args: Any, **kw: Any) -> Any:  # the twins go back as 0,1: same_card_rig's request
        r = real_request(*args, **kw)
        n = len(list(r.gpus or ()))
        return replace(r, gpus=list(range(n))) if n > 1 else r

    runner.routes, runner.default_key, runner.request_for = routes, default_key, request_for  # type: ignore[assignment]
    try:
        with same_card_rig(0, 2, card_mib):
            yield
    finally:
        runner.routes, runner.default_key, runner.request_for = real_routes, real_default, real_request  # type: ignore[assignment]


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
                           "pick_ok": first.pick is not None and first.results[first.pick].get("status") == "ok",
                           "measured": sum(1 for r in first.results.values() if "decode" in r),
                           "candidates": [{k: first.results[key].get(k) for k in
                                           ("label", "status", "prefill", "decode", "streams", "ttft", "reason")}
                                          for key in first.order if key in first.results]}
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
    out["ratio"] = gain(a.objective, p, dflt) if p and dflt else None
    out["pick_fig"], out["default_fig"] = p, dflt
    return out


def spread(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    return f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}"


def report(a: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], cmd: str, started: str) -> str:
    lines = ["# arcsplit tune: its pick against the fixed default order", "",
             f"- Command: `{cmd}`", f"- Run at {started} UTC on {platform.node()} ({cpu_model()}, "
             f"{os.cpu_count()} cores)" + (", two Vulkan devices on Mesa's CPU driver (lavapipe)" if a.lavapipes else
                                           f", on {a.card_name}: one GPU named twice, so llama-server and the "
                                           "rpc-servers share it" if a.same_card else
                                           ". The machine was shared with other work while this ran: absolute "
                                           "figures are low and noisy") +
             "; the ratios compare two routes measured back to back.",
             f"- Objective {a.objective}; tune budget {a.budget:.0f} s, {a.per_candidate:.0f} s measuring per "
             f"candidate; pick and default re-measured independently for {a.remeasure:.0f} s each.", "",
             f"| rig | runs | picks | {'default / pick' if a.objective in LOWER_IS_BETTER else 'pick / default'} "
             "(min / median / max) | tune wall s (min / median / max) | "
             "rerun on kept results: wall s, reused | wrong routes rejected | picks correct |",
             "|---|---|---|---|---|---|---|---|"]
    for rig, runs in rows.items():
        ratios = [r["ratio"] for r in runs if r.get("ratio")]
        picks = ", ".join(sorted({str(r["pick"]) for r in runs}))
        reuse = f"{spread([r['again_wall'] for r in runs], 1)}; {sum(r['reused'] for r in runs)}/" \
                f"{sum(r['tried'] for r in runs)}"
        lines.append(f"| {rig} | {len(runs)} | {picks} | {spread(ratios)} | {spread([r['wall'] for r in runs], 0)} "
                     f"| {reuse} | {sum(r['wrong'] for r in runs)} | {sum(1 for r in runs if r.get('pick_ok'))}/{len(runs)} |")
    lines += ["", "Per run:", ""]
    for rig, runs in rows.items():
        for i, r in enumerate(runs, 1):
            u = unit(a.objective)
            figs = (f"pick {r['pick_fig']:.1f} {u} vs default {r['default_fig']:.1f} {u}"
                    if r.get("pick_fig") and r.get("default_fig") else "same candidate: ratio 1.0, not re-measured"
                    if r.get("ratio") == 1.0 else "not measured")
            lines.append(f"- {rig} run {i}: pick `{r['pick']}`, default `{r['default']}`; {figs}; "
                         f"{r['measured']} candidates measured in {r['wall']:.0f} s")
    lines += ["", "Every candidate of each rig's first run (t/s, time to first token in ms; tune's own short "
                  "measurements):", ""]
    for rig, runs in rows.items():
        lines += [f"**{rig}**", "", "| candidate | status | prefill | decode | streams | ttft ms | why |",
                  "|---|---|---|---|---|---|---|"]
        for c in runs[0].get("candidates", []):
            cells = [f"{c[k]:.1f}" if isinstance(c.get(k), (int, float)) else "-"
                     for k in ("prefill", "decode", "streams", "ttft")]
            why = "" if c.get("status") == "ok" else str(c.get("reason") or "")[:120].replace("|", "/")
            lines.append(f"| {c.get('label')} | {c.get('status')} | {' | '.join(cells)} | {why} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rigs", default="demo,llama,moe")
    p.add_argument("--budget", type=durations.argtype("--budget"), default=240.0, help=durations.HELP)
    p.add_argument("--per-candidate", type=durations.argtype("--per-candidate"), default=3.0, help=durations.HELP)
    p.add_argument("--remeasure", type=durations.argtype("--remeasure"), default=6.0, help=durations.HELP)
    p.add_argument("--objective", default="decode", choices=OBJECTIVES)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tune.md"))
    p.add_argument("--backend", default="cpu")
    p.add_argument("--same-card", action="store_true", help="one GPU named twice (see the docstring)")
    p.add_argument("--card-mib", type=int, default=None, help="with --same-card: plan each card as this size")
    p.add_argument("--lavapipes", action="store_true", help="--backend vulkan on two lavapipe devices (docstring)")
    p.add_argument("--corrupt-rpc", action="store_true",
                   help="every rpc-server behind tests/_corrupt_rpc.py's bit-flipping forwarder: tune must reject "
                        "each route that uses one (the 'wrong routes' column)")
    p.add_argument("--ctx", type=int, default=2048)
    a = p.parse_args(argv)
    if a.same_card and a.backend == "cpu":
        p.error("--same-card shares one GPU: give a GPU --backend")
    if a.lavapipes and a.backend != "vulkan":
        p.error("--lavapipes are Vulkan devices: give --backend vulkan")
    if a.card_mib and not a.same_card:
        p.error("--card-mib goes with --same-card")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rows: dict[str, list[dict[str, Any]]] = {}
    a.card_name = ""
    if a.same_card:
        from arcsplit.llama.devices import discover_rig
        from arcsplit.llama.locate import find_llama

        a.card_name = discover_rig(a.backend, [0], find_llama(None, backend=a.backend)).cards[0].name + (f" (planned as {a.card_mib} MiB cards)"
                                                                     if a.card_mib else "")
    rig_ctx = one_gpu(a.card_mib) if a.same_card else two_lavapipes() if a.lavapipes else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, rig_ctx:
        work = Path(os.environ.get("BENCH_WORK") or tmp)  # BENCH_WORK: the rigs' models are kept there
        work.mkdir(parents=True, exist_ok=True)
        for rig in a.rigs.split(","):
            model = rig_model(rig, work)
            req = ServeRequest(model=str(model), gpus=[0, 1], backend=a.backend, ctx=a.ctx, parallel=2)
            if a.corrupt_rpc:
                req = replace(req, llama_dir=str(corrupting_build(work, a.backend)), rpc_seed=False)
            for k in range(1, a.runs + 1):
                print(f"{rig} run {k}/{a.runs}", flush=True)
                rows.setdefault(rig, []).append(one_run(replace(req), a, k))
                print(f"  {rows[rig][-1]}", flush=True)
    shown = shlex.join(["python", "bench/tune.py", *(argv if argv is not None else sys.argv[1:])])
    text = report(a, rows, shown, started)
    Path(a.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
