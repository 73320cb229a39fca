"""ModelProfile + cards + options -> Plan. Pure: no processes, no I/O.

The value types below are the contract the rest of arcsplit (specs, supervisor, surfaces) relies on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from . import memory
from .errors import BadInput, DoesNotFit, example, given
from .memory import UNCHECKED_COMPUTE_MARGIN
from .rig import Card, Host, Rig
from .route import HOST_DEVICE, NATIVE_UBATCH  # llama-server's own CPU: layers planned there are simply not offloaded

TOKEN_ID_BYTES = 4  # a token's id (int32): what crosses to a card holding the input layer, per token
OUTPUT_TENSORS = r"^output"
"""llama.cpp ``-ot`` pattern (regex_search on tensor names) of the output layer's own tensors: output.weight,
output_norm.weight (and their biases). A tied output (no output.weight) is token_embd, which this does not move."""


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for; ``n_ctx=None`` means the largest context that fits."""

    n_ctx: int | None = None
    n_parallel: int = 1
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    n_batch: int = 2048
    n_ubatch: int = NATIVE_UBATCH
    flash_attn: bool = True
    swa_full: bool = False
    n_outputs: int | None = None  # logits rows the graph is reserved for; None: one per slot, as llama-server does
    # The output layer (final norm + output matrix) on the first card instead of the last. In a hybrid group the
    # first card is llama-server's own, so the logits (n_vocab floats a row) are made where they are read and only
    # the final hidden rows (n_embd floats) cross the RPC link. llama.cpp puts it on the last card; ``-ot`` moves it.
    # None (auto, when the last card is on another host): the first card unless the model ties its output to the
    # token embeddings, which -ot cannot move (then the last, with a warning); the plan holds the answer.
    output_on_first: bool | None = False
    # The input layer (token embeddings and the model's other input tensors) on the first card instead of llama-server's
    # CPU (patch 0015, ARCSPLIT_INPUT_ON_CARD): a prompt then reaches an all-RPC group's first rpc-server as token ids,
    # 4 bytes a token, not n_embd floats. Only where every layer is offloaded (no CPU card first).
    input_on_first: bool = False
    # MoE expert offload: the routed experts of the first ``moe_offload`` layers stay in llama-server's host RAM
    # (``--n-cpu-moe N``); attention, norms, router and shared experts stay on the cards. None: the fewest layers
    # that make the model fit (0 when it fits as it is). ``host_budget``: bytes of host RAM the plan may use there
    # (None: not checked).
    moe_offload: int | None = 0
    host_budget: int | None = None


@dataclass(frozen=True)
class CardPlan:
    """One card's share: layers ``[first_layer, end_layer)`` and the bytes they need there."""

    card: Card
    device: str
    first_layer: int
    end_layer: int
    weights: int
    kv: int
    state: int
    compute: int
    has_output: bool = False
    # where ``compute`` comes from: "measured cpu" (llama.cpp's own dry run, cached), "formula", "formula +50%"
    # (an architecture the formulas were never checked on), then "+6 rows cuda" (the backend's row, memory.backend_compute)
    compute_source: str = "formula"

    @property
    def n_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute

    @property
    def free_after(self) -> int:
        return self.card.free_bytes - self.total

    @property
    def largest(self) -> str:
        """The term that dominates this card: weights, kv, state or compute."""
        terms = {"weights": self.weights, "kv": self.kv, "state": self.state, "compute": self.compute}
        return max(terms, key=terms.__getitem__)


# What a link to another host is assumed to carry when its [[hosts]] entry gives no bandwidth_gbit: a gigabit LAN.
# An ssh forward also encrypts: one stream of OpenSSH's AES-GCM or ChaCha20 moves a few Gbit/s per core, so past
# that the forward's CPU, not the wire, is the limit (no measurement of it here).
DEFAULT_LINK_GBIT = 1.0
# Prefill over a link is called dominant below this many tokens/s: one modern GPU prefills a mid-size model at a
# few thousand tokens/s, so below it the link, not the cards, sets the prompt speed. An assumption, not measured.
PREFILL_DOMINATES_TPS = 1000.0


MASK_START = 256  # KV cells of the attention mask at an empty context (llama.cpp pads n_kv to 256)


