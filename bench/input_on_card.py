"""Patch 0015 across a link: the token embeddings on the first card of another host against on llama-server here.

    sudo python bench/input_on_card.py [--runs 3] [--reps 5] [--mbit 100] [--prompt 512] [--out FILE]

Host b is a Linux network namespace joined by a veth pair (tests/_netns.py), both its directions shaped to --mbit
by `tc tbf` (0: unshaped). Every card of the group is on b (two CPU cards, mode rpc, link = "direct": llama-server
dials b's rpc-servers over the veth), so llama-server here holds no card and a prompt crosses to b's first card:
as embedding rows (n_embd x 4 bytes a token) with the embeddings on llama-server (ARCSPLIT_INPUT_ON_CARD=0, llama.cpp's
place), or as token ids (4 bytes a token) with them on that card (arcsplit's auto for this layout). Per request: the
bytes this machine sent to b (the veth's counter) and the time to first token on the client's clock (a --prompt-token
prompt of token ids, cache_prompt false, n_predict 1), --reps per run after a warm-up; --runs runs, the two cases
alternating, a fresh group each; greedy tokens compared. Writes bench/results/input_on_card_link.md.

Both "hosts" share this machine's 2 cores, so b's compute is this machine's: the link's share of a first token is
larger on GPUs (a 512-token prompt in 25-30 ms on one H100) than here, which is why the link is shaped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _netns import NetHarness, unavailable  # noqa: E402
from _report import write_report  # noqa: E402
from loadgen import Served  # noqa: E402
from throughput import build_line, machine  # noqa: E402

from arcsplit.llama.patches import rpc_input_on_card  # noqa: E402

CASES = {"on llama-server (ARCSPLIT_INPUT_ON_CARD=0)": False, "on b's first card (auto)": True}


def model_path() -> Path:
    """A synthetic F16 llama, 1024 wide with a 32k vocabulary (embeddings 4 KiB a token as F32 rows), six thin
    layers, so that 2 cores prefill 512 tokens in well under a second and each card holds layers either way (a
    boundary between them, whose activations llama-server relays, in both cases); written once under arcsplit's
    cache."""
    from arcsplit._dirs import cache_dir
    from arcsplit.synth import write_llama

    path = cache_dir() / "models" / "bench-llama-6l-1024w-f16.gguf"
    if not path.exists():
        tmp = path.with_suffix(".partial.gguf")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_llama(tmp, n_layer=6, n_embd=1024, n_head=8, n_head_kv=2, n_ff=1024, n_vocab=32000, ctx=4096,
                    reuse_random=True)
        tmp.rename(path)
    return path


@contextlib.contextmanager
def shaped(net: NetHarness, mbit: float) -> Iterator[None]:
    """Both directions of b's veth at ``mbit`` Mbit/s (tc tbf), removed on the way out."""
    if mbit <= 0:
        yield
        return
    h = net.host("b")
    rate = ["rate", f"{mbit}mbit", "burst", "256kb", "latency", "500ms"]
    here = ["tc", "qdisc", "add", "dev", h.veth, "root", "tbf", *rate]
    there = ["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.peer, "root", "tbf", *rate]
    subprocess.run(here, check=True)
    try:
        subprocess.run(there, check=True)
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", h.veth, "root"], capture_output=True)
        subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", h.peer, "root"], capture_output=True)


def ids(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 101) % 31000 + 5 for i in range(n)]


