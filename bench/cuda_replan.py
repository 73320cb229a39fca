"""The CUDA ground truth against today's planner: every card of bench/results/gpu/compute_cuda.json planned again.

compute_cuda.json (bench/plan_accuracy.py's CUDA mode, one H200) records what llama.cpp's CUDA allocator reserved
per card for each model, layout, options and split. This plans each of those cards again with the planner as it
is now (formulas plus the cuda row of arcsplit/data/compute_backends.toml), without a GPU, and prints min/median/max
of planned - allocated per card and how many are below by more than 16 MiB (issue 16: none may be).

Run: python bench/cuda_replan.py   (writes bench/results/gpu/cuda_replan.md)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_accuracy as pa  # noqa: E402
from _report import write_report  # noqa: E402
from arcsplit.memory import backend_compute  # noqa: E402
from arcsplit.model import load_profile  # noqa: E402
from arcsplit.planner import plan_for_split  # noqa: E402
from arcsplit.rig import Card  # noqa: E402

MiB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def replan(data: dict) -> list[tuple[float, bool, dict]]:
    """(planned - allocated MiB, within issue 16's target, the row) for every card the CUDA run measured."""
    rows = [r for r in data["rows"] if "error" not in r]
    configs = dict(pa.CUDA_CONFIGS)
    layouts = {name: devs for name, devs, _ in pa.CUDA_LAYOUTS}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        models = dict(pa.cuda_models(Path(tmp)))
        profiles: dict[str, object] = {}
        for r in rows:
            prof = profiles.setdefault(r["model"], load_profile(models[r["model"]]))
            opts = replace(configs[r["config"]], n_outputs=configs[r["config"]].n_ubatch)
            devs = layouts[r["layout"]]
            cards = [Card("cuda", i, devs[i], pa.BIG * MiB, pa.BIG * MiB, 0) for i in range(len(devs))]
            cp = next(c for c in plan_for_split(prof, cards, opts, r["tensor_split"], devs).cards
                      if c.device == r["card"])
            m = r["measured_mib"]
            real = (m["weights"] + m["context"] + m["compute"]) * MiB
            out.append(((cp.total - real) / MiB, pa.ok(cp.total - real, real), r))
    return out


def main() -> None:
    data = json.loads((RESULTS / "compute_cuda.json").read_text(encoding="utf-8"))
    out = replan(data)
    errs = [e for e, _, _ in out]
    under = [(e, r) for e, _, r in out if e < -16]
    worst = min(out, key=lambda x: x[0])
    row = backend_compute("cuda")
    lines = ["# CUDA ground truth against today's planner", "",
             f"{len(out)} cards of `compute_cuda.json` ({data.get('gpu', 'one GPU')}), planned again with the formulas "
             f"and the cuda row (factor {row.factor}, +{row.add_mib} MiB a card). Planned - allocated per card, MiB: "
             f"min {min(errs):+.1f} / median {statistics.median(errs):+.1f} / max {max(errs):+.1f}.", "",
             f"- below llama.cpp by more than 16 MiB: **{len(under)}** of {len(out)} (issue 16: none)",
             f"- within max(2 %, 16 MiB): {sum(ok for _, ok, _ in out)} of {len(out)}; the others are above it "
             "(the safe side: the 40 MiB row on cards that did not need it)",
             f"- most below: {worst[0]:+.1f} MiB ({worst[2]['model']}, {worst[2]['layout']}, {worst[2]['config']}, "
             f"{worst[2]['card']})"]
    write_report(RESULTS / "cuda_replan.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
