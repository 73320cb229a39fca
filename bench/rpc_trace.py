"""What crosses the RPC link per decoded token: messages and bytes per command, per rpc-server, per route.

    python bench/rpc_trace.py [--modes hybrid,rpc] [--tokens 32] [--model PATH] [--extra ARGS] [--out FILE]

The first half of "where does the remaining time go" that needs no GPU: llama.cpp's rpc-server logs every command
it serves when GGML_RPC_DEBUG is set (set_tensor with its size, get_tensor with its size, graph_compute,
graph_recompute, ...). This serves each route on the CPU build with that variable set, decodes --tokens tokens
greedily after a warm-up, and counts the log lines each rpc-server wrote during that decode: messages per token
by command and payload bytes per token (set_tensor / get_tensor sizes). The counts depend on the graph split,
not on the card, so they hold for a GPU group of the same model and split; the waits and the GPU's idle gaps do
not (no GPU here). Patches on (the build's default) and off (ARCSPLIT_RPC_STOCK=1) in the same run; --extra adds
a row per mode with patches on and those llama-server flags appended (`--extra=--backend-sampling`: with
"=", as the value starts with a dash).
Writes bench/results/rpc_trace.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import arcsplit  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.patches import rpc_patches_switched  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from throughput import build_line  # noqa: E402
from _report import write_report  # noqa: E402  (bench/ is sys.path[0] when run as a script)

PROMPT = "Once upon a time"
LINE = re.compile(r"^\[(\w+)\](.*)$")
SIZE = re.compile(r"size: (\d+)")


def count(text: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Messages per command and bytes per command (set_tensor / get_tensor payloads) in a stretch of log."""
    msgs: collections.Counter[str] = collections.Counter()
    nbytes: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if m := LINE.match(line.strip()):
            msgs[m.group(1)] += 1
            if m.group(1) in ("set_tensor", "get_tensor") and (s := SIZE.search(m.group(2))):
                nbytes[m.group(1)] += int(s.group(1))
    return msgs, nbytes


def measure(model: str, mode: str, stock: bool, tokens: int,
            extra: tuple[str, ...] = ()) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per rpc-server: (messages per token by command, bytes per token by command) during one greedy decode."""
    os.environ["GGML_RPC_DEBUG"] = "1"
    try:
        with rpc_patches_switched(on=not stock), \
                arcsplit.serve(model, gpus=[0, 1], backend="cpu", mode=mode, ctx=2048, parallel=1, threads=1,
                               port=free_port(), bus=False, extra_args=extra) as server, httpx.Client(timeout=300) as client:
            run_dir = Path(server.status()["run_dir"])
            names = [n for n, p in server.status()["processes"].items() if p["role"] == "rpc"]
            body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
            client.post(f"{server.url}/completion", json=body).raise_for_status()  # warm-up
            start = {n: (run_dir / f"{n}.log").stat().st_size for n in names}
            r = client.post(f"{server.url}/completion", json=body)
            r.raise_for_status()
            n_tok = int(r.json()["timings"]["predicted_n"]) + 1  # the prompt's own step is in the same request
            out = {}
            for n in names:
                with open(run_dir / f"{n}.log", "rb") as fh:
                    fh.seek(start[n])
                    msgs, nbytes = count(fh.read().decode(errors="replace"))
                out[n] = ({k: v / n_tok for k, v in msgs.items()}, {k: v / n_tok for k, v in nbytes.items()})
            return out
    finally:
        os.environ.pop("GGML_RPC_DEBUG", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo Gemma 3 270M)")
    ap.add_argument("--modes", default="hybrid,rpc")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--extra", default="", help="llama-server flags for one more row per mode (patches on)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rpc_trace.md"))
    a = ap.parse_args(argv)
    extra = tuple(shlex.split(a.extra))
    if a.tokens < 1:
        ap.error("--tokens must be at least 1")
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    lines = ["# Messages and bytes over the RPC link per decoded token (rpc-server's own log, GGML_RPC_DEBUG)", "",
             f"- Build: {build_line(None, 'cpu')}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Model: `{a.model}`; 2 CPU cards, ctx 2048, -np 1; one greedy decode of {a.tokens} tokens after a "
             "warm-up; per token = over the request's steps (prompt step included)",
             f"- Command: `{shlex.join(['python', 'bench/rpc_trace.py', *(sys.argv[1:] if argv is None else argv)])}`",
             "", "| mode | patches | rpc-server | messages per token, by command | set_tensor B/token | "
             "get_tensor B/token |", "|---|---|---|---|---|---|"]
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        for stock, flags in ((True, ()), (False, ()), *(((False, extra),) if extra else ())):
            label = "off (stock)" if stock else "on" + (f", `{shlex.join(flags)}`" if flags else "")
            print(f"{mode} {label} ...", flush=True)
            for name, (msgs, nbytes) in measure(a.model, mode, stock, a.tokens, flags).items():
                cmds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(msgs.items(), key=lambda kv: -kv[1]))
                lines.append(f"| {mode} | {label} | {name} | {cmds or '-'} | "
                             f"{nbytes.get('set_tensor', 0):.0f} | {nbytes.get('get_tensor', 0):.0f} |")
    lines += ["", "Events, synchronisations and the dispatcher's own messages are not logged by the rpc-server, "
              "so they are not in these counts; neither are waits or GPU idle time (no GPU here).", ""]
    text = "\n".join(lines)
    write_report(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
