"""How often each process blocks per decoded token on the RPC routes, with arcsplit's llama.cpp patch and without.

    python bench/rpc_waits.py [--modes hybrid,rpc] [--tokens 64] [--reps 3] [--spin-us N] [--out FILE]

Why this figure: the patch (docs/patches.md) removes waits, not work. Its effect on a GPU pair is tokens/s, but
tokens/s on the 2-core CPU machine is dominated by compute and by the cores being shared, so the mechanism is
measured directly and hardware-independently: voluntary context switches (a thread going to sleep to wait:
a futex hand-off to the RPC dispatcher, a blocking socket read) per decoded token, summed over every thread of
llama-server and of each rpc-server (/proc/PID/task/*/status), during a greedy decode of N tokens. Both rows of a
mode run the same build; "stock" sets ARCSPLIT_RPC_STOCK=1 in every process, which switches the patch off.
With --spin-us N a third row per mode also sets ARCSPLIT_RPC_SPIN_US=N (patch 0005: the link's threads poll up
to N microseconds before they sleep; arcsplit sets it on GPU groups, not on the CPU backend): the waits it removes
are the ones that row no longer has. Writes bench/results/rpc_waits.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import arcsplit  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.patches import rpc_link_polling, rpc_patches_switched  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.llama.patches import build_patches  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from throughput import build_line  # noqa: E402
from _report import write_report  # noqa: E402  (bench/ is sys.path[0] when run as a script)

PROMPT = "Once upon a time"


def voluntary_switches(pid: int) -> int:
    """Sum over every thread of a process; a thread that ended in between is simply not counted."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split(":")[1])
        except OSError:
            continue
    return total


def measure(model: str, mode: str, stock: bool, tokens: int, reps: int, spin_us: int = 0) -> dict[str, list[float]]:
    """Per process: voluntary switches per decoded token, one value per repetition (plus 'tok/s')."""
    with rpc_patches_switched(on=not stock), (rpc_link_polling(spin_us) if spin_us else contextlib.nullcontext()), \
            arcsplit.serve(model, gpus=[0, 1], backend="cpu", mode=mode, ctx=2048, parallel=1, threads=1,
                           port=free_port(), bus=False) as server, httpx.Client(timeout=300) as client:
        pids = {name: p["pid"] for name, p in server.status()["processes"].items()}
        body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
        client.post(f"{server.url}/completion", json=body).raise_for_status()  # warm-up
        out: dict[str, list[float]] = {name: [] for name in pids} | {"tok/s": []}
        for _ in range(reps):
            before = {name: voluntary_switches(pid) for name, pid in pids.items()}
            r = client.post(f"{server.url}/completion", json=body)
            r.raise_for_status()
            after = {name: voluntary_switches(pid) for name, pid in pids.items()}
            timings = r.json()["timings"]
            n = int(timings["predicted_n"])
            for name in pids:
                out[name].append((after[name] - before[name]) / n)
            out["tok/s"].append(float(timings["predicted_per_second"]))
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo Gemma 3 270M)")
    ap.add_argument("--modes", default="hybrid,rpc")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spin-us", type=int, default=0, help="also a row with ARCSPLIT_RPC_SPIN_US=N (patch 0005)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rpc_waits.md"))
    a = ap.parse_args(argv)
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    lines = ["# Blocking waits per decoded token on the RPC routes, stock vs arcsplit's patches", "",
             f"- Build: {build_line(None, 'cpu')}; arcsplit patches: "
             f"{', '.join(build_patches(find_llama(None, backend='cpu').bin_dir) or []) or 'none'}; "
             "stock rows switch them off with ARCSPLIT_RPC_STOCK=1 (same build, same run)",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Model: `{a.model}`; 2 CPU cards, ctx 2048, -np 1, 1 thread per process; greedy decode of "
             f"{a.tokens} tokens after a warm-up; medians of {a.reps} repetitions",
             f"- Command: `{shlex.join(['python', 'bench/rpc_waits.py', *(sys.argv[1:] if argv is None else argv)])}`",
             "- Figure: voluntary context switches per decoded token, every thread of the process "
             "(a thread sleeping to wait for another thread or for the socket)", "",
             "| mode | patch | llama-server | rpc0 | rpc1 | all processes | tok/s (noisy on 2 shared cores) |",
             "|---|---|---|---|---|---|---|"]
    summary = []
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        totals = {}
        rows = [(True, 0, "stock"), (False, 0, "patched")]
        if a.spin_us:
            rows.append((False, a.spin_us, f"patched, spin {a.spin_us} us"))
        for stock, spin, label in rows:
            print(f"{mode} {label} ...", flush=True)
            got = measure(a.model, mode, stock, a.tokens, a.reps, spin)
            med = {k: statistics.median(v) for k, v in got.items()}
            procs = [k for k in med if k != "tok/s"]
            totals[label] = sum(med[k] for k in procs)
            cell = {k: f"{med[k]:.1f}" for k in procs}
            lines.append(f"| {mode} | {label} | {cell.get('server', '-')} | {cell.get('rpc0', '-')} | "
                         f"{cell.get('rpc1', '-')} | {totals[label]:.1f} | {med['tok/s']:.1f} |")
        cut = 1 - totals["patched"] / totals["stock"] if totals["stock"] else 0.0
        summary.append(f"{mode}: {totals['stock']:.1f} -> {totals['patched']:.1f} waits per token ({cut:.0%} fewer)"
                       + (f", {totals[rows[2][2]]:.1f} polling" if a.spin_us else ""))
    lines += ["", "Result: " + "; ".join(summary) + ".", ""]
    text = "\n".join(lines)
    write_report(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