@dataclass(frozen=True)
class LinkCost:
    """The traffic between this machine and one other host, from the plan's layer order. llama.cpp's RPC relays
    everything through llama-server: an activation leaving a card there is read back here (a blocking get: one
    round trip) and sent on to the next card (queued, no wait), also between two cards of that same host. Each
    card there with attention layers also gets the attention mask of every ubatch (n_kv x 2 bytes per token with
    flash attention, 4 without; one mask per kind, full and sliding-window), which grows with the context in use:
    the byte counts below are at a full context, the worst case. Measured against the rpc-servers' own logs in
    bench/results/link_bytes.md."""

    host: str
    link: str  # "ssh" | "direct"
    gbit: float  # bandwidth assumed for the estimates
    gbit_given: bool  # from the host's bandwidth_gbit (else DEFAULT_LINK_GBIT)
    rpc_servers: int  # processes there: one per card, or one for all of them (rpc_servers = "per-host")
    graph_computes: int  # one per card there per ubatch (sent, not waited for): ggml-rpc computes per device
    act_bytes: int  # one token's activations crossing once: n_embd x 4 bytes
    act_crossings: int  # how often every token's activations cross this link (both directions)
    out_crossings: int  # crossings of output rows only (after the last layer picked them): 0 rows in mid-prompt
    logits_bytes: int  # per output row when the output layer is over there (n_vocab x 4), else 0
    masks: tuple[int, int]  # that host's cards with full-attention layers, with sliding-window ones (a mask each)
    mask_elem: int  # bytes per mask cell: 2 with flash attention (f16), else 4
    kv_cells: int  # KV cells of a full context (per stream)
    swa_cells: int  # of the sliding-window cache
    gets: int  # blocking gets per ubatch
    out_gets: int  # more of them in a ubatch with output rows (a decoded token; a prompt's last ubatch)
    n_ubatch: int
    n_ctx: int
    id_crossings: int = 0  # a token's id (4 bytes) crossing to a card there holding the input layer (input_on_first)

    def mask_at(self, cells: int) -> int:
        """Attention-mask bytes per token for that host's cards when ``cells`` KV cells are in use."""
        full, swa = self.masks
        return self.mask_elem * (full * min(cells, self.kv_cells) + swa * min(cells, self.swa_cells))

    @property
    def mask_bytes(self) -> int:
        """At a full context."""
        return self.mask_at(self.kv_cells)

    @property
    def round_trips(self) -> int:
        """Blocking exchanges per decoded token."""
        return self.gets + self.out_gets

    @property
    def token_bytes(self) -> int:
        """Bytes over the link per decoded token at a full context."""
        return (self.act_bytes * (self.act_crossings + self.out_crossings) + TOKEN_ID_BYTES * self.id_crossings
                + self.mask_bytes + self.logits_bytes)

    @property
    def ubatch_bytes(self) -> int:
        """Bytes over the link per prefill ubatch at a full context (a prompt's last row of output on top)."""
        return (self.act_bytes * self.act_crossings + TOKEN_ID_BYTES * self.id_crossings + self.mask_bytes) * self.n_ubatch

    def _ms(self, n: float) -> float:
        return n * 8 / (self.gbit * 1e9) * 1e3

    @property
    def token_ms(self) -> float:
        """Transfer time of a decoded token's bytes at the assumed bandwidth (round-trip latency not included)."""
        return self._ms(self.token_bytes)

    @property
    def ubatch_ms(self) -> float:
        return self._ms(self.ubatch_bytes)

    def prefill_tps(self, mask: float) -> float | None:
        """The most prompt tokens/s this link carries with ``mask`` bytes of mask per token (None: nothing crosses)."""
        per_token = self.act_bytes * self.act_crossings + TOKEN_ID_BYTES * self.id_crossings + mask
        return self.gbit * 1e9 / 8 / per_token if per_token else None

    @property
    def prefill_tps_start(self) -> float | None:
        """At an empty context (llama.cpp pads the cells in use to 256)."""
        return self.prefill_tps(self.mask_at(MASK_START))

    @property
    def prefill_tps_full(self) -> float | None:
        """Averaged over a prompt that fills the context (the mask grows from 256 cells to all of them)."""
        return self.prefill_tps((self.mask_at(MASK_START) + self.mask_bytes) / 2)

    def to_dict(self) -> dict[str, Any]:
        start, full = self.prefill_tps_start, self.prefill_tps_full
        return {"host": self.host, "link": self.link, "gbit": self.gbit, "gbit_given": self.gbit_given,
                "rpc_servers": self.rpc_servers, "n_ctx": self.n_ctx,
                "token": {"bytes": self.token_bytes,
                          "activation_bytes": self.act_bytes * (self.act_crossings + self.out_crossings),
                          "token_id_bytes": TOKEN_ID_BYTES * self.id_crossings,
                          "mask_bytes": self.mask_bytes, "logits_bytes": self.logits_bytes,
                          "round_trips": self.round_trips, "ms": round(self.token_ms, 3)},
                "ubatch": {"tokens": self.n_ubatch, "bytes": self.ubatch_bytes, "round_trips": self.gets,
                           "graph_computes": self.graph_computes, "ms": round(self.ubatch_ms, 3)},
                "prefill_tps_max": {"empty_context": round(start) if start else None,
                                    "full_prompt": round(full) if full else None}}


def _masks(profile: Any, card: "CardPlan") -> tuple[int, int]:
    """The attention masks a card gets each ubatch: (full, sliding-window), 1 when it holds such a layer."""
    layers = range(card.first_layer, min(card.end_layer, profile.n_layer))
    full = any(profile.has_kv[il] and not profile.is_swa[il] for il in layers)
    swa = any(profile.has_kv[il] and profile.is_swa[il] for il in layers)
    return int(full), int(swa)


