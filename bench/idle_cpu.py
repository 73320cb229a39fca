"""Supervisor CPU while the group idles (target: under 0.5 % of one core).

    python bench/idle_cpu.py [--seconds 30] [--model PATH] [--gpus 0,1] [--mode rpc]

Starts the group in this process, waits until ready, then reads this process's own cpu_times (children
excluded) over the window. Writes bench/results/idle_cpu.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from _group import group, prepared  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--mode", default="rpc")
    a = ap.parse_args()
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    p = prepared(a.model, backend="cpu", gpus=a.gpus, mode=a.mode, ctx=1024, threads=1, port=free_port())
    me = psutil.Process()

    async def run() -> tuple[float, float, int]:
        async with group(p) as inst:
            sup = inst.supervisor
            await anyio.sleep(1.0)  # let start-up work settle
            c0, t0 = me.cpu_times(), time.perf_counter()
            await anyio.sleep(a.seconds)
            c1, t1 = me.cpu_times(), time.perf_counter()
            assert sup.status()["state"] == "ready"
            n_children = len(me.children(recursive=True))
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        return cpu, t1 - t0, n_children

    cpu, wall, n = anyio.run(run)
    pct = 100 * cpu / wall
    verdict = "meets" if pct < 0.5 else "misses"
    text = f"""# Supervisor CPU while idle

Group: backend cpu, --gpus {a.gpus}, mode {a.mode}, {n} child processes, demo model; window {wall:.1f} s after ready.
Supervisor process (children excluded): {cpu * 1000:.1f} ms CPU = **{pct:.3f} % of one core** ({verdict} the 0.5 % target).
Python {sys.version.split()[0]}, {os.cpu_count()} cores; psutil cpu_times resolution is 10 ms.
"""
    out = ROOT / "bench" / "results" / "idle_cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
