"""A backend's row for arcsplit/data/compute_backends.toml, from an accuracy run on that backend.

Reads the per-card JSON that bench/plan_accuracy.py writes in its CUDA mode (bench/results/gpu/compute_cuda.json:
rows with ``measured_compute_bytes``, llama.cpp's compute buffer on that backend, and ``formula_compute_bytes``, the
planner's figure for the same card) and prints min/median/max of measured / formula and of measured - formula, then
the smallest ``add_mib`` (with factor 1.0) and the smallest ``factor`` (with add_mib 0) that leave no card more than
16 MiB below llama.cpp (issue 16's tolerance). The planner's figure includes the backend's row as it was when the
run was made (none before compute_backends.toml existed, as in the committed compute_cuda.json): a positive
``add_mib`` printed from a newer run is what that row still lacks.

Run: python bench/backend_factor.py bench/results/gpu/compute_cuda.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

MiB = 1024 * 1024
TOLERANCE = 16 * MiB


def main(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = [r for r in (data["rows"] if isinstance(data, dict) else data) if r.get("formula_compute_bytes")]
    if not rows:
        sys.exit(f"{path}: no rows with a formula compute figure")
    ratio = [r["measured_compute_bytes"] / r["formula_compute_bytes"] for r in rows]
    short = [(r["measured_compute_bytes"] - r["formula_compute_bytes"]) / MiB for r in rows]
    print(f"{len(rows)} cards: measured / formula min {min(ratio):.3f} median {statistics.median(ratio):.3f} "
          f"max {max(ratio):.3f}; measured - formula MiB min {min(short):+.1f} median {statistics.median(short):+.1f} "
          f"max {max(short):+.1f}")
    add = max(0, math.ceil(max(short) - TOLERANCE / MiB))
    factor = max(1.0, max((r["measured_compute_bytes"] - TOLERANCE) / r["formula_compute_bytes"] for r in rows))
    print(f"add_mib = {add}  (factor 1.0)   or   factor = {math.ceil(factor * 100) / 100:.2f}  (add_mib 0)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
