"""Start-up times of arcsplit's three entry points, for one checkout or two side by side.

    python bench/startup.py [--runs 10] [--tree PATH ...] [--out FILE]

Times ``arcsplit --help``, ``arcsplit plan`` on the demo model (``arcsplit model demo`` installs it), and the node
agent from its exec to an rpc-server ready (bench/node_start.py's client: ping and hello at once, then ports and
start; a real rpc-server of the managed CPU build). Each ``--tree`` is an arcsplit checkout run as
``python -m arcsplit`` from that folder with PYTHONPATH=PATH (default: this one), its bytecode compiled first as
pip install would; the trees' runs alternate so a busy machine slows each alike. Prints min / median / max in ms.

To compare a base commit with the working tree on a quiet machine:

    git archive 20c3fe2 | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python bench/startup.py --tree /tmp/base --tree .
"""

from __future__ import annotations

import argparse
import compileall
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from node_start import one as node_start_once  # noqa: E402

Timer = Callable[[Path, int], float]


def _cli(tree: Path, *argv: str) -> float:
    """Seconds from exec to exit of ``python -m arcsplit ARGV`` from ``tree``; a failure stops the bench."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "arcsplit", *argv], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"startup: `{shlex.join(['arcsplit', *argv])}` in {tree} exited {r.returncode}: "
                         f"{r.stderr.strip().splitlines()[-1:]}")
    return dt


def timers(model: Path, llama_dir: Path, state: Path) -> dict[str, Timer]:
    """What is timed, by name: each takes the tree and the run's number."""
    def node(tree: Path, run: int) -> float:
        marks = node_start_once(True, state, llama_dir, run, tree=tree)
        if "ready" not in marks:
            raise SystemExit(f"startup: the node agent of {tree} never said ready ({marks})")
        return marks["ready"]

    return {"arcsplit --help": lambda tree, run: _cli(tree, "--help"),
            "arcsplit plan (demo model)": lambda tree, run: _cli(tree, "plan", str(model), "--backend", "cpu"),
            "node agent: exec to ready": node}


def cell(xs: list[float]) -> str:
    ms = sorted(x * 1000 for x in xs)
    return f"{ms[0]:.0f} / **{statistics.median(ms):.0f}** / {ms[-1]:.0f}"


def tree_args(doc: str) -> tuple[argparse.Namespace, list[Path]]:
    """--runs, --tree (repeatable), --out, checked; each tree's bytecode compiled first, as pip install would
    (shared with bench/early_spawn.py)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tree", action="append", type=Path, help="an arcsplit checkout to time (repeat to compare)")
    ap.add_argument("--out", help="also write the table (Markdown) here")
    a = ap.parse_args()
    trees = [t.resolve() for t in (a.tree or [ROOT])]
    if a.runs < 1 or any(not (t / "arcsplit" / "__init__.py").is_file() for t in trees):
        ap.error("--runs must be at least 1 and each --tree an arcsplit checkout (with arcsplit/__init__.py)")
    for t in trees:
        compileall.compile_dir(str(t / "arcsplit"), quiet=1)
    return a, trees


def main() -> int:
    a, trees = tree_args(__doc__ or "")
    from arcsplit.demo import ensure_demo_model
    from arcsplit.errors import ArcsplitError
    from arcsplit.llama.locate import find_llama

    try:
        model, llama_dir = Path(ensure_demo_model()), find_llama(None, backend="cpu").bin_dir
    except ArcsplitError as exc:
        raise SystemExit(f"startup: {exc}") from None
    got: dict[tuple[str, Path], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="arcsplit-startup-") as tmp:
        measures = timers(model, llama_dir, Path(tmp))
        for name, timer in measures.items():
            for t in trees:
                timer(t, -1)  # warm the page cache and the build's answers cache
            for i in range(a.runs):
                for t in (trees if i % 2 == 0 else trees[::-1]):
                    got.setdefault((name, t), []).append(timer(t, i))
    rows = ["| what | " + " | ".join(f"`{t}` ms" for t in trees) + " |", "|---|" + "---|" * len(trees)]
    rows += [f"| {name} | " + " | ".join(cell(got[(name, t)]) for t in trees) + " |" for name in measures]
    text = "\n".join([f"# Start-up: {a.runs} runs each, min / **median** / max ms ({os.cpu_count()} cores, "
                      f"Python {sys.version.split()[0]})", "", *rows, ""])
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
