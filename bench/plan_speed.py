"""Plan time vs llama-fit-params time, per architecture.

arcsplit: read the GGUF header + solve for the largest context (a fresh process-free call, median of 5).
measured: the same with each card's compute buffer from llama.cpp's own dry run, cached before (plan --measure):
profile cache hit + compute cache file read + solve (min/median/max of 20).
llama.cpp: llama-fit-params finding a placement for 2 RPC devices (its full fit), and one -fitp dry run.
Target: plan time at most 1/20 of llama-fit-params' (issue 16: the cached case too).

Run: ARCSPLIT_LLAMA_DIR=/path/to/bin python bench/plan_speed.py   (writes bench/results/plan_speed.md)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arcsplit.llama.fitparams import RpcServers, fit_print  # noqa: E402
from arcsplit.llama import compute_cache  # noqa: E402
from arcsplit.llama.fitparams import measure_compute  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.model import load_profile  # noqa: E402
from arcsplit.planner import PlanOptions, make_plan  # noqa: E402
from arcsplit.rig import Card  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import models  # noqa: E402

MiB = 1024 * 1024


def time_plan(path: Path, cards: list[Card], cache: bool) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        make_plan(load_profile(path, cache=cache), cards, PlanOptions(n_ctx=None), devices=["RPC0", "RPC1"])
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def time_measured(bins, path: Path, cards: list[Card]) -> tuple[list[float], int]:
    """Measure the plan's split once (llama-fit-params), then time planning from the cache: (seconds, dry runs)."""
    opts = PlanOptions(n_ctx=None)
    key = compute_cache.cache_key(load_profile(path), "cpu", "rpc", ["RPC0", "RPC1"], opts)
    runs = 0
    for _ in range(3):  # as plan --measure: until every card of the plan is measured
        measured, _ = compute_cache.load(key)
        plan = make_plan(load_profile(path), cards, opts, devices=["RPC0", "RPC1"], measured=measured)
        if all(c.compute_source.startswith("measured") for c in plan.cards if c.compute):
            break
        compute_cache.store(key, "cpu", measure_compute(bins, plan))
        runs += 1
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        measured, _ = compute_cache.load(key)
        plan = make_plan(load_profile(path), cards, opts, devices=["RPC0", "RPC1"], measured=measured)
        times.append(time.perf_counter() - t0)
    assert measured is not None and all(c.compute_source.startswith("measured") for c in plan.cards if c.compute)
    return times, runs


def main(out_path: Path) -> None:
    bins = find_llama()
    lines = ["# Plan speed: arcsplit plan vs llama-fit-params", "",
             "arcsplit = load_profile + make_plan(largest context), median of 5, in-process; cold = header read "
             "every time, warm = profile cache hit. fit = llama-fit-params choosing -c/-ngl/-ts for 2 RPC devices. "
             "fitp = one `-fitp on` dry run for a fixed split. measured = warm profile + every card's compute read "
             "from the compute cache that `plan --measure` filled (min/median/max of 20; the dry runs it took "
             "first in brackets). Ratios use the faster llama.cpp column (fitp or fit) over the median.",
             "",
             "| model | file | arcsplit cold ms | warm ms | fit ms | fitp ms | ratio cold | ratio warm | "
             "measured ms min/med/max | ratio measured |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp, RpcServers(bins, 2) as rpc:
        os.environ["ARCSPLIT_CACHE_DIR"] = str(Path(tmp) / "cache")  # a fresh compute cache, filled below
        for label, path in models(Path(tmp)):
            prof = load_profile(path)
            cards = [Card("cpu", i, "rpc", 65536 * MiB, 65536 * MiB, 0) for i in range(2)]
            t_cold = time_plan(path, cards, cache=False)
            t_warm = time_plan(path, cards, cache=True)
            cmd = [str(bins.fit_params), "-m", str(path), "--rpc", ",".join(rpc.endpoints), "--device", "RPC0,RPC1",
                   "-fitc", "256"]
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            t_fit = time.perf_counter() - t0
            ts = [(prof.n_layer + 1) // 2, prof.n_layer + 1 - (prof.n_layer + 1) // 2]
            _, t_fitp = fit_print(bins, path, rpc, ["-c", "4096", "-ngl", str(sum(ts)), "-ts", ",".join(map(str, ts)),
                                                    "--device", "RPC0,RPC1"])
            size = sum(Path(s).stat().st_size for s in prof.shards)
            best = min(t_fit, t_fitp)
            t_meas, runs = time_measured(bins, path, cards)
            med = statistics.median(t_meas)
            lines.append(f"| {label} | {size / 2**30:.2f} GiB | {t_cold * 1e3:.1f} | {t_warm * 1e3:.1f} | "
                         f"{t_fit * 1e3:.0f} | {t_fitp * 1e3:.0f} | {best / t_cold:.0f}x | {best / t_warm:.0f}x | "
                         f"{min(t_meas) * 1e3:.1f}/{med * 1e3:.1f}/{max(t_meas) * 1e3:.1f} ({runs}) | "
                         f"{best / med:.0f}x |")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results" / "plan_speed.md")
