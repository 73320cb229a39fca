"""Decode speed with MoE experts in host RAM (--moe-offload N -> llama-server --n-cpu-moe N) on CPU cards.

    python bench/moe_offload.py [--reps N] [--n-predict N] [--threads N] [--out FILE]
    python bench/moe_offload.py --backend cuda --gpus 0 [--layers 16 --n-embd 2048]   (one GPU, mode single)
    python bench/moe_offload.py --backend cuda --gpus 0 --model MOE.gguf --layers 16 --prompt-tokens 512 --by-hand

A synthetic Qwen3-MoE (f16, real random weights: 8 layers, 32 experts of 512, 4 used) is served with
``arcsplit.serve`` on two CPU cards (rpc-servers) with the routed experts of 0, 4 and all 8 layers kept on
llama-server's own CPU. Per setting: decode t/s (``timings.predicted_per_second`` of a /completion with
n_predict tokens, eos ignored; min/median/max over --reps after one warm-up), the planner's bytes read from host
RAM per token, and whether the greedy tokens equal the run with no offload. On CPU cards the "host" and the
"cards" are the same memory, so this measures the mechanism (and that nothing is lost), not a GPU's gain.
Writes bench/results/moe_offload.md. With ``--backend cuda`` one llama-server holds the GPU (mode single) and the
routed experts of 0, half and all layers go to its CPU: what offload costs a real card. ``--prompt-tokens N``
adds prefill t/s of an N-token prompt; ``--by-hand`` adds llama.cpp's own ``--n-cpu-moe N`` on a llama-server
started without arcsplit (``-ngl 999 -fa on``), same model and card, so arcsplit's rows can be read against it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit import synth  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from _proc import stop  # noqa: E402  (bench/ is sys.path[0] when run as a script)

MiB = 1024 * 1024


def completion(url: str, n: int, prompt: Any = "a b c d") -> dict:
    r = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "ignore_eos": True, "cache_prompt": False, "return_tokens": True},
                   timeout=600)
    r.raise_for_status()
    return r.json()


def long_prompt(url: str, n: int) -> list[int]:
    """``n`` token ids of ordinary text, through the model's own tokenizer (the prefill figure's prompt)."""
    text = " ".join(f"In the year {1500 + i} the council met about the price of grain and the bridges." for i in
                    range(n))
    toks = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]
    return toks[:n]


@dataclass(frozen=True)
class Row:
    how: str  # "arcsplit --moe-offload N" or "llama-server --n-cpu-moe N"
    n: int
    host_mib: float | None
    read_mib: float | None
    decode: tuple[float, ...]
    prefill: tuple[float, ...]
    same: bool
    argv: tuple[str, ...] = ()  # llama-server's command line
    tokens: tuple[int, ...] = ()  # greedy tokens
    same_n: bool | None = None  # greedy tokens equal to the other kind's at the same N (--by-hand)


def measure(url: str, args: argparse.Namespace) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, decode t/s and prefill t/s (a --prompt-tokens prompt, n_predict 1) over --reps after a
    warm-up of each."""
    tokens = completion(url, args.n_predict)["tokens"]
    decode = [completion(url, args.n_predict)["timings"]["predicted_per_second"] for _ in range(args.reps)]
    prefill: list[float] = []
    if args.prompt_tokens:
        prompt = long_prompt(url, args.prompt_tokens)
        completion(url, 1, prompt)
        prefill = [completion(url, 1, prompt)["timings"]["prompt_per_second"] for _ in range(args.reps)]
    return tokens, decode, prefill


def by_hand(model: Path, n: int, args: argparse.Namespace) -> tuple[Row, list[int]]:
    """llama.cpp's own --n-cpu-moe, typed by hand: one llama-server on the card, every layer on it, no arcsplit."""
    bins = find_llama(args.llama_dir, backend=args.backend)
    port = free_port()
    argv = [str(bins.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-ngl", "999",
            "-c", str(args.ctx), "-fa", "on", "--n-cpu-moe", str(n), *args.extra.split()]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.gpus}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"llama-server --n-cpu-moe {n} exited: {log.read()[-2000:].decode()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit(f"llama-server --n-cpu-moe {n}: no /health in 300 s")
                time.sleep(0.2)
            tokens, decode, prefill = measure(url, args)
        finally:
            stop(proc, grace=30)
    return Row(f"llama-server --n-cpu-moe {n}", n, None, None, tuple(decode), tuple(prefill), False,
               tuple(argv)), tokens


def through_arcsplit(model: Path, n: int, args: argparse.Namespace) -> tuple[Row, list[int]]:
    cpu = args.backend == "cpu"
    gpus = [int(g) for g in args.gpus.split(",")]
    extra = (("--no-repack",) if cpu else ()) + tuple(args.extra.split())
    with arcsplit.serve(model, gpus=gpus, backend=args.backend, mode="rpc" if cpu else "single", ctx=args.ctx,
                        threads=args.threads if cpu else None, port=free_port(), llama_dir=args.llama_dir,
                        cpu_memory_mib=2048 if cpu else None, moe_offload=n, host_memory_mib=args.host_mib,
                        extra_args=extra) as srv:
        tokens, decode, prefill = measure(srv.url, args)
        plan = srv.plan
        argv = next((p.get("argv", []) for name, p in srv.status()["processes"].items() if name == "server"), [])
        return Row(f"arcsplit --moe-offload {n}", n, plan.host_expert_bytes / MiB, plan.host_read_per_token / MiB,
                   tuple(decode), tuple(prefill), False, tuple(argv)), tokens