def link_costs(profile: Any, cards: tuple["CardPlan", ...], hosts: tuple[Host, ...], options: "PlanOptions",
               cs: Any) -> tuple[LinkCost, ...]:
    """Per other host, what crosses its link: the layer path starts at llama-server (token embeddings, or their ids where
    the first card holds the input layer) and visits each
    card holding layers in order; the last layer keeps only the output rows, which go on to the output layer's card
    when that is another one (the first, with -ot); llama-server reads the logits there. Each card over there gets
    its attention masks. Between two cards of one rpc-server (a per-host host) the activation never leaves that host:
    llama-server asks it to copy (ggml-rpc.cpp RPC_CMD_COPY_TENSOR, same dispatcher), one blocking round trip."""
    remote = list(dict.fromkeys(c.card.host for c in cards if c.card.host))
    shared = {h.name for h in hosts if h.per_host}
    if not remote:
        return ()
    n_layer = profile.n_layer
    layered = [c for c in cards if min(c.end_layer, n_layer) > c.first_layer]
    out = next((c for c in cards if c.has_output), cards[-1])
    crossings = {h: [0, 0] for h in remote}  # every row, output rows only
    ids = dict.fromkeys(remote, 0)  # token ids to the input layer's card (input_on_first), instead of its embeddings
    gets = {h: [0, 0] for h in remote}
    hosts_in_order = [c.card.host for c in layered]
    hops = [(a, b, 0) for a, b in zip(["", *hosts_in_order], hosts_in_order)]
    if layered and out is not layered[-1]:
        hops.append((layered[-1].card.host, out.card.host, 1))
    for a, b, rows in hops:
        if a and a == b and a in shared:
            gets[a][rows] += 1  # the copy's reply; a few hundred bytes of descriptors, not counted
            continue
        if a:
            crossings[a][rows] += 1
            gets[a][rows] += 1
        if b and not a and options.input_on_first:
            ids[b] += 1
        elif b:
            crossings[b][rows] += 1
    logits_at = out.card.host
    if logits_at:
        gets[logits_at][1] += 1
    elem = 2 if options.flash_attn else 4  # llama-graph.cpp build_attn_inp_kq_mask: f16 with flash attention
    by_name = {h.name: h for h in hosts}
    found = []
    for name in remote:
        h = by_name.get(name)
        gbit = h.bandwidth_gbit if h is not None and h.bandwidth_gbit else DEFAULT_LINK_GBIT
        mine = [_masks(profile, c) for c in cards if c.card.host == name]
        found.append(LinkCost(host=name, link=h.link if h is not None else "ssh", gbit=float(gbit),
                              gbit_given=bool(h is not None and h.bandwidth_gbit),
                              rpc_servers=1 if name in shared else len(mine), graph_computes=len(mine),
                              act_bytes=profile.n_embd * 4, act_crossings=crossings[name][0],
                              out_crossings=crossings[name][1],
                              logits_bytes=profile.n_vocab * 4 if logits_at == name else 0,
                              masks=(sum(f for f, _ in mine), sum(w for _, w in mine)), mask_elem=elem,
                              kv_cells=cs.kv_size, swa_cells=cs.swa_size,
                              gets=gets[name][0], out_gets=gets[name][1], n_ubatch=options.n_ubatch,
                              n_ctx=cs.n_ctx, id_crossings=ids[name]))
    return tuple(found)


def _link_warnings(profile: Any, cards: tuple["CardPlan", ...], links: tuple[LinkCost, ...]) -> list[str]:
    """Prefill the link would dominate, and an output layer left on another host."""
    out = []
    for lc in links:
        full, start = lc.prefill_tps_full, lc.prefill_tps_start
        if full is not None and full < PREFILL_DOMINATES_TPS:
            assumed = "given" if lc.gbit_given else "assumed; set bandwidth_gbit in its [[hosts]] entry"
            out.append(f"prefill over the {lc.link} link to {lc.host} would dominate: at {lc.gbit:g} Gbit/s "
                       f"({assumed}) it carries about {full:,.0f} prompt tokens/s over a prompt that fills the {lc.n_ctx:,}-token "
                       f"context ({start or 0:,.0f} at its start; the attention masks grow with the context: a "
                       f"smaller --ctx helps)")
    last = cards[-1]
    if last.has_output and last.card.host and not cards[0].card.host and len(cards) > 1:
        why = ("the model ties it to the token embeddings, which -ot cannot move" if profile.tied_output
               else "--output-layer last")
        out.append(f"the output layer stays on host {last.card.host} ({why}): every decoded token's logits "
                   f"({profile.n_vocab * 4 / 1024:,.0f} KiB) cross the link")
    return out


