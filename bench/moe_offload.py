"""Decode speed with MoE experts in host RAM (--moe-offload N -> llama-server --n-cpu-moe N) on CPU cards.

    python bench/moe_offload.py [--reps N] [--n-predict N] [--threads N] [--out FILE]

A synthetic Qwen3-MoE (f16, real random weights: 8 layers, 32 experts of 512, 4 used) is served with
``arcsplit.serve`` on two CPU cards (rpc-servers) with the routed experts of 0, 4 and all 8 layers kept on
llama-server's own CPU. Per setting: decode t/s (``timings.predicted_per_second`` of a /completion with
n_predict tokens, eos ignored; min/median/max over --reps after one warm-up), the planner's bytes read from host
RAM per token, and whether the greedy tokens equal the run with no offload. On CPU cards the "host" and the
"cards" are the same memory, so this measures the mechanism (and that nothing is lost), not a GPU's gain.
Writes bench/results/moe_offload.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit import synth  # noqa: E402
from arcsplit.run.ports import free_port  # noqa: E402

MiB = 1024 * 1024


def completion(url: str, n: int) -> dict:
    r = httpx.post(f"{url}/completion", json={"prompt": "a b c d", "n_predict": n, "temperature": 0, "top_k": 1,
                                              "ignore_eos": True, "cache_prompt": False, "return_tokens": True},
                   timeout=600)
    r.raise_for_status()
    return r.json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_offload.md"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = synth.write_qwen3moe(Path(tmp) / "moe.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=2,
                                     head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=512, n_vocab=4000, seed=7)
        ref = None
        for n in (0, 4, 8):
            with arcsplit.serve(model, gpus=[0, 1], backend="cpu", ctx=1024, threads=args.threads, port=free_port(),
                                cpu_memory_mib=2048, moe_offload=n, host_memory_mib=4096,
                                extra_args=("--no-repack",)) as srv:
                tokens = completion(srv.url, args.n_predict)["tokens"]
                speeds = [completion(srv.url, args.n_predict)["timings"]["predicted_per_second"]
                          for _ in range(args.reps)]
                ref = tokens if ref is None else ref
                plan = srv.plan
                rows.append((n, plan.host_expert_bytes / MiB, plan.host_read_per_token / MiB, min(speeds),
                             statistics.median(speeds), max(speeds), tokens == ref))
                print(f"--n-cpu-moe {n}: experts in host RAM {rows[-1][1]:.0f} MiB, read/token {rows[-1][2]:.1f} MiB, "
                      f"decode t/s min/median/max {min(speeds):.1f}/{statistics.median(speeds):.1f}/{max(speeds):.1f}, "
                      f"greedy equal: {tokens == ref}", flush=True)
    lines = ["# MoE expert offload on CPU cards", "",
             f"`python bench/moe_offload.py --reps {args.reps} --n-predict {args.n_predict} --threads {args.threads}`: "
             "synthetic Qwen3-MoE f16 (8 layers, 32 experts of 512, 4 used, n_embd 512), two CPU rpc-server cards, "
             "all-RPC mode, decode of n_predict tokens after one warm-up. CPU cards share the host's memory, so "
             "this shows the mechanism and its correctness, not a GPU's gain; experts on llama-server's CPU run on its own "
             "threads (llama.cpp's default) while each rpc-server runs --threads, which is why offload is not slower "
             "here. Machine: 2 shared cores, loaded by other jobs: spread is wide.", "",
             "| --moe-offload | experts in host RAM MiB | read from host per token MiB | decode t/s min / median / max "
             "| greedy = no offload |", "|---|---|---|---|---|"]
    for n, host, read, lo, med, hi, same in rows:
        lines.append(f"| {n} | {host:.0f} | {read:.1f} | {lo:.1f} / {med:.1f} / {hi:.1f} | {'yes' if same else 'NO'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
