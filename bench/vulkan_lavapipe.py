"""The Vulkan route on Mesa's CPU Vulkan driver (lavapipe): time to ready, decode speed and greedy output of
`arcsplit serve --backend vulkan --mode hybrid` on two lavapipe devices, beside the CPU build's hybrid group.

    python bench/vulkan_lavapipe.py [--runs 1] [--n-predict 8] [--vulkan-dir DIR] [--cpu-dir DIR] [--out FILE]

Needs the managed Vulkan and CPU builds (scripts/test-vulkan) and mesa-vulkan-drivers. Lavapipe's manifest is
listed twice so the loader shows two devices: llama-server holds Vulkan card 0, one rpc-server Vulkan card 1.
Flash attention is off in both groups (Mesa 22.3.6's lavapipe segfaults in that path), repacking off in both.
The first request of each run compiles lavapipe's pipelines (LLVM), so it is timed apart from the decode rate,
which is the second request's. Lavapipe's speed says nothing about an Arc card; the point is that the route runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit.demo import ensure_demo_model  # noqa: E402
from arcsplit.llama.build import BuildConfig  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

PROMPT = "The three primary colors are"


def complete(url: str, n: int) -> tuple[list[int], float, float]:
    """(tokens, wall seconds, llama-server's predicted tokens/s)."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=1800)
    r.raise_for_status()
    body = r.json()
    return body["tokens"], time.perf_counter() - t0, float(body["timings"]["predicted_per_second"])


def run_group(backend: str, llama_dir: Path, model: Path, n: int) -> dict[str, object]:
    t0 = time.perf_counter()
    with arcsplit.serve(model, gpus=[0, 1], backend=backend, mode="hybrid", ctx=1024, threads=1, port=free_port(),
                        llama_dir=str(llama_dir), extra_args=("--no-repack", "-fa", "off"), bus=False) as server:
        ready = time.perf_counter() - t0
        tokens, first, _ = complete(server.url, n)
        again, _, rate = complete(server.url, n)
    return {"ready": ready, "first": first, "rate": rate, "tokens": tokens, "stable": tokens == again}


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--vulkan-dir", default=None, help="a Vulkan build's bin dir (default: the managed build)")
    ap.add_argument("--cpu-dir", default=None, help="a CPU build's bin dir (default: the managed build)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vulkan_lavapipe.md"))
    a = ap.parse_args(argv)
    dirs = {"cpu": Path(a.cpu_dir) if a.cpu_dir else BuildConfig("cpu").bin_dir,
            "vulkan": Path(a.vulkan_dir) if a.vulkan_dir else BuildConfig("vulkan").bin_dir}
    manifest = next(iter(sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json"))), None)
    if not all((d / "llama-server").exists() for d in dirs.values()) or manifest is None:
        print("needs the managed Vulkan and CPU builds and mesa-vulkan-drivers: run scripts/test-vulkan first",
              file=sys.stderr)
        return 2
    model = ensure_demo_model()
    with tempfile.TemporaryDirectory() as tmp:
        icds = [Path(tmp) / "lvp_a.json", Path(tmp) / "lvp_b.json"]
        for icd in icds:
            shutil.copy(manifest, icd)
        os.environ["VK_ICD_FILENAMES"] = ":".join(map(str, icds))
        os.environ.setdefault("XDG_RUNTIME_DIR", tmp)
        results: dict[str, list[dict[str, object]]] = {"cpu": [], "vulkan": []}
        for i in range(a.runs):
            for backend, bin_dir in dirs.items():
                r = run_group(backend, bin_dir, model, a.n_predict)
                results[backend].append(r)
                print(f"run {i}: {backend:<6} ready {r['ready']:6.1f} s  first request {r['first']:6.1f} s  "
                      f"decode {r['rate']:6.2f} t/s  same tokens twice: {r['stable']}", flush=True)
    reference = results["cpu"][0]["tokens"]
    equal = all(r["tokens"] == reference for rs in results.values() for r in rs)
    lines = [
        "# The Vulkan route on lavapipe (bench/vulkan_lavapipe.py)", "",
        f"`python bench/vulkan_lavapipe.py --runs {a.runs} --n-predict {a.n_predict}` on {os.cpu_count()} cores "
        f"(shared), {time.strftime('%Y-%m-%d')}. Demo model (Gemma 3 270M Q4_K_M), hybrid on two cards: "
        "llama-server holds card 0, one rpc-server card 1; ctx 1024, `-fa off --no-repack`, `--threads 1`.",
        "Vulkan cards: Mesa's lavapipe (llvmpipe) listed twice; CPU cards: the CPU build. Builds: "
        f"`{dirs['vulkan']}`, `{dirs['cpu']}`. min / median / max:", "",
        "| group | time to ready (s) | first request, incl. pipeline compile (s) | decode (t/s) |",
        "|---|---|---|---|",
    ]
    for backend, rs in results.items():
        lines.append(f"| {backend} hybrid | {spread([r['ready'] for r in rs])} | {spread([r['first'] for r in rs])} "
                     f"| {spread([r['rate'] for r in rs], 2)} |")
    lines += ["", f"Greedy tokens ({a.n_predict}), every run of both groups equal to the CPU group's first: "
              f"**{'yes' if equal else 'NO'}**.", ""]
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
