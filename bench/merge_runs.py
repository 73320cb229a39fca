"""One spread table from several logs of ``bench/throughput.py --runs`` (calls cut short by a time limit).

    python bench/merge_runs.py --out FILE --title TEXT LOG [LOG ...] [--greedy RESULT.md ...]

A device call has a time limit, so one set of independent runs may be spread over several calls, and the last
run of a call may be cut off. This reads the per-repetition lines each log printed (``run k/N, MODE: serving``
then ``MODE rep i ... prefill P decode D 4 streams S``), keeps every mode that finished all its repetitions,
and computes each run's ratios against the native of the same run (a run without a finished native is dropped).
The greedy cells come from the result files the same calls wrote (every mode's tokens against native's).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from throughput import ModeResult, fmt, paired_table, run_ratios, spread  # noqa: E402

RUN = re.compile(r"^run (\d+)/(\d+), (\S+): serving")
REP = re.compile(r"^\s+(\S+)\s+rep (\d+)\s.*?prefill\s+([\d.]+)\s+decode\s+([\d.]+)\s+\d+ streams\s+([\d.]+) t/s")
ROW = re.compile(r"^\| (\S+) \((\w+)\) \| (\d+) \| ([^|]+) \|")


def read_log(path: Path, reps: int) -> list[dict[str, ModeResult]]:
    """The runs of one log: per run, the modes that finished all ``reps`` measured repetitions."""
    runs: list[dict[str, ModeResult]] = []
    current: ModeResult | None = None
    run_no = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if m := RUN.match(line):
            if m.group(1) != run_no:
                runs.append({})
                run_no = m.group(1)
            current = ModeResult(m.group(3), "")
            runs[-1][m.group(3)] = current
        elif (m := REP.match(line)) and current is not None and m.group(1) == current.mode and m.group(2) != "0":
            current.prefill.append(float(m.group(3)))
            current.decode.append(float(m.group(4)))
            current.streams.append(float(m.group(5)))
    return [{k: r for k, r in run.items() if len(r.decode) == reps and len(r.streams) == reps} for run in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--greedy", nargs="*", type=Path, default=[], help="result files with the greedy column")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--title", required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    runs = [run for log in a.logs for run in read_log(log, a.reps) if "native" in run]
    modes: list[str] = []
    for run in runs:
        modes += [m for m in run if m not in modes]
    greedy: dict[str, list[str]] = {}
    shape: dict[str, tuple[str, str, str]] = {}
    for f in a.greedy:
        col = None  # the greedy column's place: tables since the ready columns do not end with it
        for line in f.read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if "greedy = native" in cells:
                col = cells.index("greedy = native")
            elif (m := ROW.match(line)) and col is not None and len(cells) > col:
                greedy.setdefault(m.group(1), []).append(cells[col])
                shape[m.group(1)] = (m.group(2), m.group(3), m.group(4).strip())
    as_lists = [[run[m] for m in modes if m in run] for run in runs]
    lines = [f"# {a.title}", "",
             f"Merged by `python bench/merge_runs.py` from {', '.join(f'`{p.name}`' for p in a.logs)}: "
             f"{len(runs)} independent runs (fresh processes per mode and run), every mode's ratio against the "
             "native of its own run; ratio cells: min / **median** / max over the runs in column `runs`; t/s "
             "cells: median over those runs of each run's median of "
             f"{a.reps} repetitions. Greedy cells: every check the result files "
             f"{', '.join(f'`{p.name}`' for p in a.greedy) or '(none)'} made.", "",
             "| mode | runs | -ub | -ngl (-ts) | prefill t/s | decode t/s | 4 streams t/s | prefill / native | "
             "decode / native | 4 streams / native | greedy = native |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        ok = [run[mode] for run in runs if mode in run]
        tps = [fmt(statistics.median([x.median(k) or 0.0 for x in ok]), 1 if k == "prefill" else 2)
               for k in ("prefill", "decode", "streams")]
        ratios = [spread(run_ratios(as_lists, mode, k)) for k in ("prefill", "decode", "streams")]
        amode, ub, layers = shape.get(mode, ("", "-", "-"))
        checks = greedy.get(mode, [])
        cell = "(reference)" if mode == "native" else (", ".join(checks) if checks else "not checked")
        lines.append(f"| {mode}{f' ({amode})' if amode else ''} | {len(ok)} | {ub} | {layers} | {' | '.join(tps)} | "
                     f"{' | '.join(ratios)} | {cell} |")
    lines += paired_table(as_lists, modes)
    lines += ["", "Every run's medians (t/s: prefill / decode / 4 streams):", ""]
    for k, run in enumerate(runs, 1):
        lines.append(f"- run {k}: " + "; ".join(
            f"{m} {fmt(r.median('prefill'))} / {fmt(r.median('decode'), 2)} / {fmt(r.median('streams'), 2)}"
            for m, r in run.items()))
    a.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
