"""A route that turns wrong mid-serve: how long until the output canary notices, until the next route answers
correctly, and what requests got meanwhile.

    python bench/corrupt.py [--runs 3] [--every 10] [--out FILE]

`arcsplit.serve` runs the demo model on two CPU cards (`--mode auto`: all-RPC first, then hybrid, the default order's
list) with tests/_corrupt_rpc.py's forwarder in front of each rpc-server: clean at the start, it flips the sign of
every 4th float of the activations llama-server sends once it gets SIGUSR1 (the corruption a device-lost storm or a
bad peer copy leaves: every process alive, /health 200, answers wrong). The shared-memory link is off so that the
activations cross the socket where the forwarder sits. A load thread sends one greedy 8-token request every 0.5 s
and compares each answer with the one the clean route gave.

Per run: detection = from the SIGUSR1 to the route event (the canary's mismatch); recovery = to the first request
started after it that answers the clean answer again; requests that errored, and requests answered wrong (before
detection: the cost of the interval; after recovery: must be 0). Each run starts fresh (its own tune directory, so
no route is already marked wrong). Writes bench/results/corrupt.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _corrupt_rpc import live_build  # noqa: E402
from _procs import wait_until  # noqa: E402
from _report import write_report  # noqa: E402
from loadgen import demo_model  # noqa: E402

import arcsplit  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

PROMPT = "The three primary colors are"


@dataclass
class Req:
    start: float
    end: float
    tokens: list[int] | None  # None: it errored


@dataclass
class Load:
    """One greedy request every 0.5 s until stopped, each kept with its answer."""

    url: str
    done: list[Req] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=60, trust_env=False) as c:
            while not self.stop.is_set():
                t0 = time.time()
                try:
                    r = c.post(f"{self.url}/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                               "top_k": 1, "return_tokens": True})
                    r.raise_for_status()
                    self.done.append(Req(t0, time.time(), [int(t) for t in r.json()["tokens"]]))
                except (httpx.HTTPError, ValueError, KeyError):
                    self.done.append(Req(t0, time.time(), None))
                self.stop.wait(0.5)


def live_corrupting_build(tmp: Path) -> Path:
    """A llama.cpp dir whose ggml-rpc-server is the real one behind the forwarder, clean until SIGUSR1."""
    bins = find_llama(backend="cpu")
    return Path(live_build(tmp, str(bins.server), str(bins.rpc_server)))


def until(what: Any, timeout: float) -> Any:
    """``what()``'s first true value, or None after ``timeout`` s (the bench reports a miss; it does not fail)."""
    try:
        return wait_until(what, timeout, "", interval=0.05)
    except AssertionError:
        return None


def one(model: str, every: float, tmp: Path) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["ARCSPLIT_TUNE_DIR"] = tempfile.mkdtemp(prefix="tune", dir=tmp)
    with arcsplit.serve(model, [0, 1], backend="cpu", ctx=1024, port=free_port(), llama_dir=str(live_corrupting_build(tmp)),
                        bus=False, canary_every=every) as server:
        until(lambda: server.status()["canary"]["counts"].get("reference"), 120)
        load = Load(server.url)
        worker = threading.Thread(target=load.run, daemon=True)
        worker.start()
        clean = until(lambda: next((r.tokens for r in load.done if r.tokens), None), 60)
        time.sleep(every / 2)
        t0 = time.time()
        for p in server.status()["processes"].values():
            if p["role"] == "rpc" and p["pid"]:
                os.kill(p["pid"], signal.SIGUSR1)
        moves = until(lambda: server.status()["routes"]["moves"], 120) or []
        detected = moves[0]["at"] if moves else None
        ok_after = until(lambda: next((r for r in load.done if detected and r.start >= detected
                                       and r.tokens == clean), None), 120)
        time.sleep(5)  # requests after the recovery: must all be right
        load.stop.set()
        worker.join(70)
        route = server.status()["routes"]["now"]
    after = [r for r in load.done if ok_after and r.start >= ok_after.start]
    window = [r for r in load.done if r.end >= t0 and (ok_after is None or r.start < ok_after.start)]
    return {"detect": detected - t0 if detected else None, "recover": ok_after.end - t0 if ok_after else None,
            "left": moves[0]["left"] if moves else None, "to": route,
            "errored": sum(r.tokens is None for r in window), "wrong": sum(r.tokens not in (None, clean) for r in window),
            "window": len(window), "lost_after": sum(r.tokens != clean for r in after)}


def mmm(xs: list[float]) -> str:
    return f"{min(xs):.1f} / **{statistics.median(xs):.1f}** / {max(xs):.1f}" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--every", type=float, default=10.0, help="the canary's interval (--canary-every), seconds")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "corrupt.md"))
    a = ap.parse_args(argv)
    os.environ["ARCSPLIT_RPC_SHM"] = "0"  # the activations cross the socket, where the forwarder is
    model = str(demo_model())
    t_start = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="arcs-corrupt-") as d:
        for i in range(a.runs):
            got = one(model, a.every, Path(d) / str(i))
            print(f"  run {i + 1}: {got}", flush=True)
            runs.append(got)
    det = [r["detect"] for r in runs if r["detect"] is not None]
    rec = [r["recover"] for r in runs if r["recover"] is not None]
    lines = ["# A route that turns wrong mid-serve (bench/corrupt.py)", "",
             f"Demo model on two CPU cards (this machine, 2 shared cores), `--canary-every {a.every:g}`; the "
             "forwarder (tests/_corrupt_rpc.py) starts flipping the activations sent to both rpc-servers; one greedy "
             f"request every 0.5 s. Total {(time.time() - t_start) / 60:.1f} min. Command: "
             f"`bench/corrupt.py --runs {a.runs} --every {a.every:g}`.", "",
             "| route left -> now | runs | detection s (min/median/max) | correct again s | requests in the window: "
             "errored / answered wrong / all | wrong after recovery |", "|---|---|---|---|---|---|",
             f"| {runs[0]['left']} -> {runs[0]['to']} | {len(runs)} | {mmm(det)} | {mmm(rec)} | "
             f"{sum(r['errored'] for r in runs)} / {sum(r['wrong'] for r in runs)} / {sum(r['window'] for r in runs)} | "
             f"{sum(r['lost_after'] for r in runs)} |", "",
             f"Target: left for the next correct route within one canary interval ({a.every:g} s) and a check; no wrong "
             "answer after the recovery. Requests answered wrong inside the window are what an interval costs: the "
             "canary runs only while the slots are idle, and a route that turns wrong is served until its next check."]
    write_report(a.out, "\n".join(lines) + "\n")
    ok = len(det) == a.runs and all(r["lost_after"] == 0 for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
