"""The plan's link costs against the bytes that really cross: each rpc-server behind a counting TCP relay.

    python bench/link_bytes.py [--model PATH] [--prompts 40,300,700] [--tokens 16] [--reps 3] [--out FILE]
    python bench/link_bytes.py --after-streams 512 [--model PATH] [--reps 3] [--cpu-memory MIB]

`arcsplit plan --layout` with [[hosts]] predicts, per link to another host, the bytes per decoded token and per
prefill ubatch (activations, attention masks, logits) and the blocking round trips (planner.LinkCost). Here every
card is an rpc-server on this machine, so each one's socket carries exactly what its link would carry if its card
were alone on another host. The script serves the model on two CPU cards in rpc mode (arcsplit's own argv from
`planned_specs`), puts a relay that counts bytes in each direction in front of each rpc-server (llama-server
dials the relay), sends prompts of several lengths and decodes --tokens tokens, and compares the bytes and the
replies that follow a request (round trips) of each request with the plan's model for the same prompt length,
ubatch by ubatch. Wire bytes include RPC message headers and tensor descriptors, which the model leaves out.
Writes bench/results/link_bytes.md. ``--after-streams N`` measures the prompt-cache pattern instead: 4 parallel
streams, then an N-token prompt with cache_prompt false and (after streams again) true; per request and rpc-server,
llama-server's RPC commands parsed off the stream (SET_TENSOR, GET_TENSOR, all), replies, bytes and the request's
wall time, with patches 0010 and 0011 off (ARCSPLIT_KV_GAP_KIB=0, ARCSPLIT_SKIP_UNUSED_LOAD=0), 0010 alone on, and
both on (arcsplit's default); writes bench/results/link_bytes_prompt_cache.md.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from arcsplit._api import planned_specs, preview  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.patches import kv_state_spans, rpc_input_on_card, rpc_shm_link, unused_prompt_loads  # noqa: E402
from arcsplit.planner import MASK_START, TOKEN_ID_BYTES, LinkCost, link_costs  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.decide.prepare import ServeRequest  # noqa: E402
from throughput import STREAMS, build_line, complete, long_prompt, measure_streams  # noqa: E402
from _report import write_report  # noqa: E402  (bench/ is sys.path[0] when run as a script)


# ggml-rpc's commands by number (ggml/src/ggml-rpc/ggml-rpc.cpp's enum rpc_cmd in the pinned tree; 18 and 19 are
# arcsplit's gated sets); each message llama-server sends is [command: 1 byte][payload size: 8 bytes LE][payload]
RPC_CMDS = ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
            "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
            "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR", "GATE",
            "SET_TENSOR_GATED")


class Commands:
    """Counts the RPC commands in llama-server's byte stream to an rpc-server, parsed as it passes (a message's
    header may span two reads). Stops counting, and says so, at a command byte it does not know."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.head = b""  # the part of a header seen so far
        self.skip = 0  # payload bytes still to pass
        self.lost = False

    def feed(self, data: bytes) -> None:
        i = 0
        while i < len(data) and not self.lost:
            if self.skip:
                n = min(self.skip, len(data) - i)
                self.skip -= n
                i += n
                continue
            need = 9 - len(self.head)
            self.head += data[i:i + need]
            i += min(need, len(data) - i)
            if len(self.head) < 9:
                return
            cmd, self.skip = self.head[0], int.from_bytes(self.head[1:], "little")
            self.head = b""
            if cmd >= len(RPC_CMDS):
                self.lost = True
                return
            self.counts[RPC_CMDS[cmd]] = self.counts.get(RPC_CMDS[cmd], 0) + 1


