"""How long each process's CUDA graph runs per decoded token, from a light trace's kept records.

    python bench/graph_spans.py RAWDIR [--tokens 60] [--out FILE]
    python bench/graph_spans.py RAWDIR --kernels [--tokens 64] [--out FILE]

RAWDIR is what `bench/gpu_trace.py --keep-raw RAWDIR` wrote under ARCSPLIT_CUPTI_LIGHT=1 (one record per CUDA graph
launch: its span on the card, first kernel to last): MODE_PROCESS.tsv.gz per traced process. For the last --tokens
graphs of each process (the traced request's decode), it prints the span's min / median / max, and per mode the sum
of its processes' medians against native's: whether splitting the model over processes makes the card's own work
per token longer, apart from the idle gaps between processes that gpu_trace.py reports.

--kernels reads a full trace's records instead (gpu_trace.py without ARCSPLIT_CUPTI_LIGHT: one record per kernel):
within the traced request's burst of GPU work (gpu_trace.last_burst over all of a mode's processes), each process's
kernels per token and kernel time per token, and per kernel name (template arguments dropped) the time per token
against native's, largest differences first: which kernels a split makes slower, or adds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_trace import last_burst, read_trace  # noqa: E402
from _report import emit  # noqa: E402


def spans(path: Path, tokens: int) -> list[float]:
    """The last ``tokens`` graph spans (us) of one process's records."""
    graphs = sorted((r for r in read_trace(path) if r.kind == "K"), key=lambda r: r.start)
    return [(r.end - r.start) / 1000 for r in graphs[-tokens:] if r.end > r.start]


def mode_proc(path: Path) -> tuple[str, str]:
    """MODE_PROCESS.tsv.gz -> (mode, process)."""
    mode, proc = path.name[:-len(".tsv.gz")].rsplit("_", 1)
    return mode, proc


def short(name: str) -> str:
    """A kernel's name without its template arguments or parameter list."""
    return name.split("<")[0].split("(")[0].removeprefix("void ").strip() or name[:60]


def kernel_table(files: list[Path], tokens: int) -> list[str]:
    """--kernels: per process and per kernel name, µs of kernel time per token inside each mode's last burst."""
    by_mode: dict[str, dict[str, list]] = {}
    for f in files:
        mode, proc = mode_proc(f)
        by_mode.setdefault(mode, {})[proc] = [r for r in read_trace(f) if r.kind in ("K", "M", "S")]
    rows = ["| mode | process | kernels per token | kernel us per token | copies and memsets us per token |",
            "|---|---|---|---|---|"]
    names: dict[str, dict[str, float]] = {}
    for mode, procs in by_mode.items():
        gpu = [(r.start, r.end) for recs in procs.values() for r in recs]
        if not gpu:
            continue
        lo, hi = last_burst(gpu)
        per_name = names.setdefault(mode, {})
        for proc, recs in sorted(procs.items()):
            inside = [r for r in recs if lo <= r.start <= hi]
            ks = [r for r in inside if r.kind == "K"]
            if not inside:
                continue
            for r in ks:
                per_name[short(r.name)] = per_name.get(short(r.name), 0.0) + (r.end - r.start) / 1000 / tokens
            rows.append(f"| {mode} | {proc} | {len(ks) / tokens:.0f} | "
                        f"{sum(r.end - r.start for r in ks) / 1000 / tokens:.1f} | "
                        f"{sum(r.end - r.start for r in inside if r.kind != 'K') / 1000 / tokens:.1f} |")
    out = rows
    base = names.get("native")
    for mode, per_name in names.items():
        if base is None or mode == "native":
            continue
        diff = sorted(((per_name.get(n, 0.0) - base.get(n, 0.0), n) for n in set(per_name) | set(base)),
                      key=lambda d: -abs(d[0]))
        total_d = sum(d for d, _ in diff)
        out += ["", f"{mode} against native, kernel time per token by kernel name (total {total_d:+.1f} us; the "
                "largest differences):", "", "| kernel | native us | " + mode + " us | difference |", "|---|---|---|---|"]
        out += [f"| `{n}` | {base.get(n, 0.0):.1f} | {per_name.get(n, 0.0):.1f} | {d:+.1f} |" for d, n in diff[:15]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="a folder gpu_trace.py --keep-raw wrote (light mode; a full trace with --kernels)")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--out", default="")
    ap.add_argument("--kernels", action="store_true", help="a full trace: kernel time per token by kernel name")
    a = ap.parse_args(argv)
    files = sorted(Path(a.raw).glob("*_*.tsv.gz"))
    if not files:
        raise SystemExit(f"{a.raw}: no MODE_PROCESS.tsv.gz files (gpu_trace.py --keep-raw writes them)")
    if a.kernels:
        text = "\n".join([f"# Kernel time per decoded token, per process and kernel name (`{Path(a.raw).name}`)", "",
                          f"- Command: `python bench/graph_spans.py {a.raw} --kernels --tokens {a.tokens}`", "",
                          *kernel_table(files, a.tokens)]) + "\n"
        emit(text, a.out)
        return 0
    rows, per_mode = [], {}
    for f in files:
        mode, proc = mode_proc(f)
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
    emit("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