@dataclass(frozen=True)
class Plan:
    """Where every layer lives and what each card must hold; cards are in llama.cpp's device order."""

    model_path: str
    arch: str
    n_layer: int
    n_ctx: int
    options: PlanOptions
    cards: tuple[CardPlan, ...]
    host_bytes: int = 0
    warnings: tuple[str, ...] = field(default=())
    host_expert_bytes: int = 0  # routed-expert weights kept in host RAM (options.moe_offload layers)
    host_read_per_token: int = 0  # of those, what one decoded token reads: n_expert_used / n_expert of each layer
    ctx_limit: str = ""  # with --ctx max: what stopped the context from growing (a card's memory, or training)
    card_ctx_max: tuple[int, ...] = ()  # with --ctx max: the largest context each card could hold on this split
    links: tuple[LinkCost, ...] = ()  # one per other host the cards are on (rig.Host), in layer order

    @property
    def offloaded(self) -> tuple[CardPlan, ...]:
        """Cards other than llama-server's own CPU (which keeps the first, non-offloaded layers)."""
        return tuple(c for c in self.cards if c.device != HOST_DEVICE)

    @property
    def tensor_split(self) -> tuple[int, ...]:
        """Integer layer counts per offloaded device: exact in llama.cpp's upper_bound rule."""
        return tuple(c.n_layers for c in self.offloaded)

    @property
    def n_gpu_layers(self) -> int:
        return sum(self.tensor_split)

    def llama_server_args(self, devices: list[str] | None = None,
                          buffers: Mapping[str, str] | None = None) -> list[str]:
        """The placement flags for llama-server. ``devices`` renames the offloaded cards (e.g. RPC0, SYCL0);
        ``buffers``: a device's buffer-type name where it is not the device's own, which ``-ot`` needs (an RPC
        device RPCi's is ``RPC0[host:port]``: its index on that server and its endpoint, ggml-rpc.cpp)."""
        names = devices if devices is not None else [c.device for c in self.offloaded]
        o = self.options
        args: list[str] = []
        if names:
            args += ["--device", ",".join(names)]
        else:
            args += ["--device", "none"]
        args += ["-ngl", str(self.n_gpu_layers)]
        if len(self.tensor_split) > 1:
            args += ["-ts", ",".join(str(n) for n in self.tensor_split)]
            args += ["-sm", "layer"]
        args += ["-c", str(self.n_ctx), "-np", str(o.n_parallel)]
        args += ["--kv-unified"] if o.kv_unified else ["--no-kv-unified"]
        args += ["-b", str(o.n_batch), "-ub", str(o.n_ubatch)]
        args += ["-ctk", o.cache_type_k, "-ctv", o.cache_type_v]
        args += ["-fa", "on" if o.flash_attn else "off"]
        if o.swa_full:
            args += ["--swa-full"]
        if o.output_on_first:
            first = HOST_DEVICE if self.cards[0].device == HOST_DEVICE else names[0]
            args += ["-ot", f"{OUTPUT_TENSORS}={(buffers or {}).get(first, first)}"]
        if o.moe_offload:
            args += ["--n-cpu-moe", str(o.moe_offload)]
        args += ["--fit", "off"]
        return args

    def to_dict(self) -> dict[str, Any]:
        """The --json contract: n_ctx, tensor_split, cards (llama.cpp order), llama_server_args."""
        return {
            "model": self.model_path,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_ctx": self.n_ctx,
            "n_gpu_layers": self.n_gpu_layers,
            "tensor_split": list(self.tensor_split),
            "options": asdict(self.options),
            "host_bytes": self.host_bytes,
            "moe_offload": {"layers": self.options.moe_offload or 0, "host_expert_bytes": self.host_expert_bytes,
                            "host_read_per_token": self.host_read_per_token},
            "cards": [
                {
                    "device": c.device,
                    "backend": c.card.backend,
                    "index": c.card.index,
                    "name": c.card.name,
                    "pci": c.card.pci,
                    "host": c.card.host,
                    "layers": [c.first_layer, c.end_layer],
                    "has_output": c.has_output,
                    "free": c.card.free_bytes,
                    "margin": c.card.margin_bytes,
                    "bytes": {
                        "weights": c.weights,
                        "kv": c.kv,
                        "state": c.state,
                        "compute": c.compute,
                        "total": c.total,
                    },
                    "compute_source": c.compute_source,
                    "free_after": c.free_after,
                    "largest": c.largest,
                }
                for c in self.cards
            ],
            "llama_server_args": self.llama_server_args(),
            "ctx_limit": self.ctx_limit,
            "card_ctx_max": list(self.card_ctx_max),
            "links": [lc.to_dict() for lc in self.links],
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------------------------------------
# the solver

GiB = 1024**3
_MiB = 1024**2


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / _MiB:.0f} MiB"


@dataclass(frozen=True)
class _Costs:
    """Per-layer bytes at one context size; index n_layer is the output layer."""

    cs: Any
    weights: tuple[int, ...]
    kv: tuple[int, ...]
    state: tuple[int, ...]
    prefix: tuple[tuple[int, int, int], ...] = ()  # running sums of (weights, kv, state): a card's sum in O(1)
    memo: dict[tuple[int, int, int], tuple[int, int, int, int]] = field(default_factory=dict, compare=False, repr=False)


def _costs(profile: Any, options: PlanOptions, n_ctx: int) -> _Costs:
    """With ``output_on_first`` the output unit (still the last of llama.cpp's -ts units) weighs nothing there:
    its bytes are the first card's (see _Solver._card_bytes)."""
    cs = memory.context_sizes(profile, n_ctx, options.n_parallel, options.kv_unified, options.n_ubatch, options.swa_full)
    w, k, s = [], [], []
    n_off = options.moe_offload or 0
    for il in range(profile.n_layer):
        w.append(memory.weight_layer_bytes(profile, il) - (profile.expert_bytes[il] if il < n_off else 0))
        k.append(memory.kv_layer_bytes(profile, il, cs, options.cache_type_k, options.cache_type_v, options.flash_attn))
        s.append(memory.state_layer_bytes(profile, il, cs))
    w.append(0 if options.output_on_first else profile.output_bytes)
    k.append(0)
    s.append(0)
    prefix = [(0, 0, 0)]
    for x, y, z in zip(w, k, s):
        pw, pk, ps = prefix[-1]
        prefix.append((pw + x, pk + y, ps + z))
    return _Costs(cs, tuple(w), tuple(k), tuple(s), tuple(prefix))


_INF = float("inf")


