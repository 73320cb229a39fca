"""Decode speed with MoE experts in host RAM (--moe-offload N -> llama-server --n-cpu-moe N) on CPU cards.

    python bench/moe_offload.py [--reps N] [--n-predict N] [--threads N] [--out FILE]
    python bench/moe_offload.py --backend cuda --gpus 0 [--layers 16 --n-embd 2048]   (one GPU, mode single)

A synthetic Qwen3-MoE (f16, real random weights: 8 layers, 32 experts of 512, 4 used) is served with
``arcsplit.serve`` on two CPU cards (rpc-servers) with the routed experts of 0, 4 and all 8 layers kept on
llama-server's own CPU. Per setting: decode t/s (``timings.predicted_per_second`` of a /completion with
n_predict tokens, eos ignored; min/median/max over --reps after one warm-up), the planner's bytes read from host
RAM per token, and whether the greedy tokens equal the run with no offload. On CPU cards the "host" and the
"cards" are the same memory, so this measures the mechanism (and that nothing is lost), not a GPU's gain.
Writes bench/results/moe_offload.md. With ``--backend cuda`` one llama-server holds the GPU (mode single) and the
routed experts of 0, half and all layers go to its CPU: what offload costs a real card.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit import synth  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

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
    ap.add_argument("--backend", default="cpu", help="cpu: two CPU cards, all-RPC; a GPU backend: mode single")
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--extra", default="", help="llama-server flags appended (e.g. '-fa off')")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_offload.md"))
    args = ap.parse_args()
    rows = []
    cpu = args.backend == "cpu"
    gpus = [int(g) for g in args.gpus.split(",")]
    extra = (("--no-repack",) if cpu else ()) + tuple(args.extra.split())
    with tempfile.TemporaryDirectory() as tmp:
        e = args.n_embd
        model = synth.write_qwen3moe(Path(tmp) / "moe.gguf", n_layer=args.layers, n_embd=e, n_head=e // 64,
                                     n_head_kv=max(1, e // 256), head_dim=64, n_expert=32, n_expert_used=4,
                                     n_ff_exp=512, n_vocab=4000, seed=7)
        ref = None
        for n in (0, args.layers // 2, args.layers):
            with arcsplit.serve(model, gpus=gpus, backend=args.backend, mode="rpc" if cpu else "single", ctx=1024,
                                threads=args.threads if cpu else None, port=free_port(),
                                cpu_memory_mib=2048 if cpu else None, moe_offload=n, host_memory_mib=16384,
                                extra_args=extra) as srv:
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
    cmd = (f"`python bench/moe_offload.py --reps {args.reps} --n-predict {args.n_predict} --threads {args.threads}"
           + ("" if cpu else f" --backend {args.backend} --gpus {args.gpus}")
           + (f" --layers {args.layers} --n-embd {e}" if (args.layers, e) != (8, 512) else "")
           + (f" --extra '{args.extra}'" if args.extra else "") + "`: ")
    model_desc = f"synthetic Qwen3-MoE f16 ({args.layers} layers, 32 experts of 512, 4 used, n_embd {e})"
    if cpu:
        lines = ["# MoE expert offload on CPU cards", "", cmd + model_desc + ", two CPU rpc-server cards, "
                 "all-RPC mode, decode of n_predict tokens after one warm-up. CPU cards share the host's memory, so "
                 "this shows the mechanism and its correctness, not a GPU's gain; experts on llama-server's CPU run on "
                 "its own threads (llama.cpp's default) while each rpc-server runs --threads, which is why offload is "
                 "not slower here. Machine: 2 shared cores, loaded by other jobs: spread is wide.", ""]
    else:
        import subprocess

        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().replace("\n", "; ")
        lines = [f"# MoE expert offload on a GPU ({args.backend})", "", cmd + model_desc + f", one llama-server on "
                 f"GPU {args.gpus} (mode single), the routed experts of the first N layers on its CPU (--n-cpu-moe "
                 f"N), decode of n_predict tokens after one warm-up. GPU: {gpu}; {os.cpu_count()} CPU cores.", ""]
    lines += [
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
