"""Supervisor CPU while the group idles (target: under 0.5 % of one core).

    python bench/idle_cpu.py [--seconds 30] [--model PATH] [--gpus 0,1] [--mode rpc] [--canary-every 600]

Starts the group in this process, waits until ready and until the output canary's first check (run/canary.py) is
done, then reads this process's own cpu_times (children excluded) over the window. The first check's own cost in
this process is measured too (its client side: the streamed answers and the queue polls); spread over the
interval it is the canary's share of an idle supervisor. Writes bench/results/idle_cpu.md.
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
    ap.add_argument("--canary-every", type=float, default=600.0, help="the canary's interval, s (0: off)")
    a = ap.parse_args()
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    p = prepared(a.model, backend="cpu", gpus=a.gpus, mode=a.mode, ctx=1024, threads=1, port=free_port(),
                 canary=a.canary_every > 0, canary_every=a.canary_every or 600.0)
    me = psutil.Process()

    async def run() -> tuple[float, float, int, float, float, float]:
        async with group(p) as inst:
            sup = inst.supervisor
            c, g, w = me.cpu_times(), _group_cpu(me), time.perf_counter()
            while inst.canary is not None and not inst.canary.counts:  # its first check, right after ready
                await anyio.sleep(0.05)
            check_cpu = (me.cpu_times().user - c.user) + (me.cpu_times().system - c.system)
            check_wall, check_group = time.perf_counter() - w, _group_cpu(me) - g
            await anyio.sleep(1.0)  # let start-up work settle
            c0, t0 = me.cpu_times(), time.perf_counter()
            await anyio.sleep(a.seconds)
            c1, t1 = me.cpu_times(), time.perf_counter()
            assert sup.status()["state"] == "ready"
            n_children = len(me.children(recursive=True))
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        return cpu, t1 - t0, n_children, check_cpu, check_wall, check_group

    cpu, wall, n, check_cpu, check_wall, check_group = anyio.run(run)
    pct = 100 * cpu / wall
    verdict = "meets" if pct < 0.5 else "misses"
    canary = (f"Output canary every {a.canary_every:g} s: its first check took {check_wall:.2f} s and "
              f"{check_cpu * 1000:.0f} ms of this process's CPU, = {100 * check_cpu / a.canary_every:.3f} % of one "
              f"core spread over the interval; the group's processes spent {check_group:.2f} s of CPU answering it "
              f"({100 * check_group / a.canary_every:.2f} % of one core over the interval).\n"
              if a.canary_every > 0 else "Output canary off.\n")
    text = f"""# Supervisor CPU while idle

Group: backend cpu, --gpus {a.gpus}, mode {a.mode}, {n} child processes, demo model; window {wall:.1f} s after ready.
Supervisor process (children excluded): {cpu * 1000:.1f} ms CPU = **{pct:.3f} % of one core** ({verdict} the 0.5 % target).
{canary}Python {sys.version.split()[0]}, {os.cpu_count()} cores; psutil cpu_times resolution is 10 ms.
"""
    out = ROOT / "bench" / "results" / "idle_cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


def _group_cpu(me: psutil.Process) -> float:
    """CPU seconds of this process's children (the group's llama-server and rpc-servers) so far."""
    total = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


if __name__ == "__main__":
    sys.exit(main())
