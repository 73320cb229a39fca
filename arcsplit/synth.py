"""Tiny synthetic GGUF models, written with the official ``gguf`` package, that the real llama.cpp loads and runs.

They exist so tests and benches can exercise every memory rule (GQA, MoE, hybrid recurrent, MLA, SWA, shards)
with files of a few MB. Weights are small random numbers: generation works, the text is noise.
``header_only=True`` writes the header and extends the file sparsely to its full size: a "50 GB" model that
takes no disk, for checking that planning never reads tensor data; with ``dtype="q4_k_m"`` the tensors get the
types llama-quantize's Q4_K_M mix gives them. ``SEEDS`` / ``write_seed`` are the users' models at their real shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q, TokenType

_DTYPES = {"f16": np.float16, "f32": np.float32}
_FILE_TYPE = {"q4_k_m": 15}  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary llama.cpp accepts: <unk> <s> </s>, 256 byte tokens, then word pieces."""
    if n_vocab < 300:
        raise ValueError("n_vocab must be at least 300 (specials + 256 byte tokens + a few pieces)")
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581"] + [f"\u2581{c}" for c in letters] + list(letters)
    i = 0
    while len(tokens) + len(pieces) < n_vocab:
        a, b = letters[i % 26], letters[(i // 26) % 26]
        pieces.append(f"\u2581{a}{b}{i // 676 or ''}")
        i += 1
    tokens += pieces[: n_vocab - len(tokens)]
    types += [TokenType.NORMAL] * (n_vocab - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)]
    return tokens, scores, [int(t) for t in types]


class _Model:
    """Collects metadata and tensor shapes (numpy order: rows last-dim-first, as GGUFWriter expects)."""

    def __init__(self, arch: str, n_vocab: int, ctx: int, n_embd: int, n_layer: int, dtype: str, seed: int) -> None:
        if dtype not in _DTYPES and dtype not in _FILE_TYPE:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES) + sorted(_FILE_TYPE)}")
        self.arch, self.n_vocab, self.n_embd, self.n_layer = arch, n_vocab, n_embd, n_layer
        self.quant = dtype if dtype in _FILE_TYPE else None  # a llama-quantize mix: header-only files
        self.dtype = _DTYPES.get(dtype, np.float16)
        self.kv: list[tuple[str, Any, str]] = []
        self.tensors: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.rng = np.random.default_rng(seed)
        self.u32("block_count", n_layer)
        self.u32("context_length", ctx)
        self.u32("embedding_length", n_embd)
        self.f32("attention.layer_norm_rms_epsilon", 1e-6)

    def u32(self, key: str, v: int) -> None:
        self.kv.append((f"{self.arch}.{key}", int(v), "u32"))

    def f32(self, key: str, v: float) -> None:
        self.kv.append((f"{self.arch}.{key}", float(v), "f32"))

    def arr(self, key: str, v: list[Any]) -> None:
        self.kv.append((f"{self.arch}.{key}", list(v), "arr"))

    def t(self, name: str, *shape: int, f32: bool = False) -> None:
        """A weight of GGUF dims ``shape`` (ne0 first, like llama.cpp's create_tensor)."""
        self.tensors[name] = (tuple(reversed(shape)), np.float32 if f32 or len(shape) == 1 else self.dtype)

    def embeddings(self, tied: bool) -> None:
        self.t("token_embd.weight", self.n_embd, self.n_vocab)
        self.t("output_norm.weight", self.n_embd)
        if not tied:
            self.t("output.weight", self.n_embd, self.n_vocab)

    def write(self, path: str | Path, header_only: bool = False, split_max_tensors: int = 0,
              reuse_random: bool = False) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if self.quant and not header_only:
            raise ValueError(f"dtype {self.quant} is written header-only (pass header_only=True)")
        w = GGUFWriter(p, self.arch, split_max_tensors=split_max_tensors)
        w.add_name(f"arcsplit synthetic {self.arch}")
        w.add_file_type(_FILE_TYPE[self.quant] if self.quant else 1 if self.dtype == np.float16 else 0)
        for key, value, kind in self.kv:
            if kind == "u32":
                w.add_uint32(key, value)
            elif kind == "f32":
                w.add_float32(key, value)
            else:
                w.add_array(key, value)
        tokens, scores, types = _vocab(self.n_vocab)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        if not header_only:  # optional in llama.cpp (llama-vocab.cpp); packing them one by one is slow at 150k+
            w.add_token_scores(scores)
            w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        if header_only:
            quant_types = _q4_k_m_types(self) if self.quant else {}
            sizes = []
            for name, (shape, dt) in self.tensors.items():
                qt = quant_types.get(name)
                if qt is None:
                    nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
                else:
                    block, size = GGML_QUANT_SIZES[qt]
                    nbytes = int(np.prod(shape)) // block * size
                w.add_tensor_info(name, shape, np.dtype(dt), nbytes, raw_dtype=qt)
                sizes.append(nbytes)
            w.write_header_to_file(p)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            _extend_sparse(p, sizes)
            return p
        drawn: dict[tuple[tuple[int, ...], Any], Any] = {}
        for name, (shape, dt) in self.tensors.items():
            if reuse_random and (shape, dt) in drawn and not (name.endswith("norm.weight") or "_norm" in name):
                data = drawn[(shape, dt)]  # one draw per shape: a 7B model is written in seconds, not minutes
            elif name.endswith("norm.weight") or "_norm" in name:
                data = np.ones(shape, dtype=dt)
            elif name.endswith("ssm_a"):
                data = -np.ones(shape, dtype=dt)
            else:
                data = drawn[(shape, dt)] = (self.rng.standard_normal(shape) * 0.02).astype(dt)
            w.add_tensor(name, data)
        w.write_header_to_file(p)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if split_max_tensors:
            return p.with_name(f"{p.stem}-00001-of-{_count_shards(p):05d}.gguf")
        return p