class _Solver:
    def __init__(self, profile: Any, cards: tuple[Card, ...], names: list[str], options: PlanOptions,
                 measured: Any = None) -> None:
        self.measured = measured
        self.profile = profile
        self.cards = cards
        self.names = names
        self.options = options
        self.host = names[0] == HOST_DEVICE
        self.n_units = profile.n_layer + 1
        self.budgets = [c.budget_bytes for c in cards]
        gpu_cards = len(cards) - (1 if self.host else 0)
        o = options
        # llama.cpp turns pipeline parallelism off when any tensor is overridden (-ot, --n-cpu-moe)
        self.pipeline = gpu_cards > 1 and not o.output_on_first and not o.moe_offload
        n_out = o.n_outputs if o.n_outputs is not None else max(1, o.n_parallel)
        self._shape = memory.ComputeShape(o.n_ubatch, min(n_out, o.n_ubatch), o.flash_attn, self.pipeline)
        self._quant_kv = any(memory.CACHE_TYPES[t][0] > 1 for t in (o.cache_type_k, o.cache_type_v))

    def shape(self) -> Any:
        return self._shape

    def card_bytes(self, costs: _Costs, j: int, a: int, b: int) -> tuple[int, int, int, int]:
        """(weights, kv, state, compute) of card j holding units [a, b)."""
        key = (j, a, b)
        hit = costs.memo.get(key)
        if hit is None:
            hit = costs.memo[key] = self._card_bytes(costs, j, a, b)
        return hit

    def has_output(self, j: int, a: int, b: int) -> bool:
        """Whether card j, holding units [a, b), computes the output layer."""
        if self.options.output_on_first:
            return j == 0
        return b == self.n_units and a < b

    def _card_bytes(self, costs: _Costs, j: int, a: int, b: int) -> tuple[int, int, int, int]:
        has_out = self.has_output(j, a, b)
        extra = self.profile.output_bytes if has_out and self.options.output_on_first else 0
        if j == 0 and self.options.input_on_first:
            extra += self.profile.host_bytes  # its compute buffer shrinks (no embeddings copied in): left as it was
        if self.host and j == 0:
            # llama-server's CPU keeps these layers; its compute buffer also builds every card's inputs
            comp = memory.host_compute_bytes(self.profile, costs.cs, self._shape)
            if has_out:
                comp += memory.compute_bytes(self.profile, costs.cs, 0, 0, True, self._shape)
            extra += self.profile.host_bytes
        else:
            busy = b > a or has_out
            comp = self.compute(costs, j, a, b)[0] if busy else 0
        (wa, ka, sa), (wb, kb, sb) = costs.prefix[a], costs.prefix[b]
        return (wb - wa + extra, kb - ka, sb - sa, comp)

    def compute(self, costs: _Costs, j: int, a: int, b: int) -> tuple[int, str]:
        """(compute buffer, its source) of card j holding units [a, b): llama.cpp's own measurement where one was
        taken for exactly this range (arcsplit plan --measure), else the formulas, which add their margin on an
        architecture they were not checked on; then what the backend needs beyond them (data/compute_backends.toml),
        unless measured on that backend."""
        has_out = self.has_output(j, a, b)
        backend = memory.backend_compute(self.cards[j].backend)
        got = None
        if self.measured is not None:
            got = memory.measured_compute(self.measured, self.profile, costs.cs, j, a, b, has_out, self._shape,
                                          self.options.moe_offload or 0)
        if got is not None:
            source = f"measured {self.measured.backend}"
            if self.measured.backend == backend.backend:
                return got, source
        else:
            got = memory.compute_bytes(self.profile, costs.cs, a, min(b, self.profile.n_layer), has_out, self._shape)
            source = "formula" if self.profile.compute_checked else f"formula +{memory.UNCHECKED_COMPUTE_MARGIN:.0%}"
        rows = self.profile.n_embd * min(self._shape.n_ubatch, costs.cs.n_ctx) * 4
        quant = self._quant_kv
        return backend.apply(got, rows, costs.cs.n_ctx if quant else 0), f"{source} {backend.label(quant)}".rstrip()

    def ratio(self, costs: _Costs, j: int, a: int, b: int) -> float:
        """Card j's bytes for units [a, b) as a share of its budget (inf: cannot hold them at any share)."""
        total = sum(self.card_bytes(costs, j, a, b))
        budget = self.budgets[j]
        if budget > 0:
            return total / budget
        return 0.0 if total <= 0 and budget == 0 else _INF

    def fits(self, costs: _Costs, j: int, a: int, b: int, cap: float = 1.0) -> bool:
        return self.ratio(costs, j, a, b) <= cap

    def split(self, costs: _Costs) -> list[int] | None:
        """Boundaries [0, c1, ..., n_units] that fit, spreading layers in proportion to each card's budget."""
        n = self.n_units
        gpus = list(range(1 if self.host else 0, len(self.cards)))
        host_layers = [0]
        if self.host:
            host_layers = [k for k in range(0, n) if self.fits(costs, 0, 0, k)]
            if not host_layers:
                return None
        for k in host_layers:  # as few layers on llama-server's CPU as possible
            bounds = self._split_gpus(costs, gpus, k)
            if bounds is not None:
                return ([0] if self.host else []) + bounds
        return None

    def _greedy(self, costs: _Costs, gpus: list[int], start: int, cap: float) -> tuple[list[int] | None, float]:
        """Fill each card up to ``cap`` of its budget, the last takes the rest: (bounds or None, largest share used).

        Every cap in [largest share used, cap] gives the same bounds: the shares accepted stay accepted and the
        ones refused stay refused, which lets the search below jump instead of halving.
        """
        n = self.n_units
        ratio = self.ratio
        bounds = [start]
        a = start
        used = 0.0
        for idx, j in enumerate(gpus):
            if idx == len(gpus) - 1:
                r = ratio(costs, j, a, n)
                if r > cap:
                    return None, used
                bounds.append(n)
                return bounds, max(used, r)
            b = a
            while b < n - 1:
                r = ratio(costs, j, a, b + 1)
                if r > cap:
                    break
                used = max(used, r)
                b += 1
            bounds.append(b)
            a = b
        return None, used

    def _split_gpus(self, costs: _Costs, gpus: list[int], start: int) -> list[int] | None:
        bounds, hi = self._greedy(costs, gpus, start, 1.0)
        if bounds is None:
            return None
        # smallest share of every budget that still holds the model (proportional fill), to 1/65536 of a budget:
        # bisection, where a cap that fits moves the top down to the share its split really uses
        lo = 0.0
        while hi - lo > 1 / 65536:
            mid = (lo + hi) / 2
            got, used = self._greedy(costs, gpus, start, mid)
            if got is None:
                lo = mid
            else:
                bounds, hi = got, used
        return bounds


