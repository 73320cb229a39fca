"""The plan's link costs against the bytes that really cross: each rpc-server behind a counting TCP relay.

    python bench/link_bytes.py [--model PATH] [--prompts 40,300,700] [--tokens 16] [--reps 3] [--out FILE]

`arcsplit plan --layout` with [[hosts]] predicts, per link to another host, the bytes per decoded token and per
prefill ubatch (activations, attention masks, logits) and the blocking round trips (planner.LinkCost). Here every
card is an rpc-server on this machine, so each one's socket carries exactly what its link would carry if its card
were alone on another host. The script serves the model on two CPU cards in rpc mode (arcsplit's own argv from
`planned_specs`), puts a relay that counts bytes in each direction in front of each rpc-server (llama-server
dials the relay), sends prompts of several lengths and decodes --tokens tokens, and compares the bytes and the
replies that follow a request (round trips) of each request with the plan's model for the same prompt length,
ubatch by ubatch. Wire bytes include RPC message headers and tensor descriptors, which the model leaves out.
Writes bench/results/link_bytes.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from arcsplit._api import planned_specs, preview  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.patches import rpc_shm_link  # noqa: E402
from arcsplit.planner import MASK_START, LinkCost, link_costs  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.decide.prepare import ServeRequest  # noqa: E402
from throughput import build_line, complete, long_prompt  # noqa: E402
from _report import write_report  # noqa: E402  (bench/ is sys.path[0] when run as a script)


class Relay:
    """127.0.0.1:port -> target, counting bytes each way and the replies that follow a request (a direction change
    from llama-server's side to the rpc-server's: one per blocking exchange)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.up = self.down = self.replies = 0
        self.last = "down"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def counts(self) -> tuple[int, int, int]:
        with self.lock:
            return self.up, self.down, self.replies

    def _accept(self) -> None:
        while True:
            client, _ = self.sock.accept()
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pumps = [threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True),
                     threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True)]
            for t in pumps:
                t.start()
            threading.Thread(target=self._close_after, args=(pumps, client, server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        """Copy one way until EOF, then pass the EOF on (as ssh -L does): the rpc-server then ends the connection
        and accepts the next client."""
        try:
            while data := src.recv(1 << 20):
                with self.lock:
                    if way == "up":
                        self.up += len(data)
                    else:
                        self.down += len(data)
                        self.replies += self.last == "up"
                    self.last = way
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _close_after(pumps: list[threading.Thread], *socks: socket.socket) -> None:
        for t in pumps:
            t.join()
        for sock in socks:
            sock.close()


def pad(n: int, to: int = MASK_START) -> int:
    return -(-n // to) * to


def predicted(lc: LinkCost, prompt_n: int, predicted_n: int) -> tuple[int, int]:
    """(bytes, blocking round trips) the plan's model gives for one request: the prompt in ubatches, then one step
    per decoded token but the last; n_kv is the cells in use after each step, padded to 256."""
    steps = []  # (tokens, cells in use, output rows)
    for start in range(0, prompt_n, lc.n_ubatch):
        end = min(prompt_n, start + lc.n_ubatch)
        steps.append((end - start, end, int(end == prompt_n)))
    steps += [(1, prompt_n + k + 1, 1) for k in range(max(0, predicted_n - 1))]
    nbytes = sum(t * (lc.act_bytes * lc.act_crossings + lc.mask_at(pad(used)))
                 + rows * (lc.act_bytes * lc.out_crossings + lc.logits_bytes) for t, used, rows in steps)
    return nbytes, sum(lc.gets + rows * lc.out_gets for _, _, rows in steps)


def wait_port(port: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port} after {timeout} s")


def run(model: str, prompts: list[int], tokens: int, reps: int, cpu_memory: int,
        log_path: Path | None = None) -> tuple[Any, list[dict[str, Any]]]:
    req = ServeRequest(model=model, gpus=[0, 1], backend="cpu", mode="rpc", ctx=2048, threads=1, port=free_port(),
                       cpu_memory_mib=cpu_memory)
    with rpc_shm_link(False):  # a link to another host is a socket: every byte crosses it (no shared memory, 0008)
        prepared = preview(req)
    plan = prepared.config.plan
    specs = planned_specs(prepared)
    # Each card as if alone on its own host: its link's model is its rpc-server's traffic.
    cards = tuple(dataclasses.replace(c, card=dataclasses.replace(c.card, host=f"h{j}")) for j, c in enumerate(plan.cards))
    import arcsplit.memory as memory
    from arcsplit.model import load_profile

    profile = load_profile(model)
    o = plan.options
    cs = memory.context_sizes(profile, plan.n_ctx, o.n_parallel, o.kv_unified, o.n_ubatch, o.swa_full)
    links = link_costs(profile, cards, (), o, cs)
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    try:
        relays = []
        for s in specs[:-1]:
            procs.append(subprocess.Popen(s.argv, env={**os.environ, **dict(s.env)}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            wait_port(s.port)
            relays.append(Relay((s.host, s.port)))
        server = specs[-1]
        argv = list(server.argv)
        argv[argv.index("--rpc") + 1] = ",".join(f"127.0.0.1:{r.port}" for r in relays)
        env = {**os.environ, **dict(server.env)}
        env.pop("LLAMA_SERVER_ROUTER_PORT", None)
        log = open(os.devnull if log_path is None else log_path, "wb")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        url = f"http://127.0.0.1:{server.port}"
        with httpx.Client(timeout=600) as client:
            end = time.monotonic() + 300
            while True:
                if procs[-1].poll() is not None or time.monotonic() > end:
                    raise SystemExit(f"llama-server did not come up (exit {procs[-1].poll()}); see {log_path}")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            complete(client, url, {"prompt": "Hello", "n_predict": 2})  # warm-up: first-use allocations
            for n in prompts:
                prompt = long_prompt(client, url, n)
                # Unmeasured first: a request of a new shape makes llama.cpp reserve its compute buffers again,
                # which asks each rpc-server the size of every tensor (dozens of one-off round trips).
                complete(client, url, {"prompt": prompt, "n_predict": tokens, "ignore_eos": True})
                for _ in range(reps):
                    before = [r.counts() for r in relays]
                    got = complete(client, url, {"prompt": prompt, "n_predict": tokens, "ignore_eos": True})
                    time.sleep(0.2)
                    after = [r.counts() for r in relays]
                    t = got["timings"]
                    for j, (lc, b, a) in enumerate(zip(links, before, after)):
                        want, trips = predicted(lc, int(t["prompt_n"]), int(t["predicted_n"]))
                        moved = (a[0] - b[0]) + (a[1] - b[1])
                        rows.append({"card": j, "prompt": int(t["prompt_n"]), "decoded": int(t["predicted_n"]),
                                     "bytes": moved, "predicted": want, "replies": a[2] - b[2], "trips": trips})
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return plan, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the chat demo model, SmolLM2 135M)")
    ap.add_argument("--prompts", default="40,300,700", help="prompt lengths in tokens")
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-memory", type=int, default=160, help="MiB per CPU card (small: layers on both cards)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "link_bytes.md"))
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.reps < 1:
        ap.error("--tokens and --reps must be at least 1")
    if a.model is None:
        from arcsplit.demo import ensure_chat_model

        a.model = str(ensure_chat_model())
    prompts = [int(x) for x in a.prompts.split(",") if x.strip()]
    logs = Path(tempfile.mkdtemp(prefix="link_bytes-"))  # kept only when llama-server does not come up
    plan, rows = run(a.model, prompts, a.tokens, a.reps, a.cpu_memory, logs / "llama-server.log")
    shutil.rmtree(logs, ignore_errors=True)
    lines = ["# Link bytes: the plan's model against what crosses each rpc-server's socket", "",
             f"- Build: {build_line(None, 'cpu')}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Model: `{a.model}` ({plan.arch}); 2 CPU cards in rpc mode, split {list(plan.tensor_split)}, ctx "
             f"{plan.n_ctx}, ubatch {plan.options.n_ubatch}, flash attention {'on' if plan.options.flash_attn else 'off'}; "
             f"{a.tokens} tokens decoded per request, {a.reps} requests per prompt length",
             f"- Command: `{shlex.join(['python', 'bench/link_bytes.py', *(sys.argv[1:] if argv is None else argv)])}`",
             "- measured: bytes both ways through a counting relay in front of the rpc-server, per request; predicted: "
             "planner.LinkCost for that card alone on another host, summed over the request's ubatches (activations, "
             "attention masks at the cells in use, logits); replies: direction changes rpc-server-ward to "
             "llama-server-ward (blocking exchanges) against the model's round trips; each prompt length is sent "
             "once unmeasured first (a new shape re-reserves compute buffers: one-off round trips per tensor)",
             "", "| card | prompt | decoded | measured bytes (min/median/max) | predicted bytes | measured/predicted "
             "(min/median/max) | replies (median) | predicted round trips |", "|---|---|---|---|---|---|---|---|"]
    for j in sorted({r["card"] for r in rows}):
        for n in sorted({r["prompt"] for r in rows}):
            got = [r for r in rows if r["card"] == j and r["prompt"] == n]
            measured = [r["bytes"] for r in got]
            ratio = [r["bytes"] / r["predicted"] for r in got if r["predicted"]]
            lines.append(f"| rpc{j} | {n} | {got[0]['decoded']} | {min(measured):,} / {statistics.median(measured):,.0f} "
                         f"/ {max(measured):,} | {got[0]['predicted']:,} | "
                         + (f"{min(ratio):.3f} / {statistics.median(ratio):.3f} / {max(ratio):.3f}" if ratio else "-")
                         + f" | {statistics.median(r['replies'] for r in got):.0f} | {got[0]['trips']} |")
    lines += ["", "What the model leaves out is the rest of the measured bytes: RPC message headers and tensor descriptors "
              "(each set_tensor names its tensor: about 300 bytes), and above all the graph an rpc-server receives "
              "whenever the graph changes - every prefill ubatch, the first decoded token, each time the context in "
              "use crosses a multiple of 256 - which ggml-rpc.cpp's serialize_graph sends as n_tensors x "
              "sizeof(rpc_tensor) (304 bytes) + n_nodes x 8; unchanged graphs go as GRAPH_RECOMPUTE, a few bytes. "
              "That part is per layer, not per token: with a model this small (n_embd 576) it weighs a lot; with "
              "n_embd 2048 or more and long contexts, activations and masks grow while it does not.", ""]
    write_report(a.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
