"""How soon the node agent has an rpc-server up: `arcsplit node --stdio` from its exec to pong, hello, started and
ready, with its first phase (arcsplit/node/quick.py: the first ops answered before anyio is imported) and without
it (ARCSPLIT_NODE_QUICK=0: the agent imports everything first), alternating, real rpc-server, no ssh.

    python bench/node_start.py [--runs 15] [--hello-after MS] [--out bench/results/node_start.md]

The client sends ping and hello at once (as `serve` does when its planning is done before the agent starts), then
ports, then start after each answer. With --hello-after the hello goes MS ms after the pong instead: `serve`'s
planning done just after the agent is up, the usual case over SSH, where what counts is hello to ready. This is the agent's part of a start over SSH: on another host it runs after the
login, on that host's own cores. Here it shares this machine's cores with nothing else of the bench (no serve).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import build_line, machine  # noqa: E402

EVENTS = ("pong", "hello", "started", "ready")


def one(quick: bool, state: Path, llama_dir: Path, run: int, hello_after: float | None = None,
        tree: Path = ROOT) -> dict[str, float]:
    """One agent's start, of the arcsplit checkout at ``tree`` (bench/startup.py times another one)."""
    env = {**os.environ, "ARCSPLIT_STATE_DIR": str(state), "ARCSPLIT_NODE_QUICK": "1" if quick else "0",
           "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "arcsplit", "node", "--stdio", "--backend", "cpu",
                          "--llama-dir", str(llama_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         cwd=tree, env=env)
    assert p.stdin is not None and p.stdout is not None

    def send(**msg: object) -> None:
        assert p.stdin is not None
        p.stdin.write((json.dumps(msg) + "\n").encode())
        p.stdin.flush()

    marks: dict[str, float] = {}
    def hello() -> None:
        marks["asked"] = time.perf_counter() - t0
        send(op="hello", run=f"bench-{os.getpid()}-{run}-{int(quick)}", proto=1, backend="cpu")

    try:
        send(op="ping")
        if hello_after is None:
            hello()
        for line in p.stdout:
            ev = json.loads(line)
            kind = ev.get("ev")
            if kind in EVENTS and kind not in marks:
                marks[kind] = time.perf_counter() - t0
            if kind == "pong" and hello_after is not None:
                time.sleep(hello_after / 1000)
                hello()
            elif kind == "hello":
                send(op="ports", n=1, bind="127.0.0.1")
            elif kind == "ports":
                send(op="start", spec={"name": "rpc0", "argv": ["ggml-rpc-server", "-H", "127.0.0.1", "-p",
                                                                str(ev["ports"][0]), "-t", "1"]})
            elif kind == "ready":
                break
            elif kind == "error":
                raise SystemExit(f"node_start: the agent said {ev.get('message')}")
    finally:
        p.stdin.close()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return marks


def cell(xs: list[float]) -> str:
    ms = sorted(x * 1000 for x in xs)
    return f"{ms[0]:.0f} / **{statistics.median(ms):.0f}** / {ms[-1]:.0f}" if ms else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--hello-after", type=float, metavar="MS",
                    help="send the hello MS ms after the pong (default: with the ping)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "node_start.md"))
    a = ap.parse_args()
    if a.runs < 1 or (a.hello_after is not None and a.hello_after < 0):
        ap.error("--runs must be at least 1, --hello-after at least 0")
    import compileall

    compileall.compile_dir(str(ROOT / "arcsplit"), quiet=1)  # as pip install does (see bench/multihost.py)
    from arcsplit.errors import ArcsplitError
    from arcsplit.llama.locate import find_llama

    try:
        llama_dir = find_llama(None, backend="cpu").bin_dir
    except ArcsplitError as exc:
        raise SystemExit(f"node_start: {exc}") from None
    got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="arcsplit-node-start-") as tmp:
        one(True, Path(tmp), llama_dir, -1)  # warm the page cache and the build's answers cache
        for i in range(a.runs):
            for quick in ((True, False) if i % 2 == 0 else (False, True)):
                got[quick].append(one(quick, Path(tmp), llama_dir, i, a.hello_after))
    rows = ["| agent | " + " | ".join(f"{e} ms" for e in EVENTS) + " | hello sent to ready ms |",
            "|---|" + "---|" * (len(EVENTS) + 1)]
    for quick, label in ((False, "imports first (ARCSPLIT_NODE_QUICK=0)"), (True, "first phase (default)")):
        rows.append(f"| {label} | " + " | ".join(cell([m[e] for m in got[quick] if e in m]) for e in EVENTS)
                    + f" | {cell([m['ready'] - m['asked'] for m in got[quick]])} |")
    ready = {q: statistics.median(m["ready"] for m in got[q]) for q in got}
    text = "\n".join([
        "# The node agent's start: exec to an rpc-server ready",
        "",
        f"- Build: {build_line(None, 'cpu')}",
        f"- Machine: {machine('cpu')}",
        f"- Command: `python bench/node_start.py --runs {a.runs}"
        + (f" --hello-after {a.hello_after:g}`" if a.hello_after is not None else "`"),
        f"- {a.runs} runs of each, alternating; ms from the agent's exec; cells: min / **median** / max; "
        + ("the hello sent with the ping." if a.hello_after is None else
           f"the hello sent {a.hello_after:g} ms after the pong."),
        "",
        *rows,
        "",
        f"Median exec to ready: {ready[False] * 1000:.0f} ms -> {ready[True] * 1000:.0f} ms "
        f"({(ready[False] - ready[True]) * 1000:.0f} ms sooner with the first phase).",
        "",
    ])
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