def _hosts(rig_or_cards: Any) -> tuple[Host, ...]:
    return rig_or_cards.hosts if isinstance(rig_or_cards, Rig) else ()


def _as_cards(rig_or_cards: Any) -> tuple[Card, ...]:
    if isinstance(rig_or_cards, Rig):
        return rig_or_cards.cards
    if isinstance(rig_or_cards, Card):
        return (rig_or_cards,)
    cards = tuple(rig_or_cards)
    if not cards:
        raise _bad("no cards to plan for", "name at least one card (--gpus or --layout)")
    return cards


def _bad(problem: str, fix: str) -> Exception:
    return BadInput(problem, fix)


def make_plan(profile: Any, rig_or_cards: Any, options: PlanOptions | None = None,
              devices: list[str] | None = None, measured: Any = None) -> Plan:
    """Place every layer (output layer on the last card) so that each card keeps its margin free.

    ``devices`` names the cards as llama-server will see them (RPC0, SYCL1, ...); a card named ``HOST_DEVICE`` is
    llama-server's own CPU and may only come first. With ``options.n_ctx=None`` the largest context that fits
    (up to the training context) is chosen. ``measured`` (memory.MeasuredCompute): llama.cpp's own compute buffers
    for these options, used where a card's layer range was measured. Raises DoesNotFit with the shortfall and what
    would make it fit.
    """
    options = options or PlanOptions()
    cards = _as_cards(rig_or_cards)
    names = list(devices) if devices is not None else [c.device for c in cards]
    if len(names) != len(cards):
        raise _bad(f"{len(names)} device names for {len(cards)} cards", "give one device name per card")
    if HOST_DEVICE in names[1:]:
        raise _bad("llama-server's own CPU can only hold the first layers", "put the CPU card first")
    if options.n_parallel < 1:
        raise _bad(f"--np {options.n_parallel} must be at least 1", "pass --np 1 or more")
    if options.n_ubatch < 1 or options.n_batch < 1:
        raise _bad("batch sizes must be positive", "pass --ubatch N with N > 0")
    memory.check_cache_types(profile, options.cache_type_k, options.cache_type_v, options.flash_attn)
    options = _moe_offload(profile, cards, names, _output_placement(profile, cards, _input_placement(names, options)),
                           measured)
    solver = _Solver(profile, cards, names, options, measured)
    warnings = _model_warnings(profile)

    train = profile.n_ctx_train or 0
    if options.n_ctx is not None:
        ctx = options.n_ctx
        if ctx <= 0:
            raise _bad(f"context {ctx} must be positive", "pass --ctx N with N > 0, or --ctx max")
        costs = _costs(profile, options, ctx)
        bounds = solver.split(costs)
        if bounds is None:
            raise DoesNotFit(*_why(profile, solver, options, ctx))
        if train and ctx > train * options.n_parallel:
            warnings.append(f"context {ctx} is beyond the model's training context {train}")
    else:
        cap = max(256, (train or 4096) * (options.n_parallel if not options.kv_unified else 1))
        if options.kv_unified:
            cap = max(256, (train or 4096) * options.n_parallel)
        cap = memory.pad(cap, 256) if cap % 256 else cap
        lo, hi = 1, cap // 256  # in units of 256 tokens
        costs = _costs(profile, options, hi * 256)
        bounds = solver.split(costs)
        if bounds is not None:
            lo = hi  # the whole training context fits: the common case, one solve
        else:
            costs = _costs(profile, options, 256)
            bounds = solver.split(costs)
            if bounds is None:
                raise DoesNotFit(*_why(profile, solver, options, 256))
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                mid_costs = _costs(profile, options, mid * 256)
                mid_bounds = solver.split(mid_costs)
                if mid_bounds is not None:
                    lo, costs, bounds = mid, mid_costs, mid_bounds
                else:
                    hi = mid - 1
        ctx = lo * 256
        if train and ctx < min(train, 4096):
            warnings.append(f"only {ctx} tokens of context fit (training context {train})")
        limit = _ctx_limit(profile, solver, options, bounds, ctx, cap)
        per_card = _card_ctx_max(profile, solver, options, bounds, ctx, cap)

    plan = _assemble(profile, solver, costs, cards, names, bounds, options, warnings, _hosts(rig_or_cards))
    if options.n_ctx is None:
        plan = replace(plan, ctx_limit=limit, card_ctx_max=per_card)
    if options.host_budget is not None and plan.host_expert_bytes and plan.host_bytes > options.host_budget:
        raise DoesNotFit(f"keeping the experts of {options.moe_offload} layers in host RAM needs {_fmt(plan.host_bytes)} "
                         f"there, but only {_fmt(options.host_budget)} is available",
                         "free host memory, add a card, or use a smaller quantization of the model")
    return plan


