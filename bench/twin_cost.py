"""Decode cost per token of a split route over native with the same setting, from bench/throughput.py's files.

    python bench/twin_cost.py FILE... [--out FILE]

bench/throughput.py's column "decode us/token over native" compares every mode with plain native. A mode that
changes a setting of both (``-bs``: llama.cpp's sampling on the card, which speeds native up as much as the split
routes) then mixes the setting's gain with the split's cost. Where a file has the setting's native twin as well
(``native-bs`` beside ``rpc-bs`` and ``hybrid-bs``), this prints each split mode's decode microseconds per token
over that twin, per run (from the file's "Every repetition" lines: each run's median decode t/s per mode), as
min / **median** / max over runs: the split's own cost with the setting on in both.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit  # noqa: E402
from throughput import us_cell  # noqa: E402

ROUTES = ("hybrid", "rpc")
_REP = re.compile(r"^- run (\d+), ([\w-]+): ready after [\d.]+ s; prefill [^;]+; decode ([^;]+);", re.M)


def decode_medians(text: str) -> dict[int, dict[str, float]]:
    """Run -> mode -> the median of that run's decode repetitions (t/s)."""
    runs: dict[int, dict[str, float]] = {}
    for run, mode, decode in _REP.findall(text):
        xs = [float(x) for x in decode.split(",") if x.strip()]
        if xs:
            runs.setdefault(int(run), {})[mode] = statistics.median(xs)
    return runs


def native_twin(mode: str) -> str | None:
    """``rpc-bs`` -> ``native-bs``; a plain route or native itself has none."""
    route, sep, tags = mode.partition("-")
    return f"native-{tags}" if route in ROUTES and sep else None


def twin_costs(text: str) -> dict[tuple[str, str], list[float]]:
    """(mode, its native twin) -> per run, decode us/token of the mode over the twin (runs holding both)."""
    out: dict[tuple[str, str], list[float]] = {}
    for _, modes in sorted(decode_medians(text).items()):
        for mode, tps in modes.items():
            twin = native_twin(mode)
            if twin is not None and twin in modes and tps > 0 and modes[twin] > 0:
                out.setdefault((mode, twin), []).append(1e6 / tps - 1e6 / modes[twin])
    return out


def card(text: str) -> str:
    """The file's GPU and the start of its UUID (each card reads differently: keep them apart)."""
    m = re.search(r"GPU 0: (NVIDIA [^(]+?) \(UUID: (GPU-[0-9a-f]{8})", text)
    return f"{m.group(1).strip()} {m.group(2)}" if m else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="write the table here (markdown) as well")
    a = ap.parse_args()
    lines = ["# Decode cost per token over native with the same setting", "",
             f"- Command: `python bench/twin_cost.py {' '.join(str(f) for f in a.files)}`",
             "- Per run: 1e6 / (the mode's median decode t/s) - 1e6 / (its native twin's), from each file's "
             "repetitions; min / **median** / max over runs.", "",
             "| file | card | mode / native twin | runs | decode us/token over the twin |", "|---|---|---|---|---|"]
    found = False
    for f in a.files:
        try:
            text = f.read_text()
        except OSError as e:
            print(f"cannot read {f}: {e.strerror}; name a file bench/throughput.py wrote", file=sys.stderr)
            return 2
        for (mode, twin), xs in twin_costs(text).items():
            found = True
            lines.append(f"| `{f.name}` | {card(text)} | {mode} / {twin} | {len(xs)} | {us_cell(xs)} |")
    if not found:
        print("no mode with a native twin in these files (e.g. rpc-bs beside native-bs)", file=sys.stderr)
        return 2
    emit("\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
