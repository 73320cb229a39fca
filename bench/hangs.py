"""Hangs with the progress watchdog at its defaults: how long until it is noticed, until the group serves again, and
what requests get meanwhile.

    sudo python bench/hangs.py [--runs 3] [--kinds NAME ...] [--out FILE]

Each kind freezes one member of a served demo model with the cgroup freezer (tests/_freeze.py: every process stays
alive, /health stays 200, as a card hung in its driver leaves them), idle or with one streaming request in flight:

- "rpc-server, busy" / "rpc-server, idle": `--mode rpc --gpus 0,1` (two CPU cards), rpc1 frozen;
- "llama-server main thread, busy" / "... idle": `--gpus 0`, only llama-server's main thread frozen;
- "rpc-server on host b, busy": host b is a network namespace with its own sshd (tests/_netns.py), its rpc-server
  frozen (skipped where namespaces cannot run).

Per run: detection = from the freeze to the watchdog's verdict (status()'s last_failure); idle, the freeze comes
right after an idle check has computed its token, so this is the time since the last progress, at its longest;
recovery = to the first correct greedy answer after it; the request in flight: how it ended and when; and from the verdict until serving
again, one one-token request every 0.5 s: what each got (connection refused, HTTP 503 while loading, an answer).
The group runs in this process (the supervisor and its members, no bus, no telemetry), with the watchdog's default
policy (run/watchdog.py HangPolicy). Writes bench/results/hangs.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import httpx
from anyio.from_thread import start_blocking_portal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _freeze import frozen, unavailable  # noqa: E402
from _netns import NetHarness, unavailable as no_net  # noqa: E402
from _report import write_report  # noqa: E402
from loadgen import demo_model  # noqa: E402

from arcsplit._api import ServeRequest, prepare, preview  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.rig import load_layout  # noqa: E402
from arcsplit.run.remote import launcher_for  # noqa: E402
from arcsplit.run.supervisor import RestartPolicy, Supervisor, Timeouts  # noqa: E402
from arcsplit.run.watchdog import HangPolicy, describe_policy  # noqa: E402

KINDS = ("rpc-server, busy", "rpc-server, idle", "llama-server main thread, busy", "llama-server main thread, idle",
         "rpc-server on host b, busy")
PROMPT = "The three primary colors are"
STORY = "Once upon a time, in a small village by the sea, there lived"


def greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=120)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


@contextlib.contextmanager
def serving(config: Any) -> Iterator[Supervisor]:
    with start_blocking_portal() as portal:
        sup = Supervisor(config, policy=RestartPolicy(max_failures=20), timeouts=Timeouts(hang=HangPolicy()),
                         launcher=launcher_for(config))
        with portal.wrap_async_context_manager(sup) as s:
            yield s


class Stream:
    """One streaming completion in a thread, to be in flight at the freeze."""

    def __init__(self, url: str) -> None:
        self.started, self.end, self.outcome = threading.Event(), 0.0, ""
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        body = {"prompt": STORY, "n_predict": 4000, "stream": True, "ignore_eos": True, "cache_prompt": False}
        try:
            with httpx.stream("POST", f"{url}/completion", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    self.started.set()
            self.outcome = "finished"
        except httpx.HTTPError as exc:
            self.outcome = f"error ({type(exc).__name__})"
        finally:
            self.end = time.time()
            self.started.set()


def meanwhile(url: str, stop: threading.Event, seen: Counter[str]) -> None:
    """One one-token request every 0.5 s until ``stop``: what each got."""
    with httpx.Client(timeout=10, trust_env=False) as c:
        while not stop.is_set():
            try:
                r = c.post(f"{url}/completion", json={"prompt": "1", "n_predict": 1})
                seen["200" if r.status_code == 200 else f"HTTP {r.status_code} {error_message(r)}"] += 1
            except httpx.ConnectError:
                seen["connection refused"] += 1
            except httpx.HTTPError as exc:
                seen[type(exc).__name__] += 1
            stop.wait(0.5)


def error_message(r: httpx.Response) -> str:
    """llama-server's error message ("Loading model"), else the start of the body."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(r.text[:40])


def one(sup: Supervisor, freeze: Callable[[], ContextManager[Any]], busy: bool, reference: list[int]) -> dict[str, Any]:
    gen = sup.status()["generation"]
    stream = Stream(sup.url) if busy else None
    if stream is not None:
        stream.started.wait(60)
        time.sleep(1.0)
    seen: Counter[str] = Counter()
    stop = threading.Event()
    with freeze():
        t0 = time.time()
        deadline = t0 + 180
        while not ((f := sup.status()["last_failure"]) and f["time"] > t0) and time.time() < deadline:
            time.sleep(0.1)
        failure = sup.status()["last_failure"]
        poller = threading.Thread(target=meanwhile, args=(sup.url, stop, seen), daemon=True)
        poller.start()
        while not ((s := sup.status())["generation"] > gen and s["state"] == "ready") and time.time() < deadline:
            time.sleep(0.1)
    ok = greedy(sup.url) == reference
    t1 = time.time()
    stop.set()
    poller.join(15)
    if stream is not None:
        stream.thread.join(30)
    return {"detect": failure["time"] - t0 if failure else None, "recover": t1 - t0, "correct": ok,
            "who": failure["who"] if failure else None, "message": failure["message"] if failure else "",
            "stream": (stream.outcome, stream.end - t0) if stream is not None else None, "meanwhile": seen}