def _ctx_limit(profile: Any, solver: "_Solver", options: PlanOptions, bounds: list[int], ctx: int, cap: int) -> str:
    """Why --ctx max stopped at ``ctx``: the training context, or the card that 256 more tokens overflow."""
    if ctx >= cap:
        return f"the model's training context ({cap} tokens)"
    costs = _costs(profile, options, ctx + 256)
    over = []
    for j in range(len(solver.cards)):
        w, k, s, c = solver.card_bytes(costs, j, bounds[j], bounds[j + 1])
        over.append((w + k + s + c - solver.budgets[j], j, k + s, c))
    short, j, kv, comp = max(over)
    return (f"{solver.names[j]}: {ctx + 256} tokens would need {_fmt(short)} more than it has "
            f"(KV/state {_fmt(kv)}, compute {_fmt(comp)} there)")


def _card_ctx_max(profile: Any, solver: "_Solver", options: PlanOptions, bounds: list[int], ctx: int,
                  cap: int) -> tuple[int, ...]:
    """For each card, the largest context (a multiple of 256, at most ``cap``) its layers on this split would fit
    in its budget: the smallest is the context --ctx max chose; the others say how much room each card has left."""
    at: dict[int, _Costs] = {}

    def fits(j: int, n: int) -> bool:
        costs = at.get(n)
        if costs is None:
            costs = at[n] = _costs(profile, options, n * 256)
        return solver.fits(costs, j, bounds[j], bounds[j + 1])

    out = []
    for j in range(len(solver.cards)):
        lo, hi = ctx // 256, cap // 256
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(j, mid) else (lo, mid - 1)
        out.append(lo * 256)
    return tuple(out)


def _moe_offload(profile: Any, cards: tuple[Card, ...], names: list[str], options: PlanOptions,
                 measured: Any = None) -> PlanOptions:
    """Resolve ``moe_offload=None`` (auto) to the fewest leading layers whose routed experts must leave the cards
    for the model to fit at the asked context (or 4096 tokens with --ctx max); check a given count."""

    n = options.moe_offload
    n_main = profile.n_layer_main
    if n is not None and n < 0:
        raise _bad(f"{given('--moe-offload', n)} must be 0 or more",
                   example("pass auto, off or a layer count", "pass None (auto), 0 (off) or a layer count"))
    if not any(profile.expert_bytes):
        if n:
            raise _bad(f"{given('--moe-offload', n)}: this {profile.arch} model has no routed experts",
                       f"use {example('--moe-offload off', 'moe_offload=0')}")
        return replace(options, moe_offload=0)
    if n is not None:
        if n > n_main:
            raise _bad(f"{given('--moe-offload', n)} is more than the model's {n_main} layers", f"pass at most {n_main}")
        return options
    probe = options.n_ctx or min(profile.n_ctx_train or 4096, 4096)

    def fits(k: int) -> bool:
        o = replace(options, moe_offload=k)
        return _Solver(profile, cards, names, o, measured).split(_costs(profile, o, probe)) is not None

    if fits(0):
        return replace(options, moe_offload=0)
    lo, hi = 1, n_main
    if not fits(hi):
        return replace(options, moe_offload=hi)  # does not fit even so: the caller's DoesNotFit says by how much
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return replace(options, moe_offload=lo)


def _assemble(profile: Any, solver: "_Solver", costs: _Costs, cards: tuple[Card, ...], names: list[str],
              bounds: list[int], options: PlanOptions, warnings: list[str], hosts: tuple[Host, ...] = ()) -> Plan:
    """The Plan for layer boundaries ``bounds``: each card's bytes from the solver, the host's share, and what
    crosses the link to each other host."""
    plans = []
    for j, card in enumerate(cards):
        a, b = bounds[j], bounds[j + 1]
        w, k, s, c = solver.card_bytes(costs, j, a, b)
        source = "formula" if solver.host and j == 0 else solver.compute(costs, j, a, b)[1] if c else ""
        plans.append(CardPlan(card=card, device=names[j], first_layer=a, end_layer=b, weights=w, kv=k, state=s,
                              compute=c, has_output=solver.has_output(j, a, b), compute_source=source))
    host = 0 if options.input_on_first else profile.host_bytes
    if not solver.host:
        host += memory.host_compute_bytes(profile, costs.cs, solver.shape())
    n_off = options.moe_offload or 0
    experts = sum(profile.expert_bytes[:n_off])
    if n_off:
        host += experts + memory.moe_compute_bytes(profile, costs.cs, solver.shape())
    share = profile.n_expert_used / profile.n_expert if profile.n_expert else 0.0
    links = link_costs(profile, tuple(plans), hosts, options, costs.cs)
    return Plan(model_path=profile.path, arch=profile.arch, n_layer=profile.n_layer, n_ctx=costs.cs.n_ctx,
                options=options if options.n_ctx == costs.cs.n_ctx else _with_ctx(options, costs.cs.n_ctx),
                cards=tuple(plans), host_bytes=host,
                warnings=(*warnings, *_link_warnings(profile, tuple(plans), links)), host_expert_bytes=experts,
                host_read_per_token=int(experts * share), links=links)


