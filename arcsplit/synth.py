"""Tiny synthetic GGUF models, written with the official ``gguf`` package, that the real llama.cpp loads and runs.

They exist so tests and benches can exercise every memory rule (GQA, MoE, hybrid recurrent, MLA, SWA, shards)
with files of a few MB. Weights are small random numbers: generation works, the text is noise.
``header_only=True`` writes the header and extends the file sparsely to its full size: a "50 GB" model that
takes no disk, for checking that planning never reads tensor data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from gguf.constants import TokenType

_DTYPES = {"f16": np.float16, "f32": np.float32}


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
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
        self.arch, self.n_vocab, self.n_embd, self.n_layer = arch, n_vocab, n_embd, n_layer
        self.dtype = _DTYPES[dtype]
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
        w = GGUFWriter(p, self.arch, split_max_tensors=split_max_tensors)
        w.add_name(f"arcsplit synthetic {self.arch}")
        w.add_file_type(1 if self.dtype == np.float16 else 0)
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
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        if header_only:
            for name, (shape, dt) in self.tensors.items():
                nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
                w.add_tensor_info(name, shape, np.dtype(dt), nbytes)
            w.write_header_to_file(p)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            _extend_sparse(p, self.tensors)
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


def _extend_sparse(p: Path, tensors: dict[str, tuple[tuple[int, ...], Any]]) -> None:
    """Grow the file to header + all tensor data without writing it (a sparse file on every Linux filesystem)."""
    align = 32  # GGUF_DEFAULT_ALIGNMENT; GGUFWriter pads every tensor to it
    data = sum(-(-int(np.prod(s)) * np.dtype(dt).itemsize // align) * align for s, dt in tensors.values())
    with open(p, "r+b") as f:
        f.seek(0, 2)
        f.truncate(-(-f.tell() // align) * align + data)


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
) -> Path:
    """A small Llama (GQA). Returns the path to pass on (the first shard when split).

    With a per-layer list for ``n_head_kv`` the file says ``deci`` (Llama tensors, per-layer heads), the
    llama.cpp architecture that accepts varying KV heads; llama.cpp's ``llama`` rejects them.
    """
    m = _Model("deci" if isinstance(n_head_kv, list) else "llama", n_vocab, ctx, n_embd, n_layer, dtype, seed)
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
    m.u32("full_attention_interval", full_attention_interval)
    inner = state_size * time_step_rank  # value_dim = head_v_dim * n_v_heads
    m.u32("ssm.conv_kernel", conv_kernel)
    m.u32("ssm.inner_size", inner)
    m.u32("ssm.state_size", state_size)
    m.u32("ssm.time_step_rank", time_step_rank)
    m.u32("ssm.group_count", group_count)
    hd = _heads(m, n_head, n_head_kv, head_dim)
    m.arr("rope.dimension_sections", [hd // 4, hd // 8, hd // 8, 0])
    m.embeddings(False)
    e = n_embd
    key_dim = state_size * group_count
    value_dim = state_size * time_step_rank
    for i in range(n_layer):
        m.t(f"blk.{i}.attn_norm.weight", e)
        m.t(f"blk.{i}.post_attention_norm.weight", e)
        if (i + 1) % full_attention_interval == 0:
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
            m.t(f"blk.{i}.ssm_beta.weight", e, time_step_rank)
            m.t(f"blk.{i}.ssm_alpha.weight", e, time_step_rank)
            m.t(f"blk.{i}.ssm_norm.weight", state_size)
            m.t(f"blk.{i}.ssm_out.weight", value_dim, e)
        _ffn(m, i, n_ff, norm=False)
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


def write_sharded_llama(path: str | Path, n_shards: int = 3, **kw: Any) -> Path:
    """A llama split into ``n_shards`` files NAME-0000i-of-0000N.gguf; returns the first shard."""
    n_layer = kw.get("n_layer", 4)
    n_tensors = 3 + 9 * n_layer - (1 if kw.get("tied") else 0)
    per = -(-n_tensors // n_shards)
    return write_llama(path, split_max_tensors=per, **kw)