def one_run(a: argparse.Namespace, net: NetHarness, tmp: Path, run: int, on: bool) -> dict[str, list]:
    layout = net.layout(tmp / f"layout-{run}-{int(on)}.toml", [("b", 1024), ("b", 1024)], link="direct",
                        name="every card on b")
    base = tmp / f"served-{run}-{int(on)}"
    base.mkdir()
    s = Served(Path(a.model), ctx=2048, parallel=1, layout=layout, base=base, cache=tmp / "cache",
               extra_serve=("--mode", "rpc", "--threads", "1"))
    with rpc_input_on_card(on):  # serve reads the user's ARCSPLIT_INPUT_ON_CARD when it plans
        s.start()
    out: dict[str, list] = {"bytes": [], "ttft": [], "greedy": [], "split": []}
    try:
        s.wait_ready(600)
        server = s.children().get("server")
        argv = server.cmdline() if server is not None else []
        out["split"] = [argv[argv.index("-ts") + 1] if "-ts" in argv else "?"]
        with httpx.Client(timeout=a.timeout) as client:
            for rep in range(a.reps + 1):  # 0: warm-up (a new shape reserves compute buffers)
                sent, t0 = net.sent_to("b"), time.perf_counter()
                r = client.post(f"{s.url}/completion", json={"prompt": ids(a.prompt, run * 100 + rep), "n_predict": 1,
                                                             "cache_prompt": False, "temperature": 0})
                r.raise_for_status()
                dt, nbytes = (time.perf_counter() - t0) * 1000, net.sent_to("b") - sent
                if rep:
                    out["ttft"].append(dt)
                    out["bytes"].append(nbytes)
            r = client.post(f"{s.url}/completion", json={"prompt": ids(64, 7), "n_predict": 8, "temperature": 0,
                                                         "top_k": 1, "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            out["greedy"] = [int(t) for t in r.json()["tokens"]]
    finally:
        s.stop()
        s.cleanup()
    return out


def mmm(xs: list[float], fmt: str = ".1f") -> str:
    return f"{min(xs):{fmt}} / **{statistics.median(xs):{fmt}}** / {max(xs):{fmt}}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mbit", type=float, default=100.0, help="the link's rate both ways (0: unshaped veth)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--model", default=None, help="GGUF (default: a synthetic 2048-wide llama, written once)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "input_on_card_link.md"))
    a = ap.parse_args(argv)
    if a.runs < 1 or a.reps < 1 or a.prompt < 1:
        ap.error("--runs, --reps and --prompt must be at least 1")
    why = unavailable()
    if why:
        raise SystemExit(f"input_on_card: {why}")
    a.model = a.model or str(model_path())
    from arcsplit.llama.locate import find_llama

    llama_dir = find_llama(None, backend="cpu").bin_dir
    os.environ["ARCSPLIT_LLAMA_DIR"] = str(llama_dir)  # Served gives every run a private cache dir: name the build
    got: dict[str, dict[str, list]] = {name: {"bytes": [], "ttft": [], "greedy": [], "split": []} for name in CASES}
    with tempfile.TemporaryDirectory(prefix="input-on-card-") as d, \
            NetHarness(Path(d) / "net", ("b",), llama_dir) as net, shaped(net, a.mbit):
        tmp = Path(d)
        for run in range(a.runs):
            order = list(CASES.items()) if run % 2 == 0 else list(CASES.items())[::-1]
            for name, on in order:
                r = one_run(a, net, tmp, run, on)
                got[name]["bytes"] += r["bytes"]
                got[name]["ttft"] += r["ttft"]
                got[name]["greedy"].append(r["greedy"])
                got[name]["split"] += r["split"]
                print(f"run {run + 1}, embeddings {name}: TTFT median {statistics.median(r['ttft']):.1f} ms, "
                      f"{statistics.median(r['bytes']):,.0f} bytes to b", flush=True)
    ref = got[next(iter(CASES))]["greedy"][0]
    rows = [f"| {name} | {', '.join(sorted(set(g['split'])))} | {mmm([float(b) for b in g['bytes']], ',.0f')} | "
            f"{mmm(g['ttft'])} | {'yes' if all(t == ref for t in g['greedy']) else '**no**'} |"
            for name, g in got.items()]
    host, card = (statistics.median(g["ttft"]) for g in got.values())
    link = f"shaped to {a.mbit:g} Mbit/s both ways (tc tbf)" if a.mbit > 0 else "unshaped"
    text = f"""# The token embeddings on another host's first card (patch 0015) against on llama-server

- Build: {build_line(None, 'cpu')}
- Machine: {machine('cpu')}
- Model: `{Path(a.model).name}`; every card on host b (a network namespace over a veth, {link}; link = "direct"),
  two CPU cards of 1 GiB in mode rpc, -t 1 each; llama-server here holds no card.
- Per request: a {a.prompt}-token prompt of token ids, cache_prompt false, n_predict 1: the bytes this machine sent to b
  (the veth's counter: every rpc-server's commands, the prompt's embeddings or ids among them) and the time to first
  token on the client's clock. {a.reps} requests per run after a warm-up, {a.runs} runs, the two cases alternating,
  a fresh group each; min / median / max over all requests.
- Command: `python bench/input_on_card.py --runs {a.runs} --reps {a.reps} --mbit {a.mbit:g} --prompt {a.prompt}`

| token embeddings | layers per card (-ts) | bytes sent to b per request | time to first token, ms | greedy tokens the same |
|---|---|---|---|---|
{chr(10).join(rows)}

Time to first token, embeddings on b's first card over on llama-server: **{card / host:.2f}** (medians). Both "hosts"
share this machine's 2 cores, so the prompt's compute is a CPU's; on GPUs the link's share of a first token is
larger (a 512-token prompt takes 25-30 ms on one H100), and on one machine the same move measured no gain
(docs/patches.md, 0015).
"""
    write_report(a.out, text)
    return 0 if all(t == ref for g in got.values() for t in g["greedy"]) else 1


if __name__ == "__main__":
    sys.exit(main())