def cell(xs: tuple[float, ...]) -> str:
    return f"{min(xs):.1f} / **{statistics.median(xs):.1f}** / {max(xs):.1f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="cpu", help="cpu: two CPU cards, all-RPC; a GPU backend: mode single")
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--model", default=None, help="a MoE GGUF to serve instead of the synthetic one (its layer "
                                                  "count is --layers)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="also prefill t/s of a prompt this long (0: none)")
    ap.add_argument("--by-hand", action="store_true",
                    help="also llama.cpp's own --n-cpu-moe, llama-server started by hand with -ngl 999 (GPU)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--host-mib", type=int, default=16384, help="host RAM arcsplit may plan for experts")
    ap.add_argument("--llama-dir", default=None)
    ap.add_argument("--extra", default="", help="llama-server flags appended (e.g. '-fa off')")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_offload.md"))
    args = ap.parse_args()
    rows: list[Row] = []
    cpu = args.backend == "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        e = args.n_embd
        model = Path(args.model) if args.model else synth.write_qwen3moe(
            Path(tmp) / "moe.gguf", n_layer=args.layers, n_embd=e, n_head=e // 64, n_head_kv=max(1, e // 256),
            head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=512, n_vocab=4000, seed=7)
        ref = None
        for n in (0, args.layers // 2, args.layers):
            kinds = [through_arcsplit] + ([by_hand] if args.by_hand and not cpu else [])
            for kind in kinds:
                row, tokens = kind(model, n, args)
                ref = tokens if ref is None else ref
                twin = next((r for r in rows if r.n == n), None)  # the other kind at this N
                row = dataclasses.replace(row, same=tokens == ref, tokens=tuple(tokens),
                                          same_n=None if twin is None else tuple(tokens) == twin.tokens)
                if twin is not None:
                    rows[rows.index(twin)] = dataclasses.replace(twin, same_n=row.same_n)
                rows.append(row)
                print(f"{row.how}: decode t/s {cell(row.decode)}, prefill t/s {cell(row.prefill)}, "
                      f"greedy equal: {row.same}", flush=True)
    cmd = "`" + shlex.join(["python", "bench/moe_offload.py", *sys.argv[1:]]) + "`: "
    model_desc = (f"`{args.model}`" if args.model else
                  f"synthetic Qwen3-MoE f16 ({args.layers} layers, 32 experts of 512, 4 used, n_embd {e})")
    if cpu:
        lines = ["# MoE expert offload on CPU cards", "", cmd + model_desc + ", two CPU rpc-server cards, "
                 "all-RPC mode, decode of n_predict tokens after one warm-up. CPU cards share the host's memory, so "
                 "this shows the mechanism and its correctness, not a GPU's gain; experts on llama-server's CPU run on "
                 "its own threads (llama.cpp's default) while each rpc-server runs --threads, which is why offload is "
                 "not slower here. Machine: 2 shared cores, loaded by other jobs: spread is wide.", ""]
    else:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().replace("\n", "; ")
        lines = [f"# MoE expert offload on a GPU ({args.backend})", "", cmd + model_desc + f", one llama-server on "
                 f"GPU {args.gpus} (mode single), the routed experts of the first N layers on its CPU (--n-cpu-moe "
                 f"N); decode of n_predict tokens and prefill of a {args.prompt_tokens}-token prompt (n_predict 1), "
                 f"each after one warm-up, min / **median** / max over {args.reps} repetitions. `llama-server "
                 "--n-cpu-moe N` rows: llama.cpp by hand (`-ngl 999 -fa on`, the same -c), no arcsplit. "
                 f"GPU: {gpu}; {os.cpu_count()} CPU cores.", ""]
    pair = any(r.same_n is not None for r in rows)
    lines += ["| run | experts in host RAM MiB | read from host per token MiB | decode t/s | prefill t/s "
              "| greedy = first row |" + (" greedy = the other at this N |" if pair else ""),
              "|---|---|---|---|---|---|" + ("---|" if pair else "")]
    for r in rows:
        host = "-" if r.host_mib is None else f"{r.host_mib:.0f}"
        read = "-" if r.read_mib is None else f"{r.read_mib:.1f}"
        lines.append(f"| {r.how} | {host} | {read} | {cell(r.decode)} | {cell(r.prefill)} | "
                     f"{'yes' if r.same else 'NO'} |" + (f" {'-' if r.same_n is None else 'yes' if r.same_n else 'NO'} |"
                                                          if pair else ""))
    if pair:
        lines += ["", "Greedy = first row compares with no offload at all: experts computed on the CPU round "
                  "differently from the card's kernels, so on a random synthetic model a few argmax picks may flip. "
                  "Greedy = the other at this N compares arcsplit's row with llama.cpp's own at the same N: the "
                  "same split of work, so the same tokens are expected."]
    lines += ["", "llama-server's command line of each row:", ""]
    lines += [f"- {r.how}: `{shlex.join(r.argv)}`" for r in rows if r.argv]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # with --by-hand, arcsplit must match llama.cpp at each N; without, every row must match no offload (CPU cards)
    return 0 if all(r.same_n is not False for r in rows) and (pair or all(r.same for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
