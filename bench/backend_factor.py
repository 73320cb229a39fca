"""A backend's row for arcsplit/data/compute_backends.toml, from an accuracy run on that backend.

Reads the per-card JSON that bench/plan_accuracy.py writes in its CUDA mode (bench/results/gpu/compute_cuda.json,
or a --replan of it): rows with ``measured_compute_bytes`` (llama.cpp's compute buffer on that backend),
``formula_base_compute_bytes`` (the planner's formulas alone, no backend row; older files only have
``formula_compute_bytes``, made before compute_backends.toml existed), ``n_embd`` and ``n_ubatch``. Prints
min/median/max of measured / formula and measured - formula, then the row's smallest terms that leave no card more
than 16 MiB below llama.cpp (issue 16's tolerance): ``embd_rows`` (f32 rows n_embd wide per token of the ubatch)
fitted on cards with an f16 cache, then ``quant_kv_cell`` (bytes per cell of the context) on the cards with a
quantized one; and, for comparison,
the flat ``add_mib`` alone.

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
    base = [r.get("formula_base_compute_bytes", r["formula_compute_bytes"]) for r in rows]
    ratio = [r["measured_compute_bytes"] / b for r, b in zip(rows, base)]
    short = [(r["measured_compute_bytes"] - b) / MiB for r, b in zip(rows, base)]
    print(f"{len(rows)} cards: measured / formula min {min(ratio):.3f} median {statistics.median(ratio):.3f} "
          f"max {max(ratio):.3f}; measured - formula MiB min {min(short):+.1f} median {statistics.median(short):+.1f} "
          f"max {max(short):+.1f}")
    add = max(0, math.ceil(max(short) - TOLERANCE / MiB))
    print(f"flat: add_mib = {add}")
    if not all("n_embd" in r for r in rows):
        return
    quant = [r.get("cache_type_k", "f16") != "f16" or r.get("cache_type_v", "f16") != "f16" for r in rows]
    tokens = [r["n_embd"] * min(r["n_ubatch"], r["n_ctx"]) * 4 for r in rows]
    embd = max(0.0, max((r["measured_compute_bytes"] - b - TOLERANCE) / t
                        for r, b, t, q in zip(rows, base, tokens, quant) if not q))
    embd = math.ceil(embd * 4) / 4
    qkv = max([0] + [math.ceil((r["measured_compute_bytes"] - b - embd * t - TOLERANCE) / r["n_ctx"])
                     for r, b, t, q in zip(rows, base, tokens, quant) if q])
    print(f"per token: embd_rows = {embd:g}, quant_kv_cell = {qkv}  (add_mib 0)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