class Relay:
    """127.0.0.1:port -> target, counting bytes each way, the replies that follow a request (a direction change
    from llama-server's side to the rpc-server's: one per blocking exchange) and llama-server's commands."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.up = self.down = self.replies = 0
        self.last = "down"
        self.commands = Commands()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def counts(self) -> tuple[int, int, int]:
        with self.lock:
            return self.up, self.down, self.replies

    def command_counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.commands.counts)

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
                        self.commands.feed(data)
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
    nbytes = sum(t * (lc.act_bytes * lc.act_crossings + TOKEN_ID_BYTES * lc.id_crossings + lc.mask_at(pad(used)))
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


@contextlib.contextmanager
def group(model: str, cpu_memory: int, log_path: Path | None = None,
          parallel: int | None = None) -> Iterator[tuple[Any, list[LinkCost], list[Relay], httpx.Client, str]]:
    """Two CPU cards in rpc mode (arcsplit's own argv), each rpc-server behind a counting relay, llama-server up and
    warmed: (plan, each card's link model, the relays, a client, the server's URL). Everything stops on exit."""
    extra = {} if parallel is None else {"parallel": parallel}
    req = ServeRequest(model=model, gpus=[0, 1], backend="cpu", mode="rpc", ctx=2048, threads=1, port=free_port(),
                       cpu_memory_mib=cpu_memory, **extra)
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
            yield plan, links, relays, client, url
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def run(model: str, prompts: list[int], tokens: int, reps: int, cpu_memory: int,
        log_path: Path | None = None) -> tuple[Any, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    with group(model, cpu_memory, log_path) as (plan, links, relays, client, url):
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
    return plan, rows


# the --after-streams configurations, in the table's order: (KV state in spans (0010), no unused load (0011), label)
CONFIGS = ((False, False, "one call per run of cells, stock load"), (True, False, "in spans (0010), stock load"),
           (True, True, "in spans, no unused load (0010 + 0011)"))


def after_streams(model: str, prompt_n: int, reps: int, cpu_memory: int, spans: bool, skip_load: bool = True,
                  log_path: Path | None = None) -> list[dict[str, Any]]:
    """The prompt-cache pattern: 4 parallel streams (they scatter the unified KV), then a ``prompt_n``-token prompt
    with cache_prompt false and, after streams again, true. Per such request and card: llama-server's commands,
    bytes both ways, replies, and its wall time on the client's clock. ``spans`` False runs patch 0010 off
    (ARCSPLIT_KV_GAP_KIB=0: one call per run of KV cells); ``skip_load`` False runs 0011 off (a cached prompt loaded
    into the slot of a cache_prompt false request, as stock llama-server does)."""
    rows: list[dict[str, Any]] = []
    with kv_state_spans(64 if spans else 0), unused_prompt_loads(skip_load), \
            group(model, cpu_memory, log_path, parallel=STREAMS) as g:
        _, _, relays, client, url = g
        prompt = long_prompt(client, url, prompt_n)
        complete(client, url, {"prompt": prompt, "n_predict": 1})  # unmeasured: a new shape reserves buffers
        for rep in range(reps):
            for cache in (False, True):
                measure_streams(url, 16, 600.0, STREAMS)
                time.sleep(0.2)
                before = [(r.counts(), r.command_counts()) for r in relays]
                t0 = time.perf_counter()
                complete(client, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": cache})
                ms = (time.perf_counter() - t0) * 1000
                time.sleep(0.2)
                for j, (r, (b, bc)) in enumerate(zip(relays, before)):
                    a, ac = r.counts(), r.command_counts()
                    calls = {k: ac.get(k, 0) - bc.get(k, 0) for k in ac}
                    rows.append({"spans": spans, "skip": skip_load, "cache": cache, "rep": rep, "card": j, "ms": ms,
                                 "bytes": (a[0] - b[0]) + (a[1] - b[1]), "replies": a[2] - b[2],
                                 "calls": sum(calls.values()), "sets": calls.get("SET_TENSOR", 0),
                                 "gets": calls.get("GET_TENSOR", 0), "lost": r.commands.lost})
    return rows


def after_streams_table(rows: list[dict[str, Any]]) -> list[str]:
    """min / median / max over the repetitions of each (patch, cache, card)."""
    def mmm(xs: list[float], f: str = ",.0f") -> str:
        return f"{min(xs):{f}} / {statistics.median(xs):{f}} / {max(xs):{f}}"

    lines = ["| KV state moves | cache_prompt | card | calls | SET_TENSOR | GET_TENSOR | replies | bytes | "
             "request ms (client) |", "|---|---|---|---|---|---|---|---|---|"]
    for spans, skip, label in CONFIGS:
        for cache in (False, True):
            for j in sorted({r["card"] for r in rows}):
                got = [r for r in rows if r["spans"] == spans and r.get("skip", False) == skip and r["cache"] == cache
                       and r["card"] == j]
                if not got:
                    continue
                lost = " (commands not parsed)" if any(r["lost"] for r in got) else ""
                lines.append(f"| {label} | "
                             f"{str(cache).lower()} | rpc{j} | {mmm([r['calls'] for r in got])}{lost} | "
                             f"{mmm([r['sets'] for r in got])} | {mmm([r['gets'] for r in got])} | "
                             f"{mmm([r['replies'] for r in got])} | {mmm([r['bytes'] for r in got])} | "
                             f"{mmm([r['ms'] for r in got], '.0f')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the chat demo model, SmolLM2 135M)")
    ap.add_argument("--prompts", default="40,300,700", help="prompt lengths in tokens")
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-memory", type=int, default=160, help="MiB per CPU card (small: layers on both cards)")
    ap.add_argument("--after-streams", type=int, default=0, metavar="N",
                    help="instead: the prompt-cache pattern (4 parallel streams, then an N-token prompt, cache off and "
                         "on), patch 0010 off and on; writes bench/results/link_bytes_prompt_cache.md")
    ap.add_argument("--input-on-card", action="store_true",
                    help="the token embeddings on the first card (ARCSPLIT_INPUT_ON_CARD=1, patch 0015): token ids "
                         "cross to it instead; default --out bench/results/link_bytes_input_on_card.md")
    ap.add_argument("--out", default=None, help="default bench/results/link_bytes.md")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.reps < 1:
        ap.error("--tokens and --reps must be at least 1")
    if a.model is None:
        from arcsplit.demo import ensure_chat_model

        a.model = str(ensure_chat_model())
    if a.after_streams:
        return main_after_streams(a, argv)
    prompts = [int(x) for x in a.prompts.split(",") if x.strip()]
    logs = Path(tempfile.mkdtemp(prefix="link_bytes-"))  # kept only when llama-server does not come up
    with rpc_input_on_card(True) if a.input_on_card else contextlib.nullcontext():
        plan, rows = run(a.model, prompts, a.tokens, a.reps, a.cpu_memory, logs / "llama-server.log")
    shutil.rmtree(logs, ignore_errors=True)
    lines = ["# Link bytes: the plan's model against what crosses each rpc-server's socket", "",
             f"- Build: {build_line(None, 'cpu')}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Model: `{a.model}` ({plan.arch}); 2 CPU cards in rpc mode, split {list(plan.tensor_split)}, ctx "
             f"{plan.n_ctx}, ubatch {plan.options.n_ubatch}, flash attention {'on' if plan.options.flash_attn else 'off'}, "
             f"token embeddings {'on the first card (token ids cross to it)' if plan.options.input_on_first else 'on llama-server'}; "
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
    name = "link_bytes_input_on_card.md" if a.input_on_card else "link_bytes.md"
    write_report(a.out or str(ROOT / "bench" / "results" / name), "\n".join(lines))
    return 0


def main_after_streams(a: argparse.Namespace, argv: list[str] | None) -> int:
    """--after-streams: what a prompt after parallel streams costs on each link, KV state moved per run of cells
    (patch 0010 off) and in spans (on), and without the load a cache_prompt false request does not use (0011), in
    the same invocation."""
    rows = []
    for spans, skip, _ in CONFIGS:
        rows += after_streams(a.model, a.after_streams, a.reps, a.cpu_memory, spans, skip)
    lines = ["# Link calls and bytes of a prompt after parallel streams (llama-server's host prompt cache)", "",
             f"- Build: {build_line(None, 'cpu')}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Model: `{a.model}`; 2 CPU cards in rpc mode (arcsplit's argv: -np {STREAMS}, unified KV, llama.cpp's "
             "default host prompt cache), each rpc-server behind a counting TCP relay (no shared memory)",
             f"- Command: `{shlex.join(['python', 'bench/link_bytes.py', *(sys.argv[1:] if argv is None else argv)])}`",
             f"- Each repetition ({a.reps}): {STREAMS} parallel streams of 16 tokens, then the same "
             f"{a.after_streams}-token prompt (n_predict 1) with cache_prompt false; streams again, then the prompt "
             "with cache_prompt true. Per request and rpc-server: llama-server's RPC commands (parsed off the "
             "stream), the SET_TENSOR and GET_TENSOR among them, replies (blocking exchanges), bytes both ways, "
             "and the request's wall time on the client (one process group per row group; min / median / max).",
             "- At slot selection llama-server saves the slot's previous prompt and restores a cached prompt that "
             "matches the new one into the unified KV cache, which the streams left scattered (also with "
             "cache_prompt false, which then recomputes it). One call per run of cells is llama.cpp's way "
             "(ARCSPLIT_KV_GAP_KIB=0); in spans is patch 0010's. Stock load: a cache_prompt false request still gets "
             "the cached prompt loaded into its slot (ARCSPLIT_SKIP_UNUSED_LOAD=0); patch 0011 leaves it in the cache "
             "and starts the slot empty.", ""]
    lines += after_streams_table(rows) + [""]
    write_report(a.out or str(ROOT / "bench" / "results" / "link_bytes_prompt_cache.md"), "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
