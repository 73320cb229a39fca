"""The compute factor of one backend for arcsplit/data/compute_backends.toml, from an accuracy run on that backend.

Reads the per-card JSON that bench/plan_accuracy.py writes in its CUDA mode (bench/results/gpu/compute_cuda.json:
rows with ``measured_compute_bytes``, llama.cpp's compute buffer on that backend, and ``formula_compute_bytes``, the
planner's CPU-calibrated figure for the same card) and prints min/median/max of measured / formula. The factor to
record is the max: the formulas times it stay at or above every card measured (the safe side); it never goes
above 1.0 from here, a backend that needs more than the formulas keeps its margin until the formulas are fixed.

Run: python bench/backend_factor.py bench/results/gpu/compute_cuda.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def ratios(rows: list[dict]) -> list[float]:
    return [r["measured_compute_bytes"] / r["formula_compute_bytes"] for r in rows if r.get("formula_compute_bytes")]


def main(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = data["rows"] if isinstance(data, dict) else data
    got = ratios(rows)
    if not got:
        sys.exit(f"{path}: no rows with a formula compute figure")
    print(f"{len(got)} cards: measured / formula compute min {min(got):.3f} median {statistics.median(got):.3f} "
          f"max {max(got):.3f}")
    print(f"factor = {min(1.0, round(max(got) + 0.005, 2)):.2f}  (the max, rounded up; at most 1.0)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
