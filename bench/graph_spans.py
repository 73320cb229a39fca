"""How long each process's CUDA graph runs per decoded token, from a light trace's kept records.

    python bench/graph_spans.py RAWDIR [--tokens 60] [--out FILE]

RAWDIR is what `bench/gpu_trace.py --keep-raw RAWDIR` wrote under ARCSPLIT_CUPTI_LIGHT=1 (one record per CUDA graph
launch: its span on the card, first kernel to last): MODE_PROCESS.tsv.gz per traced process. For the last --tokens
graphs of each process (the traced request's decode), it prints the span's min / median / max, and per mode the sum
of its processes' medians against native's: whether splitting the model over processes makes the card's own work
per token longer, apart from the idle gaps between processes that gpu_trace.py reports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_trace import read_trace  # noqa: E402
from _report import write_report  # noqa: E402


def spans(path: Path, tokens: int) -> list[float]:
    """The last ``tokens`` graph spans (us) of one process's records."""
    graphs = sorted((r for r in read_trace(path) if r.kind == "K"), key=lambda r: r.start)
    return [(r.end - r.start) / 1000 for r in graphs[-tokens:] if r.end > r.start]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="a folder gpu_trace.py --keep-raw wrote (light mode)")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    files = sorted(Path(a.raw).glob("*_*.tsv.gz"))
    if not files:
        raise SystemExit(f"{a.raw}: no MODE_PROCESS.tsv.gz files (gpu_trace.py --keep-raw writes them)")
    rows, per_mode = [], {}
    for f in files:
        mode, proc = f.name[:-len(".tsv.gz")].rsplit("_", 1)
        s = spans(f, a.tokens)
        if not s:
            continue  # a process that ran no graph (all-RPC's llama-server)
        med = statistics.median(s)
        per_mode[mode] = per_mode.get(mode, 0.0) + med
        rows.append(f"| {mode} | {proc} | {len(s)} | {min(s):.0f} / **{med:.0f}** / {max(s):.0f} |")
    base = per_mode.get("native")
    lines = [f"# CUDA graph span per decoded token, per process (`{Path(a.raw).name}`)", "",
             f"- Command: `python bench/graph_spans.py {a.raw} --tokens {a.tokens}`", "",
             "| mode | process | graphs | span us (min / **median** / max) |", "|---|---|---|---|", *rows, "",
             "Per mode, the sum of its processes' median spans" + (" against native's:" if base else ":"), ""]
    lines += [f"- {m}: {v:.0f} us" + (f" ({v - base:+.0f})" if base and m != "native" else "")
              for m, v in per_mode.items()]
    text = "\n".join(lines) + "\n"
    if a.out:
        write_report(a.out, text)  # prints it too
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