def _count_shards(p: Path) -> int:
    return len(list(p.parent.glob(f"{p.stem}-*-of-*.gguf")))


def _extend_sparse(p: Path, sizes: list[int]) -> None:
    """Grow the file to header + all tensor data without writing it (a sparse file on every Linux filesystem)."""
    align = 32  # GGUF_DEFAULT_ALIGNMENT; GGUFWriter pads every tensor to it
    data = sum(-(-n // align) * align for n in sizes)
    with open(p, "r+b") as f:
        f.seek(0, 2)
        f.truncate(-(-f.tell() // align) * align + data)


def _q4_k_m_types(m: _Model) -> dict[str, Q]:
    """The tensor types ``llama-quantize ... Q4_K_M`` gives each tensor (pinned llama.cpp, src/llama-quant.cpp:
    tensor_allows_quantization + llama_tensor_get_type_impl), for the architectures these writers produce.

    Not quantized: 1-D tensors, norms, ``ffn_gate_inp``, ``ssm_conv1d`` (they keep the converter's f32).
    Q6_K: ``output.weight``; the attention-V-like tensors (attn_v, attn_qkv) and every ffn_down* of the layers
    ``use_more_bits`` picks (the first and last eighth, and every third one between). Q4_K: everything else.
    The counting of V-like tensors follows the file order, as llama-quantize does.
    """
    def more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    names = list(m.tensors)
    v_like = [n for n in names if n.endswith(("attn_v.weight", "attn_qkv.weight"))]
    out: dict[str, Q] = {}
    for name in names:
        shape, _ = m.tensors[name]
        if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ffn_gate_inp.weight" in name \
                or "ssm_conv1d" in name:
            continue
        if name == "output.weight":
            qt = Q.Q6_K
        elif name in v_like:
            qt = Q.Q6_K if more_bits(v_like.index(name), len(v_like)) else Q.Q4_K
        elif "ffn_down" in name:
            qt = Q.Q6_K if more_bits(int(name.split(".")[1]), m.n_layer) else Q.Q4_K
        else:
            qt = Q.Q4_K
        if shape[-1] % GGML_QUANT_SIZES[qt][0]:
            raise ValueError(f"{name}: rows of {shape[-1]} do not fit {qt.name} blocks")
        out[name] = qt
    return out


def _attention(m: _Model, i: int, n_head: int, n_head_kv: int, head_dim: int, qk_norm: bool = False) -> None:
    e = m.n_embd
    m.t(f"blk.{i}.attn_norm.weight", e)
    m.t(f"blk.{i}.attn_q.weight", e, n_head * head_dim)
    m.t(f"blk.{i}.attn_k.weight", e, n_head_kv * head_dim)
    m.t(f"blk.{i}.attn_v.weight", e, n_head_kv * head_dim)
    m.t(f"blk.{i}.attn_output.weight", n_head * head_dim, e)
    if qk_norm:
        m.t(f"blk.{i}.attn_q_norm.weight", head_dim)
        m.t(f"blk.{i}.attn_k_norm.weight", head_dim)


def _ffn(m: _Model, i: int, n_ff: int, norm: bool = True) -> None:
    e = m.n_embd
    if norm:
        m.t(f"blk.{i}.ffn_norm.weight", e)
    m.t(f"blk.{i}.ffn_gate.weight", e, n_ff)
    m.t(f"blk.{i}.ffn_up.weight", e, n_ff)
    m.t(f"blk.{i}.ffn_down.weight", n_ff, e)


def _heads(m: _Model, n_head: int, n_head_kv: int | list[int], head_dim: int | None) -> int:
    m.u32("attention.head_count", n_head)
    if isinstance(n_head_kv, list):
        m.arr("attention.head_count_kv", n_head_kv)
    else:
        m.u32("attention.head_count_kv", n_head_kv)
    hd = head_dim or m.n_embd // n_head
    m.u32("attention.key_length", hd)
    m.u32("attention.value_length", hd)
    m.u32("rope.dimension_count", hd)
    return hd


def write_llama(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | list[int] = 2,
    n_ff: int = 128,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    tied: bool = False,
    header_only: bool = False,
    split_max_tensors: int = 0,
    seed: int = 0,
    reuse_random: bool = False,
    arch: str | None = None,
) -> Path:
    """A small Llama (GQA). Returns the path to pass on (the first shard when split).

    With a per-layer list for ``n_head_kv`` the file says ``deci`` (Llama tensors, per-layer heads), the
    llama.cpp architecture that accepts varying KV heads; llama.cpp's ``llama`` rejects them. ``arch``: another
    architecture llama.cpp loads from Llama's tensors, e.g. ``qwen2`` (its biases are optional), a family the
    compute model is not checked on (model.FAMILIES).
    """
    arch = arch or ("deci" if isinstance(n_head_kv, list) else "llama")
    m = _Model(arch, n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    m.u32("vocab_size", n_vocab)
    hd = _heads(m, n_head, n_head_kv, None)
    m.embeddings(tied)
    for i in range(n_layer):
        kv = n_head_kv[i] if isinstance(n_head_kv, list) else n_head_kv
        _attention(m, i, n_head, kv, hd)
        _ffn(m, i, n_ff)
    return m.write(path, header_only, split_max_tensors, reuse_random)


def write_qwen3moe(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Qwen3-MoE: routed experts in every layer, q/k norms."""
    m = _Model("qwen3moe", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff_exp * 4)
    m.u32("expert_count", n_expert)
    m.u32("expert_used_count", n_expert_used)
    m.u32("expert_feed_forward_length", n_ff_exp)
    hd = _heads(m, n_head, n_head_kv, head_dim)
    m.embeddings(False)
    e = n_embd
    for i in range(n_layer):
        _attention(m, i, n_head, n_head_kv, hd, qk_norm=True)
        m.t(f"blk.{i}.ffn_norm.weight", e)
        m.t(f"blk.{i}.ffn_gate_inp.weight", e, n_expert, f32=True)
        m.t(f"blk.{i}.ffn_gate_exps.weight", e, n_ff_exp, n_expert)
        m.t(f"blk.{i}.ffn_up_exps.weight", e, n_ff_exp, n_expert)
        m.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, e, n_expert)
    return m.write(path, header_only)


def write_gemma3(
    path: str | Path,
    n_layer: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 1,
    head_dim: int = 32,
    n_ff: int = 128,
    n_swa: int = 128,
    swa_pattern: int | None = None,
    n_vocab: int = 512,
    ctx: int = 8192,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Gemma 3: sliding-window attention on 5 of every 6 layers, tied embeddings (like the demo model)."""
    m = _Model("gemma3", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    m.u32("attention.sliding_window", n_swa)
    if swa_pattern is not None:
        m.u32("attention.sliding_window_pattern", swa_pattern)
    hd = _heads(m, n_head, n_head_kv, head_dim)
    m.embeddings(True)
    for i in range(n_layer):
        _attention(m, i, n_head, n_head_kv, hd, qk_norm=True)
        m.t(f"blk.{i}.post_attention_norm.weight", n_embd)
        _ffn(m, i, n_ff)
        m.t(f"blk.{i}.post_ffw_norm.weight", n_embd)
    return m.write(path, header_only)


def write_qwen35(
    path: str | Path,
    n_layer: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 128,
    full_attention_interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    time_step_rank: int = 4,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Qwen3.5 hybrid: gated delta-net (recurrent) layers, full attention every 4th layer."""
    m = _Model("qwen35", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    _gdn_hybrid(m, n_head, n_head_kv, head_dim, full_attention_interval, conv_kernel, state_size, group_count,
                time_step_rank, lambda i: _ffn(m, i, n_ff, norm=False), sections=True, fused_ba=False)
    return m.write(path, header_only)


def write_qwen35moe(
    path: str | Path,
    n_layer: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    full_attention_interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    time_step_rank: int = 4,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_ff_shexp: int = 64,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A Qwen3.5/3.6 MoE hybrid (llama.cpp ``qwen35moe``): gated delta-net layers, full attention every 4th,
    routed experts plus one gated shared expert in every layer, separate ``ssm_beta``/``ssm_alpha``."""
    m = _Model("qwen35moe", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    _moe_keys(m, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    _gdn_hybrid(m, n_head, n_head_kv, head_dim, full_attention_interval, conv_kernel, state_size, group_count,
                time_step_rank, lambda i: _moe_ffn(m, i, n_expert, n_ff_exp, n_ff_shexp), sections=True,
                fused_ba=False)
    return m.write(path, header_only)


def write_qwen3next(
    path: str | Path,
    n_layer: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    full_attention_interval: int = 4,
    conv_kernel: int = 4,
    state_size: int = 16,
    group_count: int = 2,
    time_step_rank: int = 4,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_ff_shexp: int = 64,
    n_ff: int = 128,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A Qwen3-Next (llama.cpp ``qwen3next``: Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the qwen35moe layout with
    the beta/alpha projections fused into one ``ssm_ba`` and no multi-section RoPE (src/models/qwen3next.cpp)."""
    m = _Model("qwen3next", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    _moe_keys(m, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    _gdn_hybrid(m, n_head, n_head_kv, head_dim, full_attention_interval, conv_kernel, state_size, group_count,
                time_step_rank, lambda i: _moe_ffn(m, i, n_expert, n_ff_exp, n_ff_shexp), sections=False,
                fused_ba=True)
    return m.write(path, header_only)


def _moe_keys(m: _Model, n_expert: int, n_expert_used: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    m.u32("expert_count", n_expert)
    m.u32("expert_used_count", n_expert_used)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.u32("expert_shared_feed_forward_length", n_ff_shexp)


def _moe_ffn(m: _Model, i: int, n_expert: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    """Routed experts + one gated shared expert (Qwen2-MoE/Qwen3-Next style), no ffn_norm (post_attention_norm)."""
    e = m.n_embd
    m.t(f"blk.{i}.ffn_gate_inp.weight", e, n_expert, f32=True)
    m.t(f"blk.{i}.ffn_gate_exps.weight", e, n_ff_exp, n_expert)
    m.t(f"blk.{i}.ffn_up_exps.weight", e, n_ff_exp, n_expert)
    m.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, e, n_expert)
    m.t(f"blk.{i}.ffn_gate_inp_shexp.weight", e)
    m.t(f"blk.{i}.ffn_gate_shexp.weight", e, n_ff_shexp)
    m.t(f"blk.{i}.ffn_up_shexp.weight", e, n_ff_shexp)
    m.t(f"blk.{i}.ffn_down_shexp.weight", n_ff_shexp, e)


def _gdn_hybrid(m: _Model, n_head: int, n_head_kv: int, head_dim: int, interval: int, conv_kernel: int,
                state_size: int, group_count: int, time_step_rank: int, ffn: Any, sections: bool,
                fused_ba: bool) -> None:
    """The gated delta-net hybrid trunk shared by qwen35, qwen35moe and qwen3next (load_arch_tensors of each):
    ``interval - 1`` recurrent layers then one gated full-attention layer (Q is twice as wide: query + gate)."""
    inner = state_size * time_step_rank  # value_dim = head_v_dim * n_v_heads
    m.u32("full_attention_interval", interval)
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", inner)
    m.u32("ssm.state_size", state_size)
    m.u32("ssm.time_step_rank", time_step_rank)
    m.u32("ssm.group_count", group_count)
    hd = _heads(m, n_head, n_head_kv, head_dim)
    if sections:
        m.arr("rope.dimension_sections", [hd // 4, hd // 8, hd // 8, 0])
    m.embeddings(False)
    e = m.n_embd
    key_dim = state_size * group_count
    value_dim = state_size * time_step_rank
    for i in range(m.n_layer):
        m.t(f"blk.{i}.attn_norm.weight", e)
        m.t(f"blk.{i}.post_attention_norm.weight", e)
        if (i + 1) % interval == 0:
            m.t(f"blk.{i}.attn_q.weight", e, hd * n_head * 2)
            m.t(f"blk.{i}.attn_k.weight", e, hd * n_head_kv)
            m.t(f"blk.{i}.attn_v.weight", e, hd * n_head_kv)
            m.t(f"blk.{i}.attn_output.weight", hd * n_head, e)
            m.t(f"blk.{i}.attn_q_norm.weight", hd)
            m.t(f"blk.{i}.attn_k_norm.weight", hd)
        else:
            m.t(f"blk.{i}.attn_qkv.weight", e, key_dim * 2 + value_dim)
            m.t(f"blk.{i}.attn_gate.weight", e, value_dim)
            m.t(f"blk.{i}.ssm_conv1d.weight", conv_kernel, key_dim * 2 + value_dim, f32=True)
            m.t(f"blk.{i}.ssm_dt.bias", time_step_rank)
            m.t(f"blk.{i}.ssm_a", time_step_rank)
            if fused_ba:
                m.t(f"blk.{i}.ssm_ba.weight", e, time_step_rank * 2)
            else:
                m.t(f"blk.{i}.ssm_beta.weight", e, time_step_rank)
                m.t(f"blk.{i}.ssm_alpha.weight", e, time_step_rank)
            m.t(f"blk.{i}.ssm_norm.weight", state_size)
            m.t(f"blk.{i}.ssm_out.weight", value_dim, e)
        ffn(i)


def write_mamba2(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 64,
    d_inner: int = 128,
    d_state: int = 16,
    n_group: int = 1,
    head_dim: int = 32,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Mamba-2 (llama.cpp ``mamba2``): every layer recurrent, no attention, no KV cache
    (src/models/mamba2.cpp: ssm_in projects to z, x, B, C and one dt per head)."""
    m = _Model("mamba2", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    n_head = d_inner // head_dim
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", n_head)
    m.u32("ssm.group_count", n_group)
    m.embeddings(False)
    for i in range(n_layer):
        m.t(f"blk.{i}.attn_norm.weight", n_embd)
        _mamba2_block(m, i, d_inner, d_state, n_group, n_head, conv_kernel)
    return m.write(path, header_only)


def _mamba2_block(m: _Model, i: int, d_inner: int, d_state: int, n_group: int, n_head: int, conv_kernel: int) -> None:
    """One Mamba-2 mixer (mamba2.cpp, granite-hybrid.cpp): in_proj to z, x, B, C and one dt per head; conv; scan."""
    conv_dim = d_inner + 2 * n_group * d_state
    m.t(f"blk.{i}.ssm_in.weight", m.n_embd, d_inner + conv_dim + n_head)
    m.t(f"blk.{i}.ssm_conv1d.weight", conv_kernel, conv_dim, f32=True)
    m.t(f"blk.{i}.ssm_conv1d.bias", conv_dim)
    m.t(f"blk.{i}.ssm_dt.bias", n_head)
    m.t(f"blk.{i}.ssm_a", 1, n_head, f32=True)
    m.t(f"blk.{i}.ssm_d", 1, n_head, f32=True)
    m.t(f"blk.{i}.ssm_norm.weight", d_inner // n_group, n_group, f32=True)
    m.t(f"blk.{i}.ssm_out.weight", d_inner, m.n_embd)


def write_granitehybrid(
    path: str | Path,
    n_layer: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    attention_every: int = 4,
    n_ff: int = 128,
    d_inner: int = 128,
    d_state: int = 16,
    n_group: int = 1,
    head_dim: int = 32,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Granite-4 hybrid (llama.cpp ``granitehybrid``): Mamba-2 layers with attention every
    ``attention_every``-th layer (a layer is recurrent where its KV head count is 0), a dense FFN in every layer."""
    m = _Model("granitehybrid", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", d_inner // head_dim)
    m.u32("ssm.group_count", n_group)
    kv = [n_head_kv if (i + 1) % attention_every == 0 else 0 for i in range(n_layer)]
    hd = _heads(m, n_head, kv, n_embd // n_head)
    m.embeddings(False)
    for i in range(n_layer):
        if kv[i]:
            _attention(m, i, n_head, kv[i], hd)
        else:
            m.t(f"blk.{i}.attn_norm.weight", n_embd)
            _mamba2_block(m, i, d_inner, d_state, n_group, d_inner // head_dim, conv_kernel)
        _ffn(m, i, n_ff)
    return m.write(path, header_only)


def write_nemotron_h(
    path: str | Path,
    pattern: str = "M-M*-M-M-M*-",
    n_embd: int = 1024,
    n_head: int = 16,
    n_head_kv: int = 4,
    head_dim: int = 64,
    n_ff: int = 4096,
    d_inner: int = 2048,
    d_state: int = 128,
    n_group: int = 8,
    ssm_head_dim: int = 64,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 8192,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Nemotron-H (llama.cpp ``nemotron_h``): one block kind per layer, as the real models' hybrid
    pattern says: ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` an MLP (up, ReLU^2, down; no gate). A layer is
    recurrent iff its KV head count and its FFN length are both 0 (src/models/nemotron-h.cpp)."""
    n_layer = len(pattern)
    if set(pattern) - set("M*-"):
        raise ValueError("pattern letters: M (Mamba-2), * (attention), - (MLP)")
    m = _Model("nemotron_h", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.f32("attention.layer_norm_epsilon", 1e-5)
    m.arr("feed_forward_length", [n_ff if c == "-" else 0 for c in pattern])
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", d_inner // ssm_head_dim)
    m.u32("ssm.group_count", n_group)
    kv = [n_head_kv if c == "*" else 0 for c in pattern]
    hd = _heads(m, n_head, kv, head_dim)
    m.embeddings(False)
    for i, c in enumerate(pattern):
        if c == "*":
            _attention(m, i, n_head, n_head_kv, hd)
        else:
            m.t(f"blk.{i}.attn_norm.weight", n_embd)
        if c == "M":
            _mamba2_block(m, i, d_inner, d_state, n_group, d_inner // ssm_head_dim, conv_kernel)
        elif c == "-":
            m.t(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
            m.t(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
    return m.write(path, header_only)


def write_falcon_h1(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 8,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_ff: int = 512,
    d_inner: int = 384,
    d_state: int = 64,
    n_group: int = 1,
    ssm_head_dim: int = 64,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 8192,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Falcon-H1 (llama.cpp ``falcon-h1``): every layer runs attention and a Mamba-2 mixer side by side on
    the same normed input (their outputs added), then a SwiGLU FFN; every layer holds KV and recurrent state
    (src/models/falcon-h1.cpp). The pinned llama.cpp names the FFN norm ``blk.N.ffn_norm`` (no ``.weight``)."""
    m = _Model("falcon-h1", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", d_inner // ssm_head_dim)
    m.u32("ssm.group_count", n_group)
    hd = _heads(m, n_head, n_head_kv, head_dim)
    m.embeddings(False)
    for i in range(n_layer):
        _attention(m, i, n_head, n_head_kv, hd)
        _mamba2_block(m, i, d_inner, d_state, n_group, d_inner // ssm_head_dim, conv_kernel)
        m.t(f"blk.{i}.ffn_norm", n_embd)
        _ffn(m, i, n_ff, norm=False)
    return m.write(path, header_only)


def _rwkv_keys(m: _Model, n_ff: int, head_size: int) -> None:
    """The keys RWKV-6 and RWKV-7 share (their own follow, then the token shifts: written by _rwkv_embeddings)."""
    m.f32("attention.layer_norm_epsilon", 1e-5)
    m.u32("feed_forward_length", n_ff)
    m.u32("wkv.head_size", head_size)


def _rwkv_embeddings(m: _Model) -> int:
    """Two token shifts per layer, the embeddings and their layer norm (RWKV normalises the input); n_embd."""
    m.u32("token_shift_count", 2)
    e = m.n_embd
    m.embeddings(False)
    m.t("token_embd_norm.weight", e)
    m.t("token_embd_norm.bias", e)
    m.t("output_norm.bias", e)
    return e


def _rwkv_norms(m: _Model, i: int) -> str:
    """Layer ``i``'s three layer norms (time mix in and out, channel mix in); the layer's tensor prefix."""
    b = f"blk.{i}"
    for name in ("attn_norm", "attn_norm_2", "time_mix_ln"):
        m.t(f"{b}.{name}.weight", m.n_embd)
        m.t(f"{b}.{name}.bias", m.n_embd)
    return b


def write_rwkv7(
    path: str | Path,
    n_layer: int = 12,
    n_embd: int = 1024,
    head_size: int = 64,
    n_ff: int = 4096,
    lora_decay: int = 64,
    lora_iclr: int = 64,
    lora_value_mix: int = 32,
    lora_gate: int = 128,
    n_vocab: int = 512,
    ctx: int = 8192,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small RWKV-7 (llama.cpp ``rwkv7``): every layer a time-mix (WKV-7 state of head_size^2 per head) and a
    channel-mix, no attention and no KV cache; two token shifts per layer (src/models/rwkv7.cpp)."""
    m = _Model("rwkv7", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    _rwkv_keys(m, n_ff, head_size)
    m.u32("attention.decay_lora_rank", lora_decay)
    m.u32("attention.iclr_lora_rank", lora_iclr)
    m.u32("attention.value_residual_mix_lora_rank", lora_value_mix)
    m.u32("attention.gate_lora_rank", lora_gate)
    e = _rwkv_embeddings(m)
    for i in range(n_layer):
        b = _rwkv_norms(m, i)
        for x, rank in (("w", lora_decay), ("a", lora_iclr), ("v", lora_iclr if i == 0 else lora_value_mix)):
            m.t(f"{b}.time_mix_{x}0.weight", e)
            m.t(f"{b}.time_mix_{x}1.weight", e, rank)
            m.t(f"{b}.time_mix_{x}2.weight", rank, e)
        m.t(f"{b}.time_mix_g1.weight", e, lora_gate)
        m.t(f"{b}.time_mix_g2.weight", lora_gate, e)
        m.t(f"{b}.time_mix_lerp_fused.weight", e, 1, 1, 6, f32=True)
        for name in ("k_k", "k_a", "r_k"):
            m.t(f"{b}.time_mix_{name}.weight", e)
        for name in ("key", "value", "receptance", "output"):
            m.t(f"{b}.time_mix_{name}.weight", e, e)
        m.t(f"{b}.channel_mix_lerp_k.weight", e, 1, 1, f32=True)
        m.t(f"{b}.channel_mix_key.weight", e, n_ff)
        m.t(f"{b}.channel_mix_value.weight", n_ff, e)
    return m.write(path, header_only)


def write_deepseek2(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    kv_lora_rank: int = 64,
    rope_dim: int = 32,
    nope_dim: int = 32,
    v_dim: int = 32,
    q_lora_rank: int = 32,
    n_ff: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small DeepSeek-V3-style MLA model: K-only cache of kv_lora_rank + rope_dim per token, 1 dense lead layer."""
    m = _Model("deepseek2", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    m.u32("feed_forward_length", n_ff)
    m.u32("vocab_size", n_vocab)
    m.u32("attention.head_count", n_head)
    m.u32("attention.head_count_kv", 1)
    m.u32("attention.key_length", kv_lora_rank + rope_dim)
    m.u32("attention.value_length", kv_lora_rank)
    m.u32("attention.key_length_mla", nope_dim + rope_dim)
    m.u32("attention.value_length_mla", v_dim)
    m.u32("attention.kv_lora_rank", kv_lora_rank)
    m.u32("attention.q_lora_rank", q_lora_rank)
    m.u32("rope.dimension_count", rope_dim)
    m.u32("leading_dense_block_count", 1)
    m.u32("expert_count", n_expert)
    m.u32("expert_used_count", n_expert_used)
    m.u32("expert_shared_count", 1)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.f32("expert_weights_scale", 1.0)
    m.embeddings(False)
    e = n_embd
    for i in range(n_layer):
        m.t(f"blk.{i}.attn_norm.weight", e)
        m.t(f"blk.{i}.attn_kv_a_norm.weight", kv_lora_rank)
        m.t(f"blk.{i}.attn_q_a_norm.weight", q_lora_rank)
        m.t(f"blk.{i}.attn_q_a.weight", e, q_lora_rank)
        m.t(f"blk.{i}.attn_q_b.weight", q_lora_rank, n_head * (nope_dim + rope_dim))
        m.t(f"blk.{i}.attn_kv_a_mqa.weight", e, kv_lora_rank + rope_dim)
        m.t(f"blk.{i}.attn_k_b.weight", nope_dim, kv_lora_rank, n_head)
        m.t(f"blk.{i}.attn_v_b.weight", kv_lora_rank, v_dim, n_head)
        m.t(f"blk.{i}.attn_output.weight", n_head * v_dim, e)
        m.t(f"blk.{i}.ffn_norm.weight", e)
        if i < 1:
            _ffn(m, i, n_ff, norm=False)
        else:
            m.t(f"blk.{i}.ffn_gate_inp.weight", e, n_expert, f32=True)
            m.t(f"blk.{i}.ffn_gate_exps.weight", e, n_ff_exp, n_expert)
            m.t(f"blk.{i}.ffn_up_exps.weight", e, n_ff_exp, n_expert)
            m.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, e, n_expert)
            m.t(f"blk.{i}.ffn_gate_shexp.weight", e, n_ff_exp)
            m.t(f"blk.{i}.ffn_up_shexp.weight", e, n_ff_exp)
            m.t(f"blk.{i}.ffn_down_shexp.weight", n_ff_exp, e)
    return m.write(path, header_only)


def write_mamba(
    path: str | Path,
    n_layer: int = 4,
    n_embd: int = 64,
    d_state: int = 16,
    dt_rank: int | None = None,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Mamba-1 (llama.cpp ``mamba``): every layer a selective-scan mixer, no attention, no KV cache
    (src/models/mamba.cpp; d_inner is 2 * n_embd, the only expansion llama.cpp supports; dt_rank defaults to
    ceil(n_embd / 16) as in the published models)."""
    m = _Model("mamba", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    d_inner = 2 * n_embd
    rank = dt_rank or -(-n_embd // 16)
    _mamba1_keys(m, d_inner, d_state, rank, conv_kernel)
    m.embeddings(False)
    for i in range(n_layer):
        m.t(f"blk.{i}.attn_norm.weight", n_embd)
        _mamba1_block(m, i, d_inner, d_state, rank, conv_kernel, bcdt_norms=False)
    return m.write(path, header_only)


def _mamba1_keys(m: _Model, d_inner: int, d_state: int, dt_rank: int, conv_kernel: int) -> None:
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", dt_rank)


def _mamba1_block(m: _Model, i: int, d_inner: int, d_state: int, dt_rank: int, conv_kernel: int,
                  bcdt_norms: bool) -> None:
    """One Mamba-1 mixer (mamba.cpp, jamba.cpp load_arch_tensors): in_proj to x and z, conv, x_proj to dt, B and C,
    dt_proj, the scan's A and D; Jamba RMS-norms dt, B and C (``bcdt_norms``)."""
    m.t(f"blk.{i}.ssm_in.weight", m.n_embd, 2 * d_inner)
    m.t(f"blk.{i}.ssm_conv1d.weight", conv_kernel, d_inner, f32=True)
    m.t(f"blk.{i}.ssm_conv1d.bias", d_inner)
    m.t(f"blk.{i}.ssm_x.weight", d_inner, dt_rank + 2 * d_state)
    if bcdt_norms:
        m.t(f"blk.{i}.ssm_dt_norm.weight", dt_rank)
        m.t(f"blk.{i}.ssm_b_norm.weight", d_state)
        m.t(f"blk.{i}.ssm_c_norm.weight", d_state)
    m.t(f"blk.{i}.ssm_dt.weight", dt_rank, d_inner)
    m.t(f"blk.{i}.ssm_dt.bias", d_inner)
    m.t(f"blk.{i}.ssm_a", d_state, d_inner, f32=True)
    m.t(f"blk.{i}.ssm_d", d_inner)
    m.t(f"blk.{i}.ssm_out.weight", d_inner, m.n_embd)


def write_jamba(
    path: str | Path,
    n_layer: int = 8,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    attn_period: int = 8,
    attn_offset: int = 4,
    n_ff: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    expert_period: int = 2,
    expert_offset: int = 1,
    d_state: int = 16,
    dt_rank: int | None = None,
    conv_kernel: int = 4,
    n_vocab: int = 512,
    ctx: int = 4096,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small Jamba (llama.cpp ``jamba``): Mamba-1 mixers (with RMS-normed dt, B, C) and, where
    ``i % attn_period == attn_offset``, attention without RoPE (a layer is recurrent where its KV head count is 0);
    every layer an FFN, routed experts of width ``n_ff`` where ``i % expert_period == expert_offset`` (no
    expert_feed_forward_length key: Jamba's experts are feed_forward_length wide), a dense SwiGLU elsewhere
    (src/models/jamba.cpp; the period/offset defaults are the published Jamba's)."""
    m = _Model("jamba", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    d_inner = 2 * n_embd
    rank = dt_rank or -(-n_embd // 16)
    _mamba1_keys(m, d_inner, d_state, rank, conv_kernel)
    m.u32("feed_forward_length", n_ff)
    m.u32("expert_count", n_expert)
    m.u32("expert_used_count", n_expert_used)
    kv = [n_head_kv if i % attn_period == attn_offset else 0 for i in range(n_layer)]
    m.u32("attention.head_count", n_head)
    m.arr("attention.head_count_kv", kv)
    m.embeddings(False)
    e, hd = n_embd, n_embd // n_head
    for i in range(n_layer):
        m.t(f"blk.{i}.attn_norm.weight", e)
        if kv[i]:
            m.t(f"blk.{i}.attn_q.weight", e, e)
            m.t(f"blk.{i}.attn_k.weight", e, hd * kv[i])
            m.t(f"blk.{i}.attn_v.weight", e, hd * kv[i])
            m.t(f"blk.{i}.attn_output.weight", e, e)
        else:
            _mamba1_block(m, i, d_inner, d_state, rank, conv_kernel, bcdt_norms=True)
        m.t(f"blk.{i}.ffn_norm.weight", e)
        if i % expert_period == expert_offset:
            m.t(f"blk.{i}.ffn_gate_inp.weight", e, n_expert, f32=True)
            m.t(f"blk.{i}.ffn_gate_exps.weight", e, n_ff, n_expert)
            m.t(f"blk.{i}.ffn_down_exps.weight", n_ff, e, n_expert)
            m.t(f"blk.{i}.ffn_up_exps.weight", e, n_ff, n_expert)
        else:
            _ffn(m, i, n_ff, norm=False)
    return m.write(path, header_only)


def write_rwkv6(
    path: str | Path,
    n_layer: int = 12,
    n_embd: int = 1024,
    head_size: int = 64,
    n_ff: int = 3584,
    time_mix_extra_dim: int = 32,
    time_decay_extra_dim: int = 64,
    rescale_every: int = 6,
    n_vocab: int = 512,
    ctx: int = 8192,
    dtype: str = "f16",
    header_only: bool = False,
    seed: int = 0,
) -> Path:
    """A small RWKV-6 "Finch" (llama.cpp ``rwkv6``): every layer a time mix (WKV-6 state of head_size^2 per head,
    five LoRA-mixed inputs) and a channel mix with receptance, no attention and no KV cache; two token shifts per
    layer (src/models/rwkv6.cpp, rwkv6-base.cpp; extra dims 32/64 as in RWKV-6 1.6B, n_ff 3.5 * n_embd)."""
    m = _Model("rwkv6", n_vocab, ctx, n_embd, n_layer, dtype, seed)
    _rwkv_keys(m, n_ff, head_size)
    m.u32("time_mix_extra_dim", time_mix_extra_dim)
    m.u32("time_decay_extra_dim", time_decay_extra_dim)
    m.u32("rescale_every_n_layers", rescale_every)
    e = _rwkv_embeddings(m)
    for i in range(n_layer):
        b = _rwkv_norms(m, i)
        m.t(f"{b}.time_mix_w1.weight", e, time_mix_extra_dim * 5)
        m.t(f"{b}.time_mix_w2.weight", time_mix_extra_dim, e, 5)
        m.t(f"{b}.time_mix_lerp_x.weight", e, 1, 1, f32=True)
        m.t(f"{b}.time_mix_lerp_fused.weight", e, 1, 1, 5, f32=True)
        m.t(f"{b}.time_mix_first.weight", head_size, e // head_size, f32=True)
        m.t(f"{b}.time_mix_decay.weight", e)
        m.t(f"{b}.time_mix_decay_w1.weight", e, time_decay_extra_dim)
        m.t(f"{b}.time_mix_decay_w2.weight", time_decay_extra_dim, e)
        for name in ("key", "value", "receptance", "gate", "output"):
            m.t(f"{b}.time_mix_{name}.weight", e, e)
        m.t(f"{b}.channel_mix_lerp_k.weight", e, 1, 1, f32=True)
        m.t(f"{b}.channel_mix_lerp_r.weight", e, 1, 1, f32=True)
        m.t(f"{b}.channel_mix_key.weight", e, n_ff)
        m.t(f"{b}.channel_mix_value.weight", n_ff, e)
        m.t(f"{b}.channel_mix_receptance.weight", e, e)
    return m.write(path, header_only)


def write_sharded_llama(path: str | Path, n_shards: int = 3, **kw: Any) -> Path:
    """A llama split into ``n_shards`` files NAME-0000i-of-0000N.gguf; returns the first shard."""
    n_layer = kw.get("n_layer", 4)
    n_tensors = 3 + 9 * n_layer - (1 if kw.get("tied") else 0)
    per = -(-n_tensors // n_shards)
    return write_llama(path, split_max_tensors=per, **kw)


# The seeds' models, from their public configurations (no download). Shapes: Hugging Face config.json of
# Qwen/Qwen3-Coder-Next (hidden 2048, 48 layers, 16 q / 2 kv heads of 256, linear attention 16 k / 32 v heads of
# 128, conv kernel 4, 512 experts top-10 of 512, one shared expert of 512, vocab 151936, context 262144),
# Qwen/Qwen3.6-35B-A3B text_config (hidden 2048, 40 layers, the same attention and linear attention, 256 experts
# top-8 of 512, shared expert 512, vocab 248320, context 262144) and Qwen/Qwen3-30B-A3B-Instruct-2507 (hidden
# 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of 768, vocab 151936, context 262144); tensor
# names and GGUF keys as the pinned llama.cpp's converter writes them (conversion/qwen.py, no MTP block, like the
# published GGUFs: block_count 48 for Qwen3-Coder-Next); tensor types as ``llama-quantize Q4_K_M`` assigns them
# (_q4_k_m_types). Files made with an importance matrix (unsloth "UD" quants) choose other types per tensor.
SEEDS: dict[str, Any] = {
    "qwen3-coder-next-80b-a3b-q4_k_m": lambda p: write_qwen3next(
        p, n_layer=48, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, state_size=128, group_count=16,
        time_step_rank=32, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512, n_ff=5120,
        n_vocab=151936, ctx=262144, dtype="q4_k_m", header_only=True),
    "qwen3.6-35b-a3b-q4_k_m": lambda p: write_qwen35moe(
        p, n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, state_size=128, group_count=16,
        time_step_rank=32, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_vocab=248320,
        ctx=262144, dtype="q4_k_m", header_only=True),
    "qwen3-30b-a3b-q4_k_m": lambda p: write_qwen3moe(
        p, n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8,
        n_ff_exp=768, n_vocab=151936, ctx=262144, dtype="q4_k_m", header_only=True),
}


def write_seed(name: str, path: str | Path) -> Path:
    """One of ``SEEDS`` as a header-only GGUF (a sparse file: the full size on paper, a few MB on disk)."""
    if name not in SEEDS:
        raise ValueError(f"unknown seed model {name!r}; one of {', '.join(SEEDS)}")
    return SEEDS[name](path)
