"""How responsive the dashboard stays while logs stream at a high rate.

A real instance (demo model, CPU build) runs in a child process, as `arcsplit serve` would; on cue its
supervisor publishes log lines at RATE lines/s for SECONDS. The dashboard (headless, 80x24, on the logs tab,
the costliest view, then on the overview) attaches through the bus. Measured:

- tick: the app's own work per 50 ms tick (fold messages into the state, redraw changed panels);
- loop lag: how late a 10 ms timer fires on the app's event loop: every frame the compositor draws, every
  message parse and every key handled runs on that loop, so its worst lag bounds the worst UI frame;
- key: time from a key event reaching the app (as the terminal driver posts it) to its action running
  (next process in the log view), twice a second during the flood.

    python bench/dash_frame.py [--rate 5000] [--seconds 5] [--out bench/results/dash_frame.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def child(rate: int, seconds: float) -> None:
    import anyio

    from _instance import running_instance  # type: ignore[import-not-found]
    from arcsplit.demo import ensure_demo_model
    from arcsplit.run.events import Event

    async def flood(sup) -> int:
        sent, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            for _ in range(rate // 100):
                sup.events.publish(Event("log", "server", {"line": f"srv  update_slots: flood line {sent}"}))
                sent += 1
            await anyio.sleep(0.01)
        return sent

    with running_instance(ensure_demo_model(), telemetry_interval=2.0) as inst:
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() == "go":
                sent = inst.portal.call(flood, inst.sup)
                print(f"DONE {sent}", flush=True)
            elif line.strip() == "quit":
                break


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] * 1000 if v else float("nan")


async def measure(proc: subprocess.Popen, tab: str, seconds: float) -> dict[str, float]:
    from arcsplit import attach
    from arcsplit.tui.app import DashApp
    from arcsplit.tui.feed import Feed

    from textual import events

    feed = Feed(attach())
    app = DashApp(feed)
    handled: list[float] = []
    original = app.action_next_process

    def timed_next_process() -> None:
        handled.append(time.perf_counter())
        original()

    app.action_next_process = timed_next_process  # type: ignore[method-assign]
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            while not app.state.connected:
                await pilot.pause(0.05)
            await pilot.press({"logs": "3", "overview": "1"}[tab])
            await pilot.pause(0.3)
            app.tick_times.clear()
            before = app.state.log_total
            proc.stdin.write("go\n")
            proc.stdin.flush()
            lags, keys = [], []
            posted = 0.0
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)
                if len(lags) % 50 == 0 and tab == "logs":
                    if len(handled) == len(keys) + 1:
                        keys.append(handled[-1] - posted)
                    if len(handled) == len(keys):
                        posted = time.perf_counter()
                        app.post_message(events.Key("p", "p"))
            sent = int(proc.stdout.readline().split()[1])
            await pilot.pause(0.5)
            got = app.state.log_total - before
            ticks = list(app.tick_times)
    finally:
        feed.close()
    return {"sent": sent, "got": got, "tick_p50": pct(ticks, 0.5), "tick_p99": pct(ticks, 0.99),
            "tick_max": pct(ticks, 1.0), "lag_p50": pct(lags, 0.5), "lag_p99": pct(lags, 0.99),
            "lag_max": pct(lags, 1.0), "key_p50": pct(keys, 0.5), "key_max": pct(keys, 1.0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.rate, args.seconds)
        return 0
    from arcsplit.llama.locate import find_llama

    root = Path(tempfile.mkdtemp(prefix="dash-bench-"))
    os.environ.setdefault("ARCSPLIT_LLAMA_DIR", str(find_llama(backend="cpu").bin_dir))  # before the cache moves
    os.environ.update(ARCSPLIT_STATE_DIR=str(root / "state"), ARCSPLIT_RUNTIME_DIR=str(root / "rt"),
                      ARCSPLIT_CACHE_DIR=str(root / "cache"))
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--rate", str(args.rate), "--seconds",
                             str(args.seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "READY"
        results = {tab: asyncio.run(measure(proc, tab, args.seconds)) for tab in ("logs", "overview")}
    finally:
        proc.stdin.write("quit\n")
        proc.stdin.close()
        proc.wait(60)
    lines = [f"rate {args.rate} lines/s for {args.seconds:.0f} s, 80x24, {os.cpu_count()} cores "
             f"(instance in its own process)", "",
             "| view | lines sent / seen | tick p50 / p99 / max ms | loop lag p50 / p99 / max ms | key p50 / max ms |",
             "|---|---|---|---|---|"]
    for tab, r in results.items():
        lines.append(f"| {tab} | {r['sent']} / {r['got']} | {r['tick_p50']:.1f} / {r['tick_p99']:.1f} / "
                     f"{r['tick_max']:.1f} | {r['lag_p50']:.1f} / {r['lag_p99']:.1f} / {r['lag_max']:.1f} | "
                     f"{r['key_p50']:.1f} / {r['key_max']:.1f} |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("# Dashboard responsiveness under a log flood (bench/dash_frame.py)\n\n"
                            + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