def run_kind(kind: str, runs: int, net: Any, tmp: Path) -> list[dict[str, Any]]:
    model = str(demo_model())
    if kind.startswith("rpc-server on host b"):
        path = net.layout(tmp / "two.toml", [("", 300), ("b", 1024)])
        config = preview(ServeRequest(model=model, backend="cpu", mode="rpc", ctx=1024, threads=1, port=free_port()),
                         rig=load_layout(path)).config
    else:
        gpus = "0" if kind.startswith("llama-server") else "0,1"
        config = prepare(ServeRequest(model=model, backend="cpu", gpus=gpus, mode="rpc" if gpus == "0,1" else "auto",
                                      ctx=1024, threads=1, port=free_port())).config
    victim = "server" if kind.startswith("llama-server") else "rpc1"
    out = []
    with serving(config) as sup:
        reference = greedy(sup.url)
        for i in range(runs):
            time.sleep(35)  # past an idle check and the failure count's decay (RestartPolicy.half_life)
            if kind.endswith("idle"):  # the worst phase: the last progress is the idle check that just ran
                checks = sup.status()["watchdog"]["idle_checks"]
                while sup.status()["watchdog"]["idle_checks"] == checks:
                    time.sleep(0.05)
                time.sleep(0.5)  # its one token
            pid = sup.status()["processes"][victim]["pid"]
            freeze = (lambda: frozen(pid, thread=pid)) if victim == "server" else (lambda: frozen(pid))
            got = one(sup, freeze, kind.endswith("busy"), reference)
            print(f"  {kind} #{i + 1}: detected {got['detect']:.1f} s, serving {got['recover']:.1f} s, "
                  f"stream {got['stream']}, meanwhile {dict(got['meanwhile'])}\n    {got['message']}", flush=True)
            out.append(got)
    return out


def mmm(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "-"


def report(results: dict[str, list[dict[str, Any]]], skipped: dict[str, str], minutes: float) -> str:
    lines = ["# Hangs with the progress watchdog at its defaults (bench/hangs.py)", "",
             f"Watchdog: {describe_policy(HangPolicy())}. Demo model, CPU build, this machine "
             f"(shared, 2 cores); one member frozen with the cgroup v2 freezer. Total {minutes:.1f} min. "
             f"Command: `{shlex.join(['bench/hangs.py', *sys.argv[1:]])}`.", "",
             "| hang | runs | detection s (min/median/max) | serving again s | request in flight | "
             "requests during the restart | named |", "|---|---|---|---|---|---|---|"]
    for kind, runs in results.items():
        det = [r["detect"] for r in runs if r["detect"] is not None]
        rec = [r["recover"] for r in runs if r["correct"]]
        streams = [r["stream"] for r in runs if r["stream"]]
        flight = "-" if not streams else "; ".join(sorted({f"{o} after {mmm([s[1] for s in streams if s[0] == o])} s"
                                                           for o, _ in streams}))
        during: Counter[str] = Counter()
        for r in runs:
            during.update(r["meanwhile"])
        named = ", ".join(sorted({str(r["who"]) for r in runs}))
        lines.append(f"| {kind} | {len(runs)} | {mmm(det)} | {mmm(rec)} | {flight} | "
                     f"{', '.join(f'{k}: {n}' for k, n in during.most_common()) or '-'} | {named} |")
    for kind, why in skipped.items():
        lines.append(f"| {kind} | 0 | - | - | - | - | skipped: {why} |")
    examples = {kind: runs[0]["message"] for kind, runs in results.items() if runs}
    lines += ["", "What the supervisor said (the first run of each):", ""]
    lines += [f"- {kind}: `arcsplit: {msg}; restarting`" for kind, msg in examples.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hangs.md"))
    a = ap.parse_args(argv)
    why = unavailable()
    if why:
        raise SystemExit(f"hangs: {why}")
    t0 = time.time()
    results: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="arcs-hangs-") as d, contextlib.ExitStack() as stack:
        net = None
        if any("host b" in k for k in a.kinds) and no_net() is None:
            llama = Path(os.environ["ARCSPLIT_LLAMA_DIR"]) if os.environ.get("ARCSPLIT_LLAMA_DIR") else None
            net = stack.enter_context(NetHarness(Path(d) / "net", ("b",), llama))
        for kind in a.kinds:
            if "host b" in kind and net is None:
                skipped[kind] = "network namespaces or sshd cannot run here"
                continue
            print(f"{kind} ...", flush=True)
            results[kind] = run_kind(kind, a.runs, net, Path(d))
    write_report(a.out, report(results, skipped, (time.time() - t0) / 60))
    return 0 if all(r["correct"] and r["detect"] is not None for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
