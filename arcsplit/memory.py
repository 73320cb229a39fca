"""llama.cpp's memory rules, per layer and per card: weights, KV cache, recurrent state, compute buffers.

Sources (the pinned llama.cpp tree, vendored in llama-cpp-python 0.3.36):
- context sizes: ``llama_context`` ctor (n_ctx padded to 256; per-stream size when the KV is not unified);
- KV: ``llama_kv_cache`` ctor (K and V rows of the cache type, per layer on that layer's device; V padded to the
  widest layer without flash attention; MLA caches K only); SWA layers: ``llama_kv_cache_iswa``;
- recurrent state: ``llama_memory_recurrent`` (f32 rows of n_embd_r + n_embd_s per sequence);
- compute buffers: no closed form in llama.cpp (``graph_reserve``); the model below is calibrated against
  ``llama-fit-params -fitp on`` and real ``llama-server`` loads (bench/plan_accuracy.py).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from .errors import BadInput
from .model import ModelProfile

MiB = 1024 * 1024

# ggml block size and bytes per block (ggml-common.h)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}
PIPELINE_COPIES = 4  # GGML_SCHED_MAX_COPIES


def pad(x: int, n: int) -> int:
    return -(-x // n) * n


def row_bytes(cache_type: str, n: int) -> int:
    """Bytes of one row of ``n`` elements in a cache type (ggml_row_size)."""
    try:
        block, size = CACHE_TYPES[cache_type]
    except KeyError:
        raise BadInput(f"unknown cache type {cache_type!r}", f"use one of {', '.join(CACHE_TYPES)}") from None
    if n % block:
        raise BadInput(
            f"cache type {cache_type} needs rows that are a multiple of {block} elements; this model's are {n}",
            "use f16, bf16 or q8_0 with a model whose head size allows it",
        )
    return n // block * size


@dataclass(frozen=True)
class ContextSizes:
    """What llama_context makes of -c/-np/--kv-unified: cells per stream, streams, SWA cells."""

    n_ctx: int  # after padding (what llama-server reports as n_ctx)
    kv_size: int  # cells per stream of full-attention layers
    n_stream: int
    swa_size: int  # cells per stream of SWA layers
    n_seq: int


def context_sizes(profile: ModelProfile, n_ctx: int, n_parallel: int = 1, kv_unified: bool = True,
                  n_ubatch: int = 512, swa_full: bool = False) -> ContextSizes:
    if n_ctx <= 0:
        raise BadInput(f"context size {n_ctx} must be positive", "pass --ctx N with N > 0, or --ctx max")
    n_seq = max(1, n_parallel)
    ctx = pad(n_ctx, 256)
    if kv_unified:
        kv_size, n_stream = ctx, 1
    else:
        kv_size = pad(ctx // n_seq, 256)
        n_stream = n_seq
        ctx = kv_size * n_seq
    n_ub = min(n_ubatch, ctx)
    if swa_full or not profile.n_swa:
        swa = kv_size
    else:
        swa = pad(min(kv_size, profile.n_swa * (n_seq if kv_unified else 1) + n_ub), 256)
    return ContextSizes(ctx, kv_size, n_stream, swa, n_seq)


def kv_layer_bytes(profile: ModelProfile, il: int, cs: ContextSizes, type_k: str = "f16", type_v: str = "f16",
                   flash_attn: bool = True) -> int:
    """KV cache bytes of layer ``il`` (on the device holding that layer)."""
    if not profile.has_kv[il]:
        return 0
    cells = (cs.swa_size if profile.is_swa[il] else cs.kv_size) * cs.n_stream
    k = row_bytes(type_k, profile.n_embd_k[il]) * cells
    if profile.mla:
        return k
    width = profile.n_embd_v[il] if flash_attn else max(profile.n_embd_v)  # V is transposed and padded without FA
    return k + row_bytes(type_v, width) * cells


def state_layer_bytes(profile: ModelProfile, il: int, cs: ContextSizes) -> int:
    """Recurrent state (conv + ssm, f32) of layer ``il``: one row per sequence."""
    if not profile.is_recurrent[il]:
        return 0
    return (profile.n_embd_r + profile.n_embd_s) * 4 * cs.n_seq


def weight_layer_bytes(profile: ModelProfile, il: int, load_mtp: bool = False) -> int:
    """Weights of layer ``il``; llama.cpp skips NextN/MTP blocks unless MTP drafting is on (they still count as layers)."""
    if il >= profile.n_layer_main and not load_mtp:
        return 0
    return profile.layer_bytes[il]


def check_cache_types(profile: ModelProfile, type_k: str, type_v: str, flash_attn: bool) -> None:
    """Refuse what llama.cpp refuses, before any process starts."""
    for t in (type_k, type_v):
        if t not in CACHE_TYPES:
            raise BadInput(f"unknown cache type {t!r}", f"use one of {', '.join(CACHE_TYPES)}")
    if CACHE_TYPES[type_v][0] > 1 and not flash_attn:
        raise BadInput(f"a quantized V cache ({type_v}) needs flash attention", "turn flash attention on or use -ctv f16")
    if profile.mla and type_k != type_v:
        raise BadInput("MLA models (deepseek2) need the same K and V cache type", f"use --cache-type {type_k} for both")


# Calibrated against llama-fit-params -fitp on (CPU backend over RPC), see bench/plan_accuracy.py. A layer's
# working set is the widest of its phases (ggml-alloc reuses a phase's buffers in the next), in floats per token:
K_FFN = 3.0  # dense FFN: gate, up and their product live together
K_EMBD = 2.5  # residual stream, normed input, attention output
K_MOE_FFN = 2.5  # routed (+ shared) experts: gate/up rows of the experts a token runs
K_MOE_OUT = 1.125  # ... and each used expert's n_embd-wide output before the weighted sum
K_MOE_EMBD = 3.5
K_ATTN_Q = 1.25  # the query projection (gated attention: query and gate) and its per-head copies
K_ATTN_EMBD = 8.0
K_FFN_UP = 1.0  # an FFN without a gate (up, ReLU^2 in place, down): one n_ff-wide row at a time
K_FFN_GDN = K_FFN  # gated delta-net block (qwen3next, qwen35): qkv, conv and their outputs, three conv widths
K_SSM_X = 10.25  # Mamba-2 mixer (mamba2, hybrids of it), per d_inner: z, x, conv and scan outputs, gated norm
K_SSM_BC = 3.25  # ... per element of its B and C groups (2 * n_group * d_state): in_proj, conv, scan inputs
K_SSM_EMBD = 1.0
# The same mixer in an attention hybrid (granitehybrid, nemotron_h, falcon-h1), where the split inputs are counted
# apart (hybrid_ssm_bounce); pure mamba2's K_SSM_* fold its bounce in. Live when z is made contiguous: in_proj's
# output (2 d_inner + B/C groups), the conv's (d_inner + B/C groups), the scan's and z's (d_inner each) and the
# residual (Falcon-H1: and the attention output waiting for the mixer's); ggml-alloc's gaps between them add about
# a quarter (measured from d_inner 1536 to 8192, n_embd 1024 to 4096, 1 to 8 groups).
K_HSSM = 1.25
K_RWKV = 22.5  # RWKV-7 time mix, per n_embd: r, k, v, the five LoRA-mixed inputs, WKV-7 output and state
K_OUT_EMBD = 4.75  # the output layer on one of several devices: final norm, its input rows, logits staging
K_OUT_EMBD_HSSM = 2.0  # the same in a Mamba-2 + attention hybrid, whose output card's split inputs count apart
K_OUT_EMBD_SOLO = 1.0  # the same on a lone device: the graph is one split, only the normed rows stay with the logits
K_NOFA_EMBD = 4.0  # without flash attention, next to the KQ scores, Q and KQV (counted per head) and the residual
K_NOFA_OUT = 4.0  # without flash attention, the last card of a pipeline keeps its last layer's rows for the output
K_NOFA_OUT_HSSM = 2.0  # the same in a Mamba-2 + attention hybrid (its output card's split inputs count apart)
K_MLA_OUT = 6.0  # MLA (absorbed heads): the same on the last card of a pipeline, with flash attention too
# On an architecture whose family the model above was never measured on (model.Family.checked), compute buffers
# get this much on top: the formulas know the common layer shapes, not every graph llama.cpp builds. Measured
# misses on checked families were below 10 %; an unseen graph (extra repeats, chunked scans) can be larger.
UNCHECKED_COMPUTE_MARGIN = 0.5
# Mamba-1 mixer (mamba, jamba), per d_inner: in_proj's x and z, the conv, dt and the scan output (6 d_inner per token
# with K_SSM_EMBD; Mamba-1's d_inner is 2 n_embd). Its gate z crosses card boundaries: see _gate_crossing.
K_MAMBA_X = 5.5
K_RWKV6 = 17.5  # RWKV-6 time mix, per n_embd: the five mixed inputs of its LoRA, r, k, v, g, decay, WKV-6 output


def _margin(profile: ModelProfile, n: int) -> int:
    return n if profile.compute_checked else int(n * (1 + UNCHECKED_COMPUTE_MARGIN))


def mamba2_hybrid(profile: ModelProfile) -> bool:
    """Mamba-2 + attention hybrids (granitehybrid, nemotron_h, falcon-h1): their conv also carries the B/C groups
    (Jamba's Mamba-1 mixers, the same layer kinds, convolve d_inner alone and keep the generic formulas)."""
    return profile.recurrent_kind in ("no_kv", "no_kv_ff", "parallel") and profile.ssm_d_inner > 0 \
        and profile.n_embd_r > max(0, profile.ssm_conv_kernel - 1) * profile.ssm_d_inner


def _mamba1(profile: ModelProfile) -> bool:
    """A Mamba-1 mixer: its conv carries x alone (Mamba-2's also carries the B and C groups)."""
    return profile.ssm_d_inner > 0 and profile.n_embd_r == max(0, profile.ssm_conv_kernel - 1) * profile.ssm_d_inner


def _gate_crossing(profile: ModelProfile, b: int) -> int:
    """Rows per token of the Mamba-1 gate z (d_inner wide) that cross the card boundary before layer ``b``, 0 if none.

    In mamba.cpp / jamba.cpp the gate's ggml_cont enters the graph only when the next mixer layer expands its state
    copies, after that layer's first nodes (its state reads): the scheduler runs it on the next card, so z goes
    there and comes back (split inputs, PIPELINE_COPIES each). Not when experts follow the mixer (build_moe_ffn
    expands its own nodes first) nor when an attention layer comes next (its KV writes pull the tail in before any
    of its own nodes). Seen in GGML_SCHED_DEBUG=2 splits; sizes measured with llama-fit-params on 2 and 4 cards.
    """
    if not _mamba1(profile) or not 0 < b < profile.n_layer_main:
        return 0
    il = b - 1
    crosses = profile.is_recurrent[il] and not profile.expert_bytes[il] and profile.is_recurrent[b]
    return profile.ssm_d_inner if crosses else 0


def layer_rows(profile: ModelProfile, il: int) -> float:
    """Floats per token of layer ``il``'s widest phase: its FFN or experts, its recurrent block, its attention.

    A recurrent layer of a MoE hybrid (qwen3next, qwen35moe) has both a recurrent block and experts; taking only
    the experts was what made those models' compute a third too low.
    """
    e = profile.n_embd
    if profile.n_expert and profile.expert_bytes[il]:
        width = profile.n_expert_used * profile.n_ff_exp + profile.n_ff_shexp
        rows = K_MOE_FFN * width + K_MOE_OUT * e * profile.n_expert_used + K_MOE_EMBD * e
    else:
        rows = (K_FFN if profile.ffn_gate else K_FFN_UP) * profile.n_ff[il] + K_EMBD * e
    if profile.recurrent_kind in ("rwkv", "rwkv6"):
        return max(rows, (K_RWKV6 if profile.recurrent_kind == "rwkv6" else K_RWKV) * e)
    if profile.is_recurrent[il] and profile.n_embd_r:
        conv = profile.n_embd_r // max(1, profile.ssm_conv_kernel - 1)  # d_inner + 2 groups of state
        if profile.recurrent_kind == "interval":
            rows = max(rows, K_FFN_GDN * conv + K_EMBD * e)
        elif mamba2_hybrid(profile):
            x = profile.ssm_d_inner or conv
            embd = 2 if profile.recurrent_kind == "parallel" else 1
            rows = max(rows, K_HSSM * ((x + conv) + conv + 2 * x + embd * e))
        else:
            x = profile.ssm_d_inner or conv
            if _mamba1(profile):
                rows = max(rows, K_MAMBA_X * x + K_SSM_EMBD * e)
            else:
                rows = max(rows, K_SSM_X * x + K_SSM_BC * (conv - x) + K_SSM_EMBD * e)
    if profile.has_kv[il] and profile.n_embd_q[il]:
        rows = max(rows, K_ATTN_Q * profile.n_embd_q[il] + K_ATTN_EMBD * e)
    return rows


def hybrid_ssm_bounce(profile: ModelProfile, first: int, end: int) -> int:
    """Floats per token of split inputs a card of a Mamba-2 + attention hybrid gets from llama.cpp's node order.

    A mixer's tail (z made contiguous onwards) enters the graph only when the next layer that writes its cache
    pulls it in; when that is the next Mamba-2 layer (no attention layer between) and it sits on the next card,
    the scheduler runs that tail's first op there: in_proj's whole output row (2 d_inner + B/C groups + dt) goes to
    that card and the contiguous z (d_inner) comes back, each a split input kept in every pipeline copy.
    Falcon-H1 has attention in every layer, which pulls the tail in on its own card.
    """
    if not mamba2_hybrid(profile) or profile.recurrent_kind == "parallel":
        return 0
    n = profile.n_layer_main
    writes = [il for il in range(n) if profile.is_recurrent[il] or profile.has_kv[il]]
    on_card = [il for il in writes if first <= il < end]
    if not on_card:
        return 0
    before = [il for il in writes if il < first]
    after = [il for il in writes if il >= end]
    x = profile.ssm_d_inner
    conv = profile.n_embd_r // max(1, profile.ssm_conv_kernel - 1)
    got = 0
    if before and profile.is_recurrent[before[-1]] and profile.is_recurrent[on_card[0]]:
        got += x + conv  # in_proj's output row (dt's few heads aside) arrives from the previous card
    if after and profile.is_recurrent[on_card[-1]] and profile.is_recurrent[after[0]]:
        got += x  # z comes back from the next card
    return got


@dataclass(frozen=True)
class ComputeShape:
    """What a card's compute buffer depends on besides its layers."""

    n_ubatch: int = 512
    n_outputs: int = 1  # rows of logits the graph is reserved for: llama-server reserves one per slot
    flash_attn: bool = True
    pipeline: bool = False  # several devices, output layer offloaded: the scheduler keeps 4 copies of inputs


def compute_bytes(profile: ModelProfile, cs: ContextSizes, first: int, end: int, has_output: bool,
                  shape: ComputeShape) -> int:
    """Compute buffer of a card holding layers [first, end) (+ the output layer when ``has_output``)."""
    if end <= first and not has_output:
        return 0
    t = min(shape.n_ubatch, cs.n_ctx)
    e = profile.n_embd
    layers = range(first, min(end, profile.n_layer_main))
    mask_elt = 2 if shape.flash_attn else 4
    # graph inputs used on this card: one KQ mask per kind of attention it runs, the hidden state, positions
    cells = {cs.swa_size if profile.is_swa[il] else cs.kv_size for il in layers if profile.has_kv[il]}
    inputs = sum(c * cs.n_stream * t * mask_elt for c in cells) // max(1, cs.n_stream)
    inputs += e * t * 4 + t * 4 * 4
    if first > 0 and not has_output:
        inputs += e * t * 4  # a middle card: the previous card's hidden rows arrive as one more split input
        if profile.recurrent_kind in ("all", "rwkv", "rwkv6") and not _mamba1(profile):
            # every layer a mixer: a tensor of its tail (Mamba: the d_inner-wide gate, RWKV: n_embd wide) is scheduled
            # on the card after a boundary and copied back; the formulas hold one boundary's copies, a middle card has
            # both boundaries' (measured with llama-fit-params on 3 CPU rpc-servers, bench/plan_accuracy.py)
            inputs += 2 * (profile.ssm_d_inner if profile.recurrent_kind == "all" else e) * t * 4
    gate_in = _gate_crossing(profile, first) if shape.pipeline else 0
    if shape.pipeline:  # Mamba-1: z from the card before (and a second row of it), z back from the card after
        inputs += (2 * gate_in + _gate_crossing(profile, end)) * t * 4
    hybrid = mamba2_hybrid(profile)
    if shape.pipeline and hybrid:
        inputs += t * 4 * hybrid_ssm_bounce(profile, first, end)
        if first > 0 and has_output and len(layers):
            inputs += e * t * 4  # the first layer's normed rows arrive beside the hidden rows
    # the widest layer's working set
    ws = 0
    for il in layers:
        w = t * 4 * layer_rows(profile, il)
        if profile.mla and profile.has_kv[il]:
            # absorbed MLA: every head's query is as wide as the compressed K row (kv_lora_rank + rope)
            w = max(w, t * 4 * (profile.n_head[il] * profile.n_embd_k[il] * 2.25 + K_EMBD * e))
        if not shape.flash_attn and profile.has_kv[il]:
            # build_attn_mha without FA: KQ [n_kv, t, n_head] f32 (soft_max runs in place), beside the query and
            # KQV of every head; MLA's absorbed heads are kv_lora_rank (+ rope) wide for both
            n_kv = (cs.swa_size if profile.is_swa[il] else cs.kv_size) * cs.n_stream
            h_kv = max(1, profile.n_head_kv[il])
            hk = profile.n_embd_k[il] // h_kv
            hv = hk if profile.mla else profile.n_embd_v[il] // h_kv
            waiting = 0
            if profile.recurrent_kind == "parallel" and profile.ssm_d_inner:
                # Falcon-H1: the query side runs after the layer's Mamba-2 mixer wrote its caches, so the mixer's
                # in_proj output (z, x, B, C, dt) waits beside the scores
                waiting = profile.ssm_d_inner + profile.n_embd_r // max(1, profile.ssm_conv_kernel - 1)
            w = max(w, t * 4 * (profile.n_head[il] * (n_kv + hk + hv) + K_NOFA_EMBD * e + waiting))
        if hybrid and profile.is_recurrent[il]:
            w += profile.n_embd_s * 4 * cs.n_seq  # the scan's output carries each sequence's new state
        ws = max(ws, int(w))
    out = 0
    if has_output:
        k_out = (K_OUT_EMBD_HSSM if hybrid else K_OUT_EMBD) if shape.pipeline else K_OUT_EMBD_SOLO
        out = int(shape.n_outputs * profile.n_vocab * 4 + k_out * e * t * 4)
        if shape.pipeline and not shape.flash_attn and any(profile.has_kv[il] for il in layers):
            ws += int((K_NOFA_OUT_HSSM if hybrid else K_NOFA_OUT) * e * t * 4)
        if shape.pipeline and profile.mla:
            out += int(K_MLA_OUT * e * t * 4)
        last = min(end, profile.n_layer_main) - 1
        ws += 2 * gate_in * t * 4  # Mamba-1: the gate's copies beside the last card's layers
        if not shape.pipeline and hybrid and last >= first and profile.recurrent_kind == "no_kv_ff" \
                and not profile.is_recurrent[last]:
            out += inputs  # nemotron_h on one device, not ending in Mamba-2: the graph inputs stay beside the logits
        elif not shape.pipeline and hybrid and last >= first and profile.recurrent_kind == "no_kv" \
                and profile.n_ff[last] and not profile.is_recurrent[last]:
            # granitehybrid on one device, ending in attention: its last FFN's rows sit under the logits (measured)
            out += int(t * 4 * ((K_FFN if profile.ffn_gate else K_FFN_UP) * profile.n_ff[last] + K_EMBD * e))
        if shape.pipeline and not hybrid and not _mamba1(profile) and profile.recurrent_kind != "interval" \
                and last >= first and profile.is_recurrent[last]:
            # Mamba-2 mixers, RWKV: the last card of a pipeline keeps its last layer's scan buffers beside the logits
            keep = int(t * 4 * layer_rows(profile, last))
            if profile.recurrent_kind in ("rwkv", "rwkv6"):  # ... and only those: no staging rows, the split inputs apart
                return _margin(profile, max(PIPELINE_COPIES * inputs + ws, shape.n_outputs * profile.n_vocab * 4 + keep))
            out += keep
    if shape.pipeline:
        return _margin(profile, PIPELINE_COPIES * inputs + max(ws, out))
    return _margin(profile, max(inputs + ws, out))


def host_compute_bytes(profile: ModelProfile, cs: ContextSizes, shape: ComputeShape) -> int:
    """llama-server's own CPU buffer: builds the inputs (embeddings, masks) every card copies from."""
    t = min(shape.n_ubatch, cs.n_ctx)
    mask_elt = 2 if shape.flash_attn else 4
    cells = {cs.swa_size if profile.is_swa[il] else cs.kv_size for il in range(profile.n_layer_main) if profile.has_kv[il]}
    inputs = sum(c * t * mask_elt for c in cells) + profile.n_embd * t * 4
    return _margin(profile, inputs * (PIPELINE_COPIES if shape.pipeline else 1))


def moe_compute_bytes(profile: ModelProfile, cs: ContextSizes, shape: ComputeShape) -> int:
    """What llama-server's CPU needs to run the routed experts it holds (--n-cpu-moe): one MoE layer's working set."""
    t = min(shape.n_ubatch, cs.n_ctx)
    e = profile.n_embd
    rows = K_MOE_FFN * profile.n_expert_used * profile.n_ff_exp + K_MOE_OUT * e * profile.n_expert_used + K_MOE_EMBD * e
    return _margin(profile, int(t * 4 * rows))


# ---------------------------------------------------------------------------------------------------------------
# compute from llama.cpp itself, and per backend

def ctx_class(n_ctx: int) -> int:
    """The context a measurement is taken at for ``n_ctx``: 4096, then 2^k and 1.5 * 2^k upwards (multiples of 256).

    Compute buffers grow with the context (KQ mask, scores without flash attention) and never shrink, so one
    measured at the top of the class bounds every context in it.
    """
    c = 4096
    while c < n_ctx:
        c = c * 3 // 2 if c & (c - 1) == 0 else c // 3 * 4
    return c


def ctx_class_below(top: int) -> int | None:
    """The class point under ``top`` (None under 4096): a measurement there and one at ``top`` bound the class."""
    if top <= 4096:
        return None
    return top // 3 * 2 if top & (top - 1) else top // 4 * 3


@dataclass(frozen=True)
class MeasuredCompute:
    """Compute buffers llama.cpp reserved in its own dry run (llama-fit-params) for one model, build and set of
    plan options: the planner takes these instead of the formulas for a card whose layer range was measured.

    ``entries``: (context it was measured at, expert-offload layers, card position, first unit, end unit) -> bytes as
    llama-fit-params reports them (it reserves ``n_ubatch`` rows of logits on the output card, where llama-server
    reserves one per slot; ``measured_compute`` takes the difference off). ``backend``: what it ran on ("cpu":
    CPU rpc-servers standing in for cards that are absent).
    """

    backend: str
    entries: Mapping[tuple[int, ...], int] = field(default_factory=dict)


def measured_compute(m: MeasuredCompute, profile: ModelProfile, cs: ContextSizes, card: int, first: int, end: int,
                     has_output: bool, shape: ComputeShape, n_offload: int) -> int | None:
    """Card ``card``'s measured compute for units [first, end) at the context of ``cs`` (None: not measured).

    Measured at the top of the context's class: that value, or, measured at the class point below too, the straight
    line between the two. A compute buffer is the largest of terms that each grow linearly with the context (a
    convex function), so the line between two measurements never runs under it.
    On the output card the logits rows llama-fit-params reserved beyond ``shape.n_outputs`` are taken off, as far
    as the formulas say the logits are what sizes that buffer (they are, at 512 rows of a large vocabulary).
    """
    top = ctx_class(cs.n_ctx)
    got = m.entries.get((top, n_offload, card, first, end))
    if got is None:
        return None
    low = ctx_class_below(top)
    below = m.entries.get((low, n_offload, card, first, end)) if low is not None else None
    if below is not None and low is not None and low < cs.n_ctx < top:
        got = below + -(-(got - below) * (cs.n_ctx - low) // (top - low))
    if has_output and shape.n_outputs < shape.n_ubatch:
        exact = replace(profile, compute_checked=True)
        layers_end = min(end, profile.n_layer)
        full = compute_bytes(exact, cs, first, layers_end, True, replace(shape, n_outputs=shape.n_ubatch))
        got -= max(0, full - compute_bytes(exact, cs, first, layers_end, True, shape))
    return max(0, got)


@dataclass(frozen=True)
class BackendCompute:
    """One row of arcsplit/data/compute_backends.toml: what this backend's compute buffers need beyond the
    CPU-calibrated formulas (a factor, rows of the hidden state per token of the ubatch, then MiB on top), and what
    that rests on."""

    backend: str
    factor: float
    add_mib: int
    measured: str  # "" when it is a safety margin, not a measurement
    embd_rows: float = 0.0  # f32 rows n_embd wide per token of the ubatch: what grows with -ub and the model's width
    quant_kv_cell: int = 0  # bytes per cell of the context on each card when the KV cache is quantized (q8_0, ...)

    def apply(self, n: int, row_bytes: int = 0, quant_cells: int = 0) -> int:
        """``n`` (the formulas' or a CPU measurement's bytes) on this backend; ``row_bytes``: n_embd x tokens x 4;
        ``quant_cells``: the context's cells when the KV cache is quantized, else 0."""
        if not n:
            return 0
        return int(n * self.factor) + int(self.embd_rows * row_bytes) + self.add_mib * MiB + self.quant_kv_cell * quant_cells

    def label(self, quant_kv: bool = False) -> str:
        """What the plan prints, e.g. "+25% +6 rows +40 MiB sycl"; "" where the backend needs nothing beyond the
        formulas."""
        parts = [f"{self.factor - 1:+.0%}"] if self.factor != 1.0 else []
        parts += [f"+{self.embd_rows:g} rows"] if self.embd_rows else []
        parts += [f"+{self.add_mib} MiB"] if self.add_mib else []
        parts += [f"+{self.quant_kv_cell} B/cell quantized KV"] if self.quant_kv_cell and quant_kv else []
        return f"{' '.join(parts)} {self.backend}" if parts else ""


# By path, as llama/verdict.py reads its table: importlib.resources would be one more import for every command that
# plans.
_BACKENDS_TABLE = Path(__file__).resolve().parent / "data" / "compute_backends.toml"


@lru_cache(maxsize=None)
def backend_compute(backend: str) -> BackendCompute:
    """``backend``'s row; a backend the table does not list gets the largest factor and addition in it."""
    table = tomllib.loads(_BACKENDS_TABLE.read_text(encoding="utf-8"))
    row = table.get(backend)
    if row is None:
        return BackendCompute(backend, max(float(r["factor"]) for r in table.values()),
                              max(int(r.get("add_mib", 0)) for r in table.values()), "",
                              max(float(r.get("embd_rows", 0)) for r in table.values()),
                              max(int(r.get("quant_kv_cell", 0)) for r in table.values()))
    return BackendCompute(backend, float(row["factor"]), int(row.get("add_mib", 0)), str(row.get("measured", "")),
                          float(row.get("embd_rows", 0)), int(row.get("quant_kv_cell", 0)))
