"""Throughput per serving mode, served through arcsplit itself and measured over real HTTP.

    python bench/throughput.py [--backend cpu|cuda] [--gpus 0,1] [--model PATH] [--modes native,hybrid,rpc]
                               [--full] [--reps N] [--runs N] [--same-card] [--rpc-cache] [--n-predict N]
                               [--threads N] [--ubatch N] [--out FILE]

Each mode is started with ``arcsplit.serve`` (the public API: plan, specs, supervisor) at the same context,
``-np 4`` and the planner's flags (``-fa on``), then measured against llama-server's
/completion: prefill t/s (a 512-token prompt, n_predict 1, no prompt cache: ``timings.prompt_per_second``),
decode t/s (a short prompt, n_predict N, eos ignored: ``timings.predicted_per_second``) and 4 parallel streams
(4 concurrent decode requests: sum of predicted tokens / wall time), and time to first token on the client's clock
(TTFT, ms: the wall time of the prefill request, cache_prompt false; and of the same prompt again with cache_prompt
true, right after parallel streams: what llama-server's host prompt cache does before a prompt, restoring the KV of
a cached prompt into a unified KV cache that the streams left scattered, is in both; with the cache on it is what
the cache buys on a repeated prefix). Each repetition runs prefill, decode, streams, the cache-on request and then
short unmeasured parallel streams, so every prefill follows parallel streams. Each figure is the median of N
repetitions after one discarded warm-up. Ratios are to "native". -ub is arcsplit's choice per route (llama.cpp's 512 for
native routes, 256 over RPC) unless --ubatch sets one for all; the table shows what each mode ran with.

native: CUDA = mode multi (one llama-server holding both GPUs, llama.cpp's own multi-device split); CPU = mode
single with one card (one llama-server running the whole model on its own CPU: the CPU build has no
multi-device mode). hybrid = llama-server holds the first card itself (local card first) plus one rpc-server
per other card; rpc = one rpc-server per card. hybrid-stock / rpc-stock = the same, with arcsplit's llama.cpp
patches switched off in every process (ARCSPLIT_RPC_STOCK=1): a side-by-side A/B on one build. hybrid-last =
hybrid with the output layer on the last card (llama.cpp's place, arcsplit's default) and hybrid-local with it
on llama-server's own card (--output-layer local); -stock goes last (hybrid-last-stock). hybrid-nospin /
rpc-nospin = patches on, but the RPC link's threads sleep at once instead of polling first
(ARCSPLIT_RPC_SPIN_US=0; arcsplit sets it on GPU groups, patch 0005). rpc-norelay = patches on, but an
activation between two rpc-servers crosses whole (ARCSPLIT_RPC_RELAY_KIB=0, patch 0007). hybrid-noshm /
rpc-noshm = patches on, but the link to the rpc-servers runs over loopback TCP instead of shared memory
(ARCSPLIT_RPC_SHM=0, patch 0008). hybrid-nospan / rpc-nospan = patches on, but a KV sequence saved or restored by
the prompt cache moves one run of cells at a time (ARCSPLIT_KV_GAP_KIB=0, patch 0010). -load (native-load,
hybrid-load, rpc-load) = patches on, but a request with cache_prompt false gets a cached prompt loaded into its slot
and dropped, as stock llama-server does (ARCSPLIT_SKIP_UNUSED_LOAD=0, patch 0011). -nocram (native-nocram, hybrid-nocram, rpc-nocram) runs llama-server
with --cache-ram 0: its host-memory prompt cache copies a slot's KV out and back at slot selection, over the link
on an RPC route. -nokvu (--no-kv-unified), -lv3 (llama.cpp's
default verbosity instead of arcsplit's -lv 4) and rpc-card (an all-RPC llama-server sees the rpc-servers' card) each
change one more setting of the product's all-RPC route, for the prefill A/B of issue 45. Any mode may end in -ubN, its own
micro-batch (native-ub256, hybrid-ub512): what the route's ubatch choice costs against native's default.

The bench exits 3 when one mode's repetitions within a run differ by more than --max-rep-spread (default 2x; 0 turns
the check off), and the table says which. --runs N repeats the whole set N times, every mode a fresh group of processes each time, each run against its
own native; the table then gives min / median / max over the runs of each run's ratio. --same-card (GPU
backends, one --gpus card) measures the RPC route's tax on a machine with one GPU: the route's "cards" are
that one GPU twice (llama-server and the rpc-servers all see it), and native is mode single on it.
--rpc-cache starts rpc-servers with llama.cpp's weight cache (`-c`), so repeated loads read weights locally;
the served weights, and so the figures, are the same.

Greedy output (temperature 0) of every mode is compared with native's at the same -fa and -ub. On CPU the
rpc-servers keep weights unrepacked while a local llama-server repacks Q4_K for its own CPU, which changes
rounding, so that comparison runs every mode once more with ``--no-repack`` (the throughput runs keep llama.cpp's
defaults). Writes bench/results/throughput_<backend>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import arcsplit  # noqa: E402
from arcsplit.backends import REGISTRY  # noqa: E402
from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.locate import find_llama, server_build_info  # noqa: E402
from arcsplit.llama.patches import (GATE_HOST_NEVER_KIB, kv_state_spans, rpc_async_reads, rpc_gated_sets,  # noqa: E402
                                    rpc_link_polling, rpc_patches_switched, rpc_pinned_reads, rpc_queued_sets,
                                    rpc_input_on_card, rpc_relay_chunks, rpc_sets_in_place, rpc_shm_link,
                                    unused_prompt_loads)
from arcsplit.route import Route  # noqa: E402
from arcsplit.decide.prepare import rpc_spin_us  # noqa: E402
from arcsplit.proc.ports import free_port, wait_listening  # noqa: E402
from arcsplit.run import supervisor  # noqa: E402
# the measuring core is the product's (arcsplit tune measures the same way)
from arcsplit.tuning.measure import (DECODE_PROMPT, complete, long_prompt, measure_decode,  # noqa: E402,F401
                                   measure_prefill, measure_streams, timed)
from _proc import stop  # noqa: E402  (bench/ is sys.path[0] when run as a script)

PROMPT_TOKENS = 512
STREAMS = 4
SCATTER_TOKENS = 8  # the unmeasured parallel streams that end each repetition
FIGURES = ("prefill", "decode", "streams", "ttft", "ttft_cache")  # the table's columns, in order
UNIT = {"prefill": "t/s", "decode": "t/s", "streams": "t/s", "ttft": "ms", "ttft_cache": "ms"}
EQUALITY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")

@dataclass
class ModeResult:
    mode: str  # native | hybrid | rpc
    arcsplit_mode: str  # single | multi | hybrid | rpc
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    streams: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # ms, client clock: the prefill request (cache_prompt false)
    ttft_cache: list[float] = field(default_factory=list)  # ms: the same prompt with cache_prompt true, after streams
    ready: float | None = None  # seconds from arcsplit.serve() to a group answering /health (weights loaded)
    argv: dict[str, list[str]] = field(default_factory=dict)
    greedy: list[list[int]] = field(default_factory=list)
    greedy_argv: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    greedy_error: str | None = None

    def median(self, name: str) -> float | None:
        xs = getattr(self, name)
        if not isinstance(xs, list):  # ready: one value per group
            return xs
        return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class Variant:
    """A mode name of this script: ``route[-last|-local][-stock|-nospin][-ubN]``.

    -last / -local: where the output layer goes in hybrid (llama.cpp's place, the default; llama-server's own card);
    -stock: arcsplit's llama.cpp patches switched off in every process (ARCSPLIT_RPC_STOCK=1, inherited);
    -nospin: patches on, the RPC link's polling off (ARCSPLIT_RPC_SPIN_US=0, patch 0005);
    -norelay: patches on, an activation between two rpc-servers relayed whole (ARCSPLIT_RPC_RELAY_KIB=0, 0007);
    -noshm: patches on, the link to the rpc-servers over loopback TCP, not shared memory (ARCSPLIT_RPC_SHM=0, 0008);
    -nopin: patches on, a local card's activation read into ordinary memory, not page-locked blocks, before it goes
    to an rpc-server (ARCSPLIT_RPC_PINNED=0, 0001; hybrid: llama-server's own card);
    -syncread: patches on, llama-server waits for an activation's source before it goes to an rpc-server (its own
    CUDA or SYCL card in hybrid, the first rpc-server in all-RPC's relay) instead of queueing the read and going on,
    and an rpc-server waits for a repeated graph before it reads the next command (ARCSPLIT_RPC_ASYNC_READ=0, 0001,
    0003 and 0007);
    -gate: patches on, and gated sets on too (ARCSPLIT_RPC_GATE=1; arcsplit's default on all-RPC CUDA routes of one
    machine; 0001, 0003, 0007, 0009): llama-server announces an activation bound for an rpc-server before its data,
    and an rpc-server whose device can wait on a host word (CUDA) launches the graph that reads it before the data
    comes; a graph input from llama-server's host memory is not gated unless ARCSPLIT_RPC_GATE_HOST_KIB says so;
    -nogate: gated sets off (ARCSPLIT_RPC_GATE=0): the A/B of arcsplit's default where it turns them on;
    -gatehost: -gate, and a graph input from llama-server's host memory (a prompt's embeddings on all-RPC's first
    rpc-server) gated from 256 KiB up (ARCSPLIT_RPC_GATE_HOST_KIB=256, the patch's own default);
    -gatenohost: -gate with ARCSPLIT_RPC_GATE_HOST_KIB at 4 GiB said explicitly (arcsplit's choice since 2026-12-07;
    before it, -gate gated host inputs from 256 KiB: the files of that day's first runs);
    -syncset: patches on, but an rpc-server waits for each graph input's copy to its device in turn, as stock does,
    instead of queueing it on the device's stream (ARCSPLIT_RPC_QUEUED_SETS=0, 0003; a backend without an
    asynchronous set, the CPU, waits either way);
    -copyset: patches on, but llama-server copies a SET_TENSOR's data into a block of its own before it is sent, as
    stock does (ARCSPLIT_RPC_IN_PLACE=0, 0014), instead of sending one of 256 KiB or more from where it lies;
    -hostembd / -cardembd: an all-RPC group's token embeddings on llama-server's CPU, as llama.cpp does
    (ARCSPLIT_INPUT_ON_CARD=0), or on its first card (=1, patch 0015: only token ids cross to it), wherever that card
    is (arcsplit's auto: on the first card only when it is on another host);
    -nospan: patches on, but a KV sequence saved or restored by llama-server's prompt cache moves one run of cells
    per call (ARCSPLIT_KV_GAP_KIB=0, 0010), not in spans;
    -load: a request with cache_prompt false gets a cached prompt loaded into its slot (and dropped), as stock
    llama-server does (ARCSPLIT_SKIP_UNUSED_LOAD=0, 0011; native-load too);
    -nocram: llama-server's host-memory prompt cache off (--cache-ram 0; native-nocram too): no KV copied out and
    back at slot selection, which on an RPC route crosses the link;
    -alt: the same mode on the build --alt-llama-dir names (native-alt too): two builds in the same runs, e.g. one
    with a changed libggml-rpc.so, for a change that has no switch of its own;
    -neighbour: an idle ggml-rpc-server holds --gpus' first card during the mode's run (native-neighbour too): with
    NVIDIA MPS on, native shares the card with one more client, as a split route does;
    -embd: all-RPC with the token embeddings on the first rpc-server (``-ot token_embd.weight=RPC0[endpoint]``):
    a prompt's token ids cross the link instead of its embedding rows (n_embd floats a token), and the first
    rpc-server looks them up; llama.cpp turns pipeline parallelism off when any tensor is overridden;
    -bs: llama-server samples on the output card (llama.cpp's ``--backend-sampling``; native-bs too): a token id
    crosses the link instead of n_vocab logits;
    -nopp: pipeline parallelism off and nothing moved (``-ot`` of the output norm onto the card that holds it
    anyway): the A/B that tells -embd's move from its side effect;
    -ubN: this mode's micro-batch (``native-ub256``, ``hybrid-ub512``) instead of the route's own or --ubatch;
    -alt after another tag (``native-bs-alt``, ``rpc-nopp-alt``): that variant on the --alt-llama-dir build.
    """

    route: str  # native | hybrid | rpc
    output: str = "auto"  # --output-layer
    off: str = ""  # "", a key of _TAG_ENV ("stock", "nospin", ...), "nocram" or "alt"
    ubatch: int | None = None  # -ubN
    alt: bool = False  # on the --alt-llama-dir build: -alt alone (off == "alt") or after another tag

    @property
    def on_alt(self) -> bool:
        return self.alt or self.off == "alt"


def parse_mode(mode: str) -> Variant:
    route, *tags = mode.split("-")
    ub = int(tags.pop()[2:]) if tags and re.fullmatch(r"ub[1-9][0-9]*", tags[-1]) else None
    rpc_tags = route in ("hybrid", "rpc")
    # native takes its own flag only
    offs = ((*_TAG_ENV, *_TAG_ARGS, *(("card", "embd") if route == "rpc" else ()), "nopp", "alt", "neighbour")
            if rpc_tags
            else ("load", *_TAG_ARGS, "alt", "neighbour"))
    output = tags.pop(0) if rpc_tags and tags and tags[0] in ("last", "local") else "auto"
    off = tags.pop(0) if tags and tags[0] in offs else ""
    alt = bool(off) and off != "alt" and tags == ["alt"]
    if alt:
        tags.pop()
    if route not in ("native", "hybrid", "rpc") or tags:
        raise SystemExit(f"unknown mode {mode!r}: use native, or hybrid/rpc with -last or -local (where the "
                         "output layer goes) and then " + ", ".join(f"-{o}" for o in _TAG_ENV) + ", -card, "
                         + ", ".join(f"-{o}" for o in _TAG_ARGS) + ", -embd (rpc), -nopp, -alt or -neighbour (native-load, native-nocram, "
                         "native-nokvu, native-lv3, native-alt, native-neighbour too), a tag then -alt for its run on the "
                         "--alt-llama-dir build; any of them may end in -ubN")
    return Variant(route, output, off, ub, alt)


def run_order(modes: list[str], k: int) -> list[str]:
    """Run k's order: the first mode (the baseline) first, the others rotated by one per run. Twin rows of one
    configuration read up to 0.13 apart over 3 runs on a GPU (an A/A run), so a mode's place in the run must not be
    the same in every run."""
    rest = modes[1:]
    shift = (k - 1) % len(rest) if rest else 0
    return modes[:1] + rest[shift:] + rest[:shift]


def serve_mode(mode: str, backend: str, same_card: bool = False) -> tuple[str, bool]:
    """Our mode name -> (arcsplit mode, whether it takes only the first card)."""
    route = parse_mode(mode).route
    if route == "native":
        return ("single", True) if backend == "cpu" or same_card else ("multi", False)
    return route, False


class _Twin(int):
    """A card index that differs from its twins but equals the plain number: the same GPU named twice passes
    Route's one-card-once check (which protects users), every process still gets that GPU's number in its
    environment, and code that compares an index with a plain int still matches."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other if isinstance(other, _Twin) else int(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other


@contextlib.contextmanager
def same_card_rig(card: int, n_cards: int, card_mib: int | None = None) -> Iterator[None]:
    """Inside: a group asked for cards 0..n_cards-1 gets GPU ``card`` that many times, each with an even share
    of its free memory, so llama-server and every rpc-server see (and load onto) the same GPU. arcsplit
    itself refuses a card named twice; only this bench shares one on purpose (as _Twin indices). ``card_mib``:
    each card plans as one of that size instead, the GPU alone too (a model that does not fit such a card, on a
    GPU that would hold it)."""
    from arcsplit.rig import Card, Rig
    from arcsplit.decide import prepare as prep

    real = prep.discover_rig

    def shared(backend: str, gpus: list[int] | None, *args: Any, **kw: Any) -> Rig:
        alone = bool(card_mib) and gpus == [card]
        if gpus != list(range(n_cards)) and not alone:
            return real(backend, gpus, *args, **kw)
        c = real(backend, [card], *args, **kw).cards[0]
        share = 1 if alone else n_cards
        total, free = c.total_bytes // share, c.free_bytes // share
        if card_mib:
            total, free = min(total, card_mib << 20), min(free, card_mib << 20)
        return Rig(tuple(Card(backend, c.index if alone else _Twin(c.index), c.name, total, free)
                         for _ in gpus or ()))

    prep.discover_rig = shared
    try:
        yield
    finally:
        prep.discover_rig = real


# what each tag sets in the environment the variant's processes inherit: one patch switched off, or (-gate) gated
# sets switched on (-nocram is an argument)
_TAG_ENV: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "stock": lambda: rpc_patches_switched(on=False),
    "nospin": lambda: rpc_link_polling(0),
    "norelay": lambda: rpc_relay_chunks(0),
    "noshm": lambda: rpc_shm_link(False),
    "nopin": lambda: rpc_pinned_reads(False),
    "syncread": lambda: rpc_async_reads(False),
    "gate": lambda: rpc_gated_sets(True),
    "nogate": lambda: rpc_gated_sets(False),
    "gatehost": lambda: rpc_gated_sets(True, host_kib=256),
    "gatenohost": lambda: rpc_gated_sets(True, host_kib=GATE_HOST_NEVER_KIB),
    "nospan": lambda: kv_state_spans(0),
    "syncset": lambda: rpc_queued_sets(False),
    "copyset": lambda: rpc_sets_in_place(False),
    "hostembd": lambda: rpc_input_on_card(False),
    "cardembd": lambda: rpc_input_on_card(True),
    "load": lambda: unused_prompt_loads(skip=False),
}


# llama-server flags a tag appends (after arcsplit's, so they win): its host-memory prompt cache off, a KV stream per
# slot instead of arcsplit's unified KV, its log at llama.cpp's default verbosity instead of arcsplit's -lv 4
_TAG_ARGS: dict[str, tuple[str, ...]] = {
    "nocram": ("--cache-ram", "0"),
    "nokvu": ("--no-kv-unified",),
    "lv3": ("-lv", "3"),
    "bs": ("--backend-sampling",),
}


@contextlib.contextmanager
def specs_rewritten(rewrite: Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]) -> Iterator[None]:
    """Inside: every group's process specs pass through ``rewrite(config, specs)`` before they start (a variant
    that changes what the product would run: -card, -embd, -nopp)."""
    real = supervisor.build_specs

    def rewritten(config: Any, *args: Any, **kw: Any) -> Any:
        return rewrite(config, real(config, *args, **kw))

    supervisor.build_specs = rewritten
    try:
        yield
    finally:
        supervisor.build_specs = real


def server_sees_card() -> contextlib.AbstractContextManager[None]:
    """-card: on an all-RPC route llama-server sees the first rpc-server's card (its --device still lists only the
    RPC devices, so it computes nothing there), as a hybrid llama-server does: its host buffers are then the card's
    page-locked ones. arcsplit hides every card from an all-RPC llama-server; only this A/B shows one."""

    def shown(config: Any, specs: tuple[Any, ...]) -> tuple[Any, ...]:
        var = REGISTRY[config.backend].visibility_var
        rpc = next((dict(s.env) for s in specs if s.role == "rpc"), {})
        if var is None or var not in rpc:
            return specs
        return tuple(dataclasses.replace(s, env=tuple(sorted({**dict(s.env), var: rpc[var]}.items())))
                     if s.role == "server" else s for s in specs)

    return specs_rewritten(shown)


def override_args(argv: list[str], tag: str) -> list[str]:
    """-embd / -nopp: the ``-ot`` a variant appends to llama-server's argv, from its ``--rpc`` endpoints (an RPC
    device's buffer type is named ``RPC0[host:port]``: its index on that server and the endpoint, ggml-rpc.cpp)."""
    endpoints = argv[argv.index("--rpc") + 1].split(",")
    if tag == "embd":
        return [*argv, "-ot", rf"^token_embd\.weight$=RPC0[{endpoints[0]}]"]
    return [*argv, "-ot", rf"^output_norm\.weight$=RPC0[{endpoints[-1]}]"]


def server_overrides(tag: str) -> contextlib.AbstractContextManager[None]:
    """-embd / -nopp: llama-server's spec gets the variant's ``-ot`` (override_args)."""
    return specs_rewritten(lambda config, specs: tuple(
        dataclasses.replace(s, argv=tuple(override_args(list(s.argv), tag))) if s.role == "server" else s
        for s in specs))


@contextlib.contextmanager
def idle_neighbour(a: argparse.Namespace) -> Iterator[None]:
    """-neighbour: an idle ggml-rpc-server of the mode's build on --gpus' first card for the mode's run, sent nothing.
    It holds a context on the card, so with NVIDIA MPS on, native's llama-server shares the card with one more
    client as a split route's processes do: whether MPS itself, not the split, makes their kernels slower."""
    bins = find_llama(a.llama_dir, backend=a.backend)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(a.gpu_list[0])) if a.backend == "cuda" else None
    port = free_port()
    proc = subprocess.Popen([str(bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_listening(proc, "127.0.0.1", port, timeout=60)  # listening: its devices (a context) are set up
        yield
    finally:
        stop(proc)


def mode_env(mode: str, a: argparse.Namespace | None = None) -> contextlib.AbstractContextManager[None]:
    """The environment a variant's processes inherit: one patch, or all of them, switched off, or gated sets on
    (_TAG_ENV); or (-card) llama-server's own environment shows the card; or (-neighbour, with the bench's
    arguments) an idle process holds the card too; or (-embd, -nopp) llama-server's argv gets an ``-ot``."""
    tag = parse_mode(mode).off
    if tag == "card":
        return server_sees_card()
    if tag in ("embd", "nopp"):
        return server_overrides(tag)
    if tag == "neighbour":
        if a is None:
            raise SystemExit(f"{mode}: -neighbour runs in bench/throughput.py only")
        return idle_neighbour(a)
    off = _TAG_ENV.get(tag)
    return off() if off else contextlib.nullcontext()


def greedy(client: httpx.Client, url: str, n_predict: int) -> list[list[int]]:
    out = []
    for p in EQUALITY_PROMPTS:
        r = complete(client, url, {"prompt": p, "n_predict": n_predict, "ignore_eos": True, "return_tokens": True})
        out.append([int(t) for t in r["tokens"]])
    return out


def argv_of(server: Any) -> dict[str, list[str]]:
    return {name: list(p.get("argv", [])) for name, p in server.status()["processes"].items()}


def serve_kwargs(a: argparse.Namespace, mode: str, extra: tuple[str, ...],
                 ubatch: int | None = None) -> tuple[list[int], dict[str, Any]]:
    amode, first_only = serve_mode(mode, a.backend, a.same_card)
    gpus = a.gpu_list[:1] if first_only else a.gpu_list
    if a.same_card and not first_only:
        gpus = list(range(a.same_card_cards))  # placeholders: same_card_rig maps them all onto --gpus' one card
    args = list(extra)
    if a.threads is not None and amode == "single":
        args += ["-t", str(a.threads)]  # the other modes pass it to llama-server and rpc-servers via ServeRequest
    variant = parse_mode(mode)
    args += list(_TAG_ARGS.get(variant.off, ()))  # -nocram, -nokvu, -lv3: llama-server's own flags, last
    ub = next((u for u in (ubatch, variant.ubatch, a.ubatch) if u is not None), None)  # the call's, the mode's, all's
    kw: dict[str, Any] = dict(backend=a.backend, mode=amode, ctx=a.ctx, parallel=STREAMS, port=free_port(),
                              threads=a.threads, ubatch=ub,
                              cpu_memory_mib=a.cpu_memory_mib, extra_args=tuple(args), bus=False,
                              llama_dir=a.alt_llama_dir if variant.on_alt else a.llama_dir,
                              output_layer=variant.output, rpc_cache=a.rpc_cache)
    return gpus, kw


def flag(argv: list[str], name: str) -> str | None:
    """The last value of ``name`` in an argv (llama.cpp takes the last one)."""
    values = [argv[i + 1] for i, x in enumerate(argv[:-1]) if x == name]
    return values[-1] if values else None


def server_flag(r: "ModeResult", name: str) -> str | None:
    return flag(r.argv.get("server", []), name)


def random_ids(client: httpx.Client, url: str, n: int, seed: int) -> list[int]:
    """``n`` random token ids of the served model's vocabulary (the --pattern lru prompts: ids, not text)."""
    models = client.get(f"{url}/v1/models").json()
    n_vocab = int(next((m.get("meta", {}).get("n_vocab") for m in models.get("data", [])), None) or 32000)
    rng = random.Random(seed)
    return [rng.randrange(10, n_vocab - 1) for _ in range(n)]


def lru_reps(a: argparse.Namespace, mode: str, client: httpx.Client, url: str, res: ModeResult) -> None:
    """--pattern lru: a harness that once made all-RPC MoE prefill bimodal on a GPU. One 64-token warm-up, then per
    repetition: the 512 random token ids as the prompt (cache_prompt false), a 3-token prompt, decode, then the
    parallel streams. With -np 4 llama-server picks slots by LRU, so successive prefills land in different slots,
    some recently or never used; each prefill but the first follows the streams. The first repetition is not
    counted: its prefill is the first of its shape in every mode, native too (3-4x slower on one H100)."""
    complete(client, url, {"prompt": random_ids(client, url, 64, 1), "n_predict": 1})
    prompt = random_ids(client, url, PROMPT_TOKENS, 2)
    for i in range(a.reps + 1):
        r, t = timed(client, url, {"prompt": prompt, "n_predict": 1})
        p = float(r["timings"]["prompt_per_second"])
        complete(client, url, {"prompt": random_ids(client, url, 3, 100 + i), "n_predict": 1})
        d = measure_decode(client, url, a.n_predict)
        s = measure_streams(url, a.n_predict, a.timeout)
        if i:
            res.prefill.append(p)
            res.decode.append(d)
            res.streams.append(s)
            res.ttft.append(t)
        print(f"  {mode:<7} rep {i}{' (not counted)' if i == 0 else ''}  prefill {p:8.1f}  decode {d:7.2f}  {STREAMS} streams {s:7.2f} t/s  "
              f"TTFT {t:7.1f} ms", flush=True)


def run_mode(a: argparse.Namespace, mode: str) -> ModeResult:
    amode, _ = serve_mode(mode, a.backend, a.same_card)
    res = ModeResult(mode, amode)
    gpus, kw = serve_kwargs(a, mode, ())
    t0 = time.monotonic()
    with mode_env(mode, a), arcsplit.serve(a.model, gpus=gpus, **kw) as server, \
            httpx.Client(timeout=a.timeout) as client:
        res.ready = time.monotonic() - t0
        print(f"  {mode:<7} ready after {res.ready:.2f} s", flush=True)
        url = server.url
        res.argv = argv_of(server)
        if a.pattern == "lru":
            lru_reps(a, mode, client, url, res)
            return res
        prompt = long_prompt(client, url, PROMPT_TOKENS)
        for i in range(a.reps + 1):  # repetition 0 is the warm-up
            r, t = timed(client, url, {"prompt": prompt, "n_predict": 1})
            p = float(r["timings"]["prompt_per_second"])
            d = measure_decode(client, url, a.n_predict)
            s = measure_streams(url, a.n_predict, a.timeout)
            _, tc = timed(client, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": True})
            measure_streams(url, SCATTER_TOKENS, a.timeout)  # so the next prefill follows parallel streams too
            if i:
                res.prefill.append(p)
                res.decode.append(d)
                res.streams.append(s)
                res.ttft.append(t)
                res.ttft_cache.append(tc)
            print(f"  {mode:<7} rep {i}{' (warm-up)' if i == 0 else '          '}  prefill {p:8.1f}  "
                  f"decode {d:7.2f}  {STREAMS} streams {s:7.2f} t/s  TTFT {t:7.1f} ms, cache on {tc:7.1f} ms",
                  flush=True)
    return res


def check_greedy(a: argparse.Namespace, results: list[ModeResult]) -> int:
    """Greedy tokens of every mode at one -fa and one -ub (the smallest any mode used: safe for every plan)."""
    ubs = [int(u) for r in results if not r.error and (u := server_flag(r, "-ub"))]
    ub = min(ubs) if ubs else None
    for r in results:
        if r.error:
            continue
        gpus, kw = serve_kwargs(a, r.mode, a.equality_args, ubatch=ub)
        try:
            with mode_env(r.mode, a), arcsplit.serve(a.model, gpus=gpus, **kw) as server, \
                    httpx.Client(timeout=a.timeout) as client:
                r.greedy = greedy(client, server.url, a.greedy_tokens)
                r.greedy_argv = argv_of(server)
        except Exception as exc:  # reported in the table
            r.greedy_error = str(exc).splitlines()[0][:200]
        print(f"  greedy {r.mode}: {'failed: ' + r.greedy_error if r.greedy_error else 'done'}", flush=True)
    return ub or 0


def machine(backend: str) -> str:
    parts = [f"{cpu_model()} ({os.cpu_count()} cores)"]
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
        if gpus:
            parts.append("; ".join(gpus.splitlines()))
    except (OSError, subprocess.TimeoutExpired):
        pass
    load = os.getloadavg()
    parts.append(f"{platform.system()} {platform.release()}; load average at start {load[0]:.2f}")
    return ", ".join(parts)


def build_line(llama_dir: str | None, backend: str) -> str:
    bins = find_llama(llama_dir, backend=backend)
    info = server_build_info(bins)
    return (f"llama.cpp {info.version} (build {info.build_number or '?'}, commit {info.commit or '?'}), "
            f"{info.compiler} for {info.target}, in {bins.bin_dir} (`arcsplit llama which`)")


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def finished(results: list[ModeResult], mode: str) -> ModeResult | None:
    """This run's result of ``mode``, unless it failed."""
    return next((r for r in results if r.mode == mode and not r.error), None)


def native_of(results: list[ModeResult]) -> ModeResult | None:
    return finished(results, "native")


def greedy_cell(r: ModeResult, native: ModeResult | None) -> str:
    if r is native:
        return "(reference)" if r.greedy else f"failed: {r.greedy_error}"
    if r.greedy_error:
        return f"failed: {r.greedy_error}"
    if native is None or not native.greedy or not r.greedy:
        return "-"
    same = sum(x == y for x, y in zip(r.greedy, native.greedy))
    return f"{'yes' if same == len(native.greedy) else 'NO'} ({same}/{len(native.greedy)})"


def layers_cell(r: ModeResult) -> str:
    layers = f"{server_flag(r, '-ngl') or '-'} ({server_flag(r, '-ts') or '-'})"
    if server_flag(r, "-ot"):
        layers += f" -ot {server_flag(r, '-ot')}"
    return layers


def spread(xs: list[float]) -> str:
    """min / median / max of per-run ratios, or the one value."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}x"
    return f"{min(xs):.2f} / **{statistics.median(xs):.2f}** / {max(xs):.2f}"


def run_ratios(runs: list[list[ModeResult]], mode: str, name: str) -> list[float]:
    """This mode's median over its own run's native median, one value per run where both ran."""
    out = []
    for results in runs:
        native = native_of(results)
        r = finished(results, mode)
        if native and r and r.median(name) and native.median(name):
            out.append(r.median(name) / native.median(name))
    return out


def token_cost_us(runs: list[list[ModeResult]], mode: str) -> list[float]:
    """What a decoded token costs this mode over native, in microseconds (1e6 / its decode t/s minus native's), one
    value per run where both ran: the route's per-token crossing, comparable across models and cards."""
    out = []
    for results in runs:
        native, r = native_of(results), finished(results, mode)
        if native and r and (d := r.median("decode")) and (n := native.median("decode")):
            out.append(1e6 / d - 1e6 / n)
    return out


def us_cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{xs[0]:+.0f}" if len(xs) == 1 else \
        f"{min(xs):+.0f} / **{statistics.median(xs):+.0f}** / {max(xs):+.0f}"


def twins(modes: list[str]) -> list[tuple[str, str]]:
    """(mode, its variant) pairs of one list: `rpc-noshm` is `rpc` with one thing changed, run beside it; and
    `rpc-gatenohost` is `rpc-gate` with one thing changed (a switch tag that extends another's)."""
    pairs = [(m.rsplit("-", 1)[0], m) for m in modes if "-" in m and m.rsplit("-", 1)[0] in modes]
    for m in modes:
        base, _, tag = m.rpartition("-")
        if tag in _TAG_ENV:
            pairs += [(f"{base}-{t}", m) for t in _TAG_ENV if t != tag and tag.startswith(t) and f"{base}-{t}" in modes]
    return pairs


def paired_table(runs: list[list[ModeResult]], modes: list[str]) -> list[str]:
    """Each mode against its variant within each run. A row's ratios to native also carry that run's native (one
    slow native lifts every row of its run), so an A/B reads better as mode / variant per run, and in how many
    runs the mode was the faster."""
    pairs = twins(modes)
    if not pairs:
        return []
    lines = ["", "Paired within each run: t/s of the mode over its variant's in the same run, and for TTFT the "
             "variant's ms over the mode's (above 1: the mode is faster), min / **median** / max over runs, and the "
             "runs where the mode was faster:", "",
             "| mode / variant | prefill | decode | 4 streams | TTFT | TTFT, cache on |", "|---|---|---|---|---|---|"]
    for a, b in pairs:
        cells = []
        for k in FIGURES:
            xs = []
            for results in runs:
                ra, rb = finished(results, a), finished(results, b)
                if ra and rb and (x := ra.median(k)) and (y := rb.median(k)):
                    xs.append(y / x if UNIT[k] == "ms" else x / y)
            cells.append(f"{spread(xs)} ({sum(x > 1 for x in xs)} of {len(xs)})" if xs else "-")
        lines.append(f"| {a} / {b} | {' | '.join(cells)} |")
    return lines


def uneven_reps(runs: list[list[ModeResult]], limit: float) -> list[str]:
    """Each (run, mode, figure) whose repetitions differ by more than ``limit`` times (max / min): such a figure's
    median says little (all-RPC MoE prefill once read 3.5k / 15.5k / 3.1k / 16.4k / 3.2k t/s in one run)."""
    out = []
    for k, results in enumerate(runs, 1):
        for r in results:
            for name in ("prefill", "decode", "streams", "ttft"):
                xs = [x for x in getattr(r, name) if x > 0]
                if len(xs) > 1 and max(xs) > limit * min(xs):
                    out.append(f"run {k}, {r.mode}, {name}: {min(xs):.1f} to {max(xs):.1f} {UNIT[name]} "
                               f"({max(xs) / min(xs):.1f}x)")
    return out


def spread_table(runs: list[list[ModeResult]]) -> list[str]:
    """The figures of several independent runs: per mode, each run's ratio to that run's native."""
    first = runs[0]
    native = native_of(first)
    lines = ["| mode | -ub | -ngl (-ts) | prefill t/s | decode t/s | 4 streams t/s | prefill / native | "
             "decode / native | 4 streams / native | TTFT ms | TTFT ms, cache on | TTFT / native | "
             "TTFT cache on / native | decode us/token over native | greedy = native | ready s (min / median / max) | "
             "ready / native |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in first:
        ok = [x for results in runs for x in results if x.mode == r.mode and not x.error]
        if not ok:
            lines.append(f"| {r.mode} ({r.arcsplit_mode}) | | | failed: {r.error} | | | | | | | | | | | |")
            continue
        tps = [fmt(statistics.median(v) if (v := [m for x in ok if (m := x.median(k)) is not None]) else None,
                   2 if k in ("decode", "streams") else 1) for k in FIGURES]
        failed = len(runs) - len(ok)
        ratios = [spread(run_ratios(runs, r.mode, k)) for k in FIGURES]
        # throughput, its ratios, then TTFT and its ratios (the first nine columns keep their places)
        cells = tps[:3] + ratios[:3] + tps[3:] + ratios[3:]
        ready = [x.ready for x in ok if x.ready is not None]
        ready_cell = (f"{min(ready):.1f} / **{statistics.median(ready):.1f}** / {max(ready):.1f}" if ready else "-")
        lines.append(f"| {r.mode} ({r.arcsplit_mode}){f' ({failed} runs failed)' if failed else ''} | "
                     f"{server_flag(ok[0], '-ub') or '-'} | {layers_cell(ok[0])} | {' | '.join(cells)} | "
                     f"{us_cell(token_cost_us(runs, r.mode))} | {greedy_cell(r, native)} | "
                     f"{ready_cell} | "
                     f"{spread(run_ratios(runs, r.mode, 'ready'))} |")
    return lines


def report(a: argparse.Namespace, runs: list[list[ModeResult]], build: str, mach: str, cmdline: str,
           eq_ub: int) -> str:
    results = runs[0]
    native = native_of(results)
    nat = {k: native.median(k) if native else None for k in FIGURES}
    native_label = ("mode single, one card: one llama-server runs the whole model on its own CPU (the CPU build "
                    "has no multi-device mode)" if a.backend == "cpu"
                    else "mode single on that GPU: one llama-server holding the whole model" if a.same_card
                    else "mode multi: one llama-server holding every GPU (llama.cpp's own multi-device split)")
    threads = (f"{a.threads} per process (llama-server and every rpc-server; arcsplit's default is cores / cards)"
               if a.threads else "llama.cpp's and arcsplit's defaults")
    ub = f"{a.ubatch} in every mode (--ubatch)" if a.ubatch else "chosen per route by arcsplit (column -ub)"
    lines = [f"# Throughput per mode ({a.backend})", "",
             f"- Build: {build}" + (f"; modes ending -alt: {build_line(a.alt_llama_dir, a.backend)}"
                                    if a.alt_llama_dir else ""),
             f"- Machine: {mach}",
             f"- Model: `{a.model}` ({Path(a.model).stat().st_size / 2**20:.0f} MiB)",
             f"- Command: `{cmdline}`",
             f"- Settings: --gpus {a.gpus}, ctx {a.ctx}, -np {STREAMS} (unified KV), `-fa on` (the plan's), -ub {ub}, "
             f"threads {threads}; {a.reps} repetitions after 1 warm-up, medians; prefill = {PROMPT_TOKENS}-token "
             f"prompt, n_predict 1, no prompt cache; decode = n_predict {a.n_predict}, eos ignored; {STREAMS} streams "
             f"= {STREAMS} concurrent decode requests, total tokens / wall time; TTFT = the prefill request's wall time "
             "on the client's clock (cache off), and the same prompt's with cache_prompt true right after the streams "
             f"(cache on); each repetition ends with {STREAMS} unmeasured streams of {SCATTER_TOKENS} tokens, so every "
             "prefill follows parallel streams." + (
                 " **--pattern lru**: the prompt is 512 random token ids, one 64-token request warms up, each "
                 "repetition is prefill, a 3-token prompt, decode, streams (the first not counted); no cache-on TTFT."
                 if a.pattern == "lru" else ""),
             f"- native = {native_label}; hybrid = llama-server holds the first card itself, one rpc-server per "
             "other card; rpc = one rpc-server per card; a `-stock` row is the same mode and build with "
             "arcsplit's llama.cpp patches switched off (ARCSPLIT_RPC_STOCK=1); `-last` keeps the output layer on "
             "the last card (llama.cpp's place, the default), `-local` puts it on llama-server's own card "
             "(`-ot ^output=CUDA0`); `-nospin` turns the link's polling off (ARCSPLIT_RPC_SPIN_US=0, patch 0005; "
             f"the other RPC rows poll {rpc_spin_us(Route.build('rpc', a.backend, a.gpu_list), os.cpu_count() or 1)} us, "
             "arcsplit's choice "
             "here); `-norelay` sends an activation between two rpc-servers whole instead of in chunks "
             "(ARCSPLIT_RPC_RELAY_KIB=0, patch 0007); `-noshm` links llama-server and the rpc-servers over "
             "loopback TCP instead of shared memory (ARCSPLIT_RPC_SHM=0, patch 0008); `-syncset` makes each rpc-server wait for every graph input's copy to its device "
             "instead of queueing it (ARCSPLIT_RPC_QUEUED_SETS=0, patch 0003); `-copyset` makes llama-server copy a "
             "SET_TENSOR's data into a block of its own before it is sent instead of sending one of 256 KiB or more "
             "from where it lies (ARCSPLIT_RPC_IN_PLACE=0, patch 0014); `-hostembd` / `-cardembd` hold an all-RPC "
             "group's token embeddings on llama-server's CPU (ARCSPLIT_INPUT_ON_CARD=0, each prompt token's embedding "
             "crosses the link) or on its first card (=1, patch 0015: token ids cross); `-nospan` moves a KV sequence "
             "the prompt cache saves or restores one run of cells per call instead of in spans (ARCSPLIT_KV_GAP_KIB=0, "
             "patch 0010); `-load` loads a cached prompt into the slot of a request with cache_prompt false and drops "
             "it, as stock llama-server does (ARCSPLIT_SKIP_UNUSED_LOAD=0, patch 0011); `-nopin` reads llama-server's "
             "card into ordinary memory instead of page-locked blocks before it goes to an rpc-server "
             "(ARCSPLIT_RPC_PINNED=0, patch 0001); `-syncread` makes llama-server wait for an activation's source "
             "(its own card in hybrid, the first rpc-server in all-RPC's relay) before it goes to an rpc-server "
             "instead of queueing the read, and each rpc-server wait for a repeated graph before its next command "
             "(ARCSPLIT_RPC_ASYNC_READ=0, patches 0001, 0003 and 0007); `-gate` turns gated sets on (arcsplit's "
             "default on all-RPC CUDA routes of one machine, off elsewhere): llama-server announces an activation "
             "bound for an rpc-server before its data, so an rpc-server whose device can wait on a host word (CUDA) "
             "launches its graph first (ARCSPLIT_RPC_GATE=1, patches 0001, 0003, 0007 and 0009), a graph input from "
             "llama-server's host memory not gated; `-nogate` turns them off (ARCSPLIT_RPC_GATE=0); `-gatehost` gates "
             "a graph input from host memory from 256 KiB up too (a prompt's embeddings on all-RPC's first "
             "rpc-server; ARCSPLIT_RPC_GATE_HOST_KIB=256), `-gatenohost` never (4 GiB, said explicitly); `-alt` runs that mode on the build "
             "`--alt-llama-dir` names (the Build line gives both); `-neighbour` runs it while an idle ggml-rpc-server "
             "holds the card (one more MPS client); `-nocram` runs llama-server with "
             "`--cache-ram 0` (no host-memory prompt cache); `-nokvu` adds `--no-kv-unified` (a KV stream per slot); "
             "`-lv3` runs llama-server at llama.cpp's default log verbosity instead of arcsplit's `-lv 4`; `-card` "
             "lets an all-RPC llama-server see the rpc-servers' card (its host buffers page-locked; it computes "
             "nothing there); `-embd` puts an all-RPC route's token embeddings on the first rpc-server (`-ot "
             "token_embd.weight=RPC0[endpoint]`: a prompt's token ids cross the link, not its embedding rows; llama.cpp "
             "turns pipeline parallelism off for any `-ot`), `-nopp` turns pipeline parallelism off and moves nothing "
             "(`-ot` of the output norm onto its own card); `-bs` runs llama-server with `--backend-sampling` (sampling in the "
             "output card's graph); `-ubN` runs that mode at "
             "-ub N." + (
                 " On CPU the planner leaves as few layers as it can on llama-server's own CPU card (layers not in "
                 "-ngl stay there)." if a.backend == "cpu" else ""), ""]
    if a.same_card:
        lines[-2] += (f" Same card (--same-card): llama-server and the rpc-servers of every RPC row share GPU "
                      f"{a.gpu_list[0]}, each route planned as {a.same_card_cards} cards of half its memory; the "
                      "ratios are the RPC route's own cost (link, processes), not a second card's speed.")
    if len(runs) > 1:
        lines[-2] += (f" {len(runs)} independent runs (every mode a fresh group of processes per run, the first "
                      "mode first in each run, the others' order rotated by one per run); t/s cells: median over "
                      "runs of each run's median; ratio cells: min / **median** / max over runs of the mode's "
                      "median over the same run's native.")
        lines += spread_table(runs) + paired_table(runs, a.mode_list)
    else:
        lines += ["| mode | -ub | -ngl (-ts) | prefill t/s | decode t/s | 4 streams t/s | prefill / native | "
                  "decode / native | 4 streams / native | TTFT ms | TTFT ms, cache on | TTFT / native | "
                  "TTFT cache on / native | greedy = native |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            if r.error:
                lines.append(f"| {r.mode} ({r.arcsplit_mode}) | | | failed: {r.error} | | | | | | | | | | |")
                continue
            med = {k: r.median(k) for k in FIGURES}
            vals = [fmt(med[k], 2 if k in ("decode", "streams") else 1) for k in FIGURES]
            rats = [ratio(med[k], nat[k]) for k in FIGURES]
            lines.append(f"| {r.mode} ({r.arcsplit_mode}) | {server_flag(r, '-ub') or '-'} | {layers_cell(r)} | "
                         + " | ".join(vals[:3] + rats[:3] + vals[3:] + rats[3:]) + f" | {greedy_cell(r, native)} |")
    lines += ["", "Every repetition (t/s):", ""]
    for k, run in enumerate(runs, 1):
        for r in run:
            if not r.error:
                lines.append(f"- {f'run {k}, ' if len(runs) > 1 else ''}{r.mode}: ready after "
                             f"{fmt(r.ready, 2)} s; prefill "
                             f"{', '.join(f'{x:.1f}' for x in r.prefill)}; decode "
                             f"{', '.join(f'{x:.2f}' for x in r.decode)}; 4 streams "
                             f"{', '.join(f'{x:.2f}' for x in r.streams)}; TTFT ms "
                             f"{', '.join(f'{x:.1f}' for x in r.ttft)}; cache on "
                             f"{', '.join(f'{x:.1f}' for x in r.ttft_cache)}")
            else:
                lines.append(f"- {f'run {k}, ' if len(runs) > 1 else ''}{r.mode}: failed: {r.error}")
    uneven = uneven_reps(runs, a.max_rep_spread) if a.max_rep_spread else []
    if a.max_rep_spread:
        lines += ["", f"Repetitions of one mode within {a.max_rep_spread:g}x of each other (--max-rep-spread): "
                  + ("**FAILED**, the bench exits 3: " + "; ".join(uneven) if uneven else "yes, in every run") + "."]
    extra = f" and `{shlex.join(a.equality_args)}`" if a.equality_args else ""
    why = (" (CPU rpc-servers keep weights unrepacked; a local llama-server repacks Q4_K for its own CPU, which "
           "changes rounding)" if a.equality_args else "")
    lines += ["", f"Greedy check: {len(EQUALITY_PROMPTS)} prompts x {a.greedy_tokens} tokens at temperature 0, "
              f"token ids compared with native's; every mode served again with `-ub {eq_ub}`{extra}{why}"
              f"{' (once, after run 1)' if len(runs) > 1 else ''}.", ""]
    if a.backend == "cpu":
        lines += ["Targets (hybrid >= 0.90x decode, >= 0.75x prefill, >= 0.90x 4 streams of native) are set for real "
                  "GPUs. Here every route shares the same CPU cores, so these rows show the RPC route's own costs "
                  "(serialisation, TCP copies, one thread pool per process) and the effect of arcsplit's route "
                  "settings, not a GPU pair.", ""]
    lines += ["The exact commands arcsplit ran (from `server.status()[\"processes\"]`):", ""]
    for r in results:
        for name, argv in r.argv.items():
            lines.append(f"- {r.mode} / {name}: `{shlex.join(argv)}`")
    lines += ["", "Greedy-check runs:", ""]
    for r in results:
        for name, argv in r.greedy_argv.items():
            lines.append(f"- {r.mode} / {name}: `{shlex.join(argv)}`")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cpu", "cuda", "sycl", "vulkan"), default="cpu")
    ap.add_argument("--gpus", default="0,1", help="cards, as for arcsplit serve (default 0,1)")
    ap.add_argument("--model", default=None, help="GGUF to serve (default: the demo Gemma 3 270M)")
    ap.add_argument("--modes", default="native,hybrid,rpc")
    ap.add_argument("--full", action="store_true", help="10 repetitions, n_predict 128 (default: quick)")
    ap.add_argument("--runs", type=int, default=1,
                    help="independent runs of every mode (fresh processes, own native each); ratios min/median/max")
    ap.add_argument("--same-card", action="store_true",
                    help="GPU backends: every route on the one card --gpus names (llama-server and rpc-servers "
                         "share it); native = mode single on it")
    ap.add_argument("--same-card-cards", type=int, default=2, help="cards a --same-card route is planned as")
    ap.add_argument("--rpc-cache", action="store_true", help="rpc-servers keep weights on disk (-c): faster loads")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions (quick 3, full 10)")
    ap.add_argument("--n-predict", type=int, default=None, help="decode tokens per request (quick 32, full 128)")
    ap.add_argument("--greedy-tokens", type=int, default=None, help="tokens per greedy check (default n-predict)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every process, native included (CPU default: cores / cards, arcsplit's "
                         "rpc-server default; 0 = leave llama.cpp's and arcsplit's defaults)")
    ap.add_argument("--ubatch", type=int, default=None,
                    help="-ub for every mode, planned for (default: arcsplit's choice per route)")
    ap.add_argument("--cpu-memory-mib", type=int, default=None)
    ap.add_argument("--llama-dir", default=None)
    ap.add_argument("--alt-llama-dir", default=None, help="the build the modes ending -alt run on")
    ap.add_argument("--max-rep-spread", type=float, default=2.0,
                    help="exit 3 when one mode's repetitions in a run differ by more than this factor (0: no check)")
    ap.add_argument("--pattern", choices=("bench", "lru"), default="bench",
                    help="bench: text prompt, a discarded warm-up repetition, TTFT with the cache off and on; lru: "
                         "random token ids, a 64-token warm-up and a 3-token prompt between prefills (no cache-on "
                         "TTFT), the request pattern that once made all-RPC MoE prefill bimodal")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="default bench/results/throughput_<backend>.md")
    a = ap.parse_args(argv)
    a.reps = a.reps if a.reps is not None else (10 if a.full else 3)
    a.n_predict = a.n_predict if a.n_predict is not None else (128 if a.full else 32)
    a.greedy_tokens = a.greedy_tokens or a.n_predict
    if a.reps < 1 or a.n_predict < 1 or a.runs < 1:
        ap.error("--reps, --runs and --n-predict must be at least 1")
    if a.ubatch is not None and a.ubatch < 1:
        ap.error("--ubatch must be at least 1")
    try:
        a.gpu_list = [int(g) for g in a.gpus.split(",")]
    except ValueError:
        ap.error(f"--gpus {a.gpus!r} is not a list of card indices (write it like 0,1)")
    if a.same_card and (a.backend == "cpu" or len(a.gpu_list) != 1 or a.same_card_cards < 2):
        ap.error("--same-card needs a GPU backend, one card in --gpus and --same-card-cards of at least 2")
    a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.mode_list:
        serve_mode(m, a.backend, a.same_card)
    if any(parse_mode(m).on_alt for m in a.mode_list) and not a.alt_llama_dir:
        ap.error("a mode ending -alt runs on a second build: name it with --alt-llama-dir DIR")
    a.equality_args = ("--no-repack",) if a.backend == "cpu" else ()
    if a.threads is None and a.backend == "cpu":
        # Oversubscribed ggml thread pools spin against each other (and against anything else on the box):
        # give every process, native included, what arcsplit gives each rpc-server.
        a.threads = max(1, (os.cpu_count() or 1) // len(a.gpu_list))
    a.threads = a.threads or None
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.model is None:
        from arcsplit.demo import ensure_demo_model

        a.model = str(ensure_demo_model())
    cmdline = shlex.join(["python", "bench/throughput.py", *(sys.argv[1:] if argv is None else argv)])
    build, mach = build_line(a.llama_dir, a.backend), machine(a.backend)
    if a.backend == "cpu":
        print("native on CPU = arcsplit mode single with one card: one llama-server holding the whole model "
              "on its own CPU", flush=True)
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"throughput_{a.backend}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[list[ModeResult]] = []
    with same_card_rig(a.gpu_list[0], a.same_card_cards) if a.same_card else contextlib.nullcontext():
        for k in range(1, a.runs + 1):
            results = []
            for mode in run_order(a.mode_list, k):
                print(f"{f'run {k}/{a.runs}, ' if a.runs > 1 else ''}{mode}: serving through arcsplit ...", flush=True)
                try:
                    results.append(run_mode(a, mode))
                except Exception as exc:  # one failed mode is a row in the table, not the end of the run
                    amode, _ = serve_mode(mode, a.backend, a.same_card)
                    results.append(ModeResult(mode, amode, error=str(exc).splitlines()[0][:200]))
                    print(f"  {mode} failed: {exc}", flush=True)
                    traceback.print_exception(exc, file=sys.stdout)  # an ExceptionGroup's members too, for the log
                    sys.stdout.flush()
            results.sort(key=lambda r: a.mode_list.index(r.mode))  # the table's order, whatever the run's
            runs.append(results)
            if k == 1:
                print("greedy check ...", flush=True)
                eq_ub = check_greedy(a, results)
            # after every run, so a run cut short still leaves the finished runs on disk
            text = report(a, runs, build, mach, cmdline, eq_ub)
            out.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out}")
    if not all(r.error is None for results in runs for r in results):
        return 1
    uneven = uneven_reps(runs, a.max_rep_spread) if a.max_rep_spread else []
    for line in uneven:
        print(f"uneven repetitions: {line}", flush=True)
    return 3 if uneven else 0


if __name__ == "__main__":
    sys.exit(main())