def _input_placement(names: list[str], options: PlanOptions) -> PlanOptions:
    """``input_on_first`` only where layer 0 is on a card: where llama-server's CPU holds it, the input is there."""
    return replace(options, input_on_first=False) if options.input_on_first and names[0] == HOST_DEVICE else options


def _output_placement(profile: Any, cards: tuple[Card, ...], options: PlanOptions) -> PlanOptions:
    """``output_on_first`` only where it means something (two cards or more) and where ``-ot`` can do it; auto
    (None) resolved."""

    if options.output_on_first is False:
        return options
    if len(cards) < 2:
        return replace(options, output_on_first=False)
    if options.output_on_first is None:
        return replace(options, output_on_first=not profile.tied_output)
    if profile.tied_output:
        raise _bad(f"{profile.arch} model ties its output to the token embeddings, so its output layer cannot be "
                   "moved to the first card", "use --output-layer last (or auto)")
    return options


def _with_ctx(options: PlanOptions, n_ctx: int) -> PlanOptions:

    return replace(options, n_ctx=n_ctx)


def _why(profile: Any, solver: _Solver, options: PlanOptions, ctx: int) -> tuple[str, str]:
    """One line: how much is missing, and the cheapest changes that would make it fit."""

    costs = _costs(profile, options, ctx)
    need_w = sum(costs.weights)
    need_kv = sum(costs.kv) + sum(costs.state)
    # compute if everything sat on the last card vs spread: take the spread estimate per card
    n = len(solver.cards)
    per = -(-solver.n_units // n)
    comp = sum(solver.card_bytes(costs, j, min(j * per, solver.n_units), min((j + 1) * per, solver.n_units))[3]
               for j in range(n))
    need = need_w + need_kv + comp
    have = sum(solver.budgets)
    short = max(need - have, 0)
    head = (f"{profile.arch} model needs about {_fmt(need)} at context {costs.cs.n_ctx} (weights {_fmt(need_w)}, "
            f"KV/state {_fmt(need_kv)}, compute {_fmt(comp)}) but the {n} card(s) have {_fmt(have)} free after margins")
    head += f": short by {_fmt(short)}" if short else ": no split of whole layers fits every card"
    fixes = []
    if options.n_ctx is not None and ctx > 256:
        try:
            alt = make_plan(profile, solver.cards, replace(options, n_ctx=None), solver.names)
            fixes.append(f"use --ctx {alt.n_ctx} or less")
        except Exception:
            pass
    if options.cache_type_k == "f16" and options.flash_attn and need_kv > 0:
        alt_o = replace(options, cache_type_k="q8_0", cache_type_v="q8_0")
        try:
            make_plan(profile, solver.cards, alt_o, solver.names)
            fixes.append("quantize the KV cache (--cache-type q8_0)")
        except Exception:
            pass
    if options.n_parallel > 1:
        fixes.append("use fewer slots (--np 1)")
    if any(profile.expert_bytes) and options.moe_offload is not None and options.moe_offload < profile.n_layer_main:
        fixes.append("keep routed experts in host RAM (--moe-offload auto)")
    fixes.append(f"add a card with at least {_fmt(max(short, 256 * _MiB))} free")
    return head, "; or ".join(fixes)


def plan_for_split(profile: Any, rig_or_cards: Any, options: PlanOptions, tensor_split: list[int],
                   devices: list[str] | None = None, measured: Any = None) -> Plan:
    """The bytes per card of a given split (integer layer counts summing to n_layer+1), fitting or not.

    Used to check a pinned layout and to compare against llama-fit-params for the same -ts.
    """
    cards = _as_cards(rig_or_cards)
    names = list(devices) if devices is not None else [c.device for c in cards]
    n_ctx = options.n_ctx
    if n_ctx is None:
        raise _bad("a pinned split needs a context size", "pass --ctx N")
    if len(tensor_split) != len(cards) or any(n < 0 for n in tensor_split) or sum(tensor_split) != profile.n_layer + 1:
        raise _bad(f"tensor split {tensor_split} must give {len(cards)} non-negative counts summing to "
                   f"{profile.n_layer + 1}", "fix the split or let arcsplit plan it")
    memory.check_cache_types(profile, options.cache_type_k, options.cache_type_v, options.flash_attn)
    options = _moe_offload(profile, cards, names, _output_placement(profile, cards, _input_placement(names, options)),
                           measured)
    solver = _Solver(profile, cards, names, options, measured)
    costs = _costs(profile, options, n_ctx)
    bounds = [0]
    for n in tensor_split:
        bounds.append(bounds[-1] + n)
    return _assemble(profile, solver, costs, cards, names, bounds, options, _model_warnings(profile),
                     _hosts(rig_or_cards))


def _model_warnings(profile: Any) -> list[str]:
    """The profile's warnings, and the compute margin where the compute model was never measured."""
    out = list(profile.warnings)
    if not profile.compute_checked:
        out.append(f"compute buffers of {profile.arch!r} are estimated from formulas not checked on this architecture: "
                   f"{UNCHECKED_COMPUTE_MARGIN:.0%} added")
    return out
