"""What llama-server's host-memory prompt cache sends over the RPC link: bytes per rpc-server, cache on and off.

    python bench/prompt_cache_link.py [--parallel 1,4] [--out FILE]

Why this figure: llama-server (`--cache-ram`, 8 GiB by default in the pinned tree, with `--cache-idle-slots`)
copies a slot's KV cache out to host memory when a different prompt takes the slot or a new task arrives while
other slots sit idle, and copies a cached one back when its prompt returns; on an RPC route the KV of every
rpc-server's layers crosses the link for that. Counted here, hardware-independently, off the rpc-servers' own
logs (GGML_RPC_DEBUG): an all-RPC group on two CPU cards serves a small synthetic llama three prompts (A, B, A;
`cache_prompt` false, n_predict 4), once with llama.cpp's default and once with `--cache-ram 0`, per `-np`.
A row is what each rpc-server received and answered over the whole run (model load included, which is the same
in both rows). Byte counts, not timings: one run. Writes bench/results/prompt_cache_link.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import arcsplit  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.synth import write_llama  # noqa: E402
from throughput import build_line  # noqa: E402
from _report import write_report  # noqa: E402

PROMPTS = ("Once upon a time there was a keeper of lighthouses " * 8, "In a land far away a dragon slept " * 8)
GET = re.compile(r"\[get_tensor\].*size: (\d+)")
SET = re.compile(r"\[set_tensor\].*size: (\d+)")


def traffic(model: Path, parallel: int, cache_ram: bool, llama_dir: str | None) -> dict[str, tuple[int, int, int]]:
    """Per rpc-server: (GET_TENSOR count, bytes answered, SET_TENSOR bytes received)."""
    extra = () if cache_ram else ("--cache-ram", "0")
    os.environ["GGML_RPC_DEBUG"] = "1"
    try:
        with arcsplit.serve(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=2048, parallel=parallel,
                            threads=1, port=free_port(), bus=False, extra_args=extra, llama_dir=llama_dir) as server:
            for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[0]):
                httpx.post(f"{server.url}/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0,
                                                              "cache_prompt": False}, timeout=300).raise_for_status()
            run_dir = Path(server.status()["run_dir"])
    finally:
        os.environ.pop("GGML_RPC_DEBUG", None)
    out = {}
    for name in ("rpc0", "rpc1"):  # read once the group has stopped: every line written
        log = (run_dir / f"{name}.log").read_text(errors="replace")
        gets = [int(m.group(1)) for m in GET.finditer(log)]
        out[name] = (len(gets), sum(gets), sum(int(m.group(1)) for m in SET.finditer(log)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", default="1,4", help="llama-server -np values, comma-separated")
    ap.add_argument("--llama-dir")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_cache_link.md"))
    a = ap.parse_args()
    lines = ["# What llama-server's prompt cache sends over the RPC link (CPU, hardware-independent)", "",
             f"- Build: {build_line(a.llama_dir, 'cpu')}",
             f"- Command: `{shlex.join(['python', 'bench/prompt_cache_link.py', *sys.argv[1:]])}`",
             "- An all-RPC group on two CPU cards (arcsplit serve --mode rpc), a synthetic llama (8 layers, n_embd 256, "
             "2 KV heads, n_vocab 512), prompts A, B, A (about 310 / 200 / 310 tokens, cache_prompt false, n_predict "
             "4). Counts from each rpc-server's GGML_RPC_DEBUG log over the whole run, model load included (equal in "
             "both rows of a pair).", "",
             "| -np | llama-server | rpc-server | GET_TENSOR answered | bytes answered | SET_TENSOR bytes received |",
             "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="prompt-cache-") as tmp:
        model = write_llama(Path(tmp) / "llama.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            n_vocab=512)
        for parallel in (int(p) for p in a.parallel.split(",")):
            for cache_ram in (True, False):
                label = "default (`--cache-ram` 8192)" if cache_ram else "`--cache-ram 0`"
                for name, (n, got, sent) in traffic(model, parallel, cache_ram, a.llama_dir).items():
                    lines.append(f"| {parallel} | {label} | {name} | {n} | {got:,} | {sent:,} |")
                    print(lines[-1], flush=True)
    lines += ["", "The GETs and bytes the default row has over the `--cache-ram 0` row are the prompt cache's copies "
              "of the KV out of the rpc-servers; the extra SET bytes, its copies back in.", ""]
    write_report(a.out, "\n".join(lines))


if __name__ == "__main__":
    main()
