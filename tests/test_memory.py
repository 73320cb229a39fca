"""llama.cpp's sizing rules, checked by hand-computed values on real (synthetic) GGUF files."""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit import memory, synth
from arcsplit.errors import BadInput
from arcsplit.model import load_profile


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    return load_profile(synth.write_llama(tmp_path_factory.mktemp("m") / "l.gguf", n_layer=4, n_embd=256, n_head=8,
                                          n_head_kv=2, n_ff=512, n_vocab=32000, header_only=True))


def test_row_sizes_use_real_block_sizes() -> None:
    assert memory.row_bytes("f16", 128) == 256
    assert memory.row_bytes("q8_0", 128) == 4 * 34
    assert memory.row_bytes("q4_0", 128) == 4 * 18
    assert memory.row_bytes("q5_1", 64) == 2 * 24
    assert memory.row_bytes("iq4_nl", 32) == 18
    with pytest.raises(BadInput, match="multiple of 32"):
        memory.row_bytes("q8_0", 48)
    with pytest.raises(BadInput, match="unknown cache type"):
        memory.row_bytes("q3_k", 64)


def test_context_padding_and_streams(llama) -> None:
    cs = memory.context_sizes(llama, 1000)
    assert (cs.n_ctx, cs.kv_size, cs.n_stream) == (1024, 1024, 1)
    cs = memory.context_sizes(llama, 5000, n_parallel=3, kv_unified=False)
    # per-stream cells padded to 256, n_ctx rounded to streams x cells
    assert (cs.kv_size, cs.n_stream, cs.n_ctx) == (1792, 3, 5376)


def test_gqa_kv_per_layer(llama) -> None:
    cs = memory.context_sizes(llama, 4096)
    width = 2 * (256 // 8)  # 2 KV heads x head size 32
    assert memory.kv_layer_bytes(llama, 0, cs) == 2 * width * 2 * 4096  # K + V, f16
    q8 = memory.kv_layer_bytes(llama, 0, cs, "q8_0", "q8_0")
    assert q8 == 2 * (width // 32 * 34) * 4096


def test_swa_window(tmp_path: Path) -> None:
    p = load_profile(synth.write_gemma3(tmp_path / "g.gguf", n_layer=6, n_swa=128, head_dim=32, n_head_kv=1))
    cs = memory.context_sizes(p, 8192, n_ubatch=512)
    assert cs.swa_size == 768  # pad(min(8192, 128 + 512), 256)
    assert memory.kv_layer_bytes(p, 0, cs) == 2 * 32 * 2 * 768
    assert memory.kv_layer_bytes(p, 5, cs) == 2 * 32 * 2 * 8192  # the full-attention layer
    four = memory.context_sizes(p, 8192, n_parallel=4, n_ubatch=512)
    assert four.swa_size == pad_256(128 * 4 + 512)  # unified KV: the window grows with the slots
    full = memory.context_sizes(p, 8192, swa_full=True)
    assert full.swa_size == 8192


def pad_256(x: int) -> int:
    return -(-x // 256) * 256


def test_hybrid_state_and_kv(tmp_path: Path) -> None:
    p = load_profile(synth.write_qwen35(tmp_path / "q.gguf", n_layer=8, n_head_kv=2, head_dim=32))
    cs = memory.context_sizes(p, 4096, n_parallel=2)
    assert memory.kv_layer_bytes(p, 0, cs) == 0  # recurrent layer: no KV
    assert memory.state_layer_bytes(p, 0, cs) == (p.n_embd_r + p.n_embd_s) * 4 * 2
    assert memory.kv_layer_bytes(p, 3, cs) == 2 * (2 * 32) * 2 * 4096
    assert memory.state_layer_bytes(p, 3, cs) == 0


def test_mla_is_k_only(tmp_path: Path) -> None:
    p = load_profile(synth.write_deepseek2(tmp_path / "d.gguf", kv_lora_rank=64, rope_dim=32))
    cs = memory.context_sizes(p, 2048)
    assert memory.kv_layer_bytes(p, 0, cs) == 96 * 2 * 2048


def test_v_padded_without_flash_attention(tmp_path: Path) -> None:
    p = load_profile(synth.write_llama(tmp_path / "m.gguf", n_layer=2, n_head_kv=[4, 1]))
    cs = memory.context_sizes(p, 1024)
    with_fa = memory.kv_layer_bytes(p, 1, cs, flash_attn=True)
    without = memory.kv_layer_bytes(p, 1, cs, flash_attn=False)
    assert without > with_fa  # V rows padded to the widest layer


def test_refusals(llama, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="flash attention"):
        memory.check_cache_types(llama, "q8_0", "q8_0", flash_attn=False)
    mla = load_profile(synth.write_deepseek2(tmp_path / "d.gguf"))
    with pytest.raises(BadInput, match="same K and V"):
        memory.check_cache_types(mla, "q8_0", "f16", flash_attn=True)


def test_compute_grows_with_context_and_output(llama) -> None:
    shape = memory.ComputeShape(n_ubatch=512, n_outputs=1, flash_attn=True, pipeline=True)
    small = memory.compute_bytes(llama, memory.context_sizes(llama, 4096), 0, 2, False, shape)
    big = memory.compute_bytes(llama, memory.context_sizes(llama, 32768), 0, 2, False, shape)
    assert big > small  # the KQ mask copies grow with n_kv
    cs = memory.context_sizes(llama, 4096)
    fitp = memory.ComputeShape(n_ubatch=512, n_outputs=512, flash_attn=True, pipeline=True)
    assert memory.compute_bytes(llama, cs, 2, 4, True, fitp) > memory.compute_bytes(llama, cs, 2, 4, True, shape)


def test_recurrent_moe_layer_sizes_its_recurrent_block_too(tmp_path: Path) -> None:
    """qwen3next with small experts: the gated delta-net block is the widest phase of its recurrent layers (taking
    only the experts made these models' compute a third too low against llama-fit-params)."""
    p = load_profile(synth.write_qwen3next(tmp_path / "n.gguf", n_layer=4, n_embd=256, n_head=4, n_head_kv=2,
                                           head_dim=64, state_size=64, group_count=4, time_step_rank=8, n_expert=8,
                                           n_expert_used=1, n_ff_exp=32, n_ff_shexp=32, header_only=True))
    conv = p.n_embd_r // (p.ssm_conv_kernel - 1)
    assert conv == 2 * 4 * 64 + 8 * 64
    assert memory.layer_rows(p, 0) == memory.K_FFN * conv + memory.K_EMBD * p.n_embd  # recurrent layer
    assert p.n_embd_q[3] == 2 * 4 * 64  # gated attention: query + gate
    assert memory.layer_rows(p, 3) >= memory.K_ATTN_Q * p.n_embd_q[3]


def test_unchecked_family_gets_the_compute_margin(llama, tmp_path: Path) -> None:
    from dataclasses import replace

    cs = memory.context_sizes(llama, 4096)
    shape = memory.ComputeShape()
    checked = memory.compute_bytes(llama, cs, 0, 2, False, shape)
    unchecked = memory.compute_bytes(replace(llama, compute_checked=False), cs, 0, 2, False, shape)
    assert llama.compute_checked and unchecked == int(checked * (1 + memory.UNCHECKED_COMPUTE_MARGIN))


def test_rwkv7_state_is_two_token_shifts_and_a_wkv_matrix_per_layer(tmp_path: Path) -> None:
    """llama_hparams::n_embd_r = token_shift_count * n_embd, n_embd_s = n_embd * wkv_head_size; no KV at all."""
    prof = load_profile(synth.write_rwkv7(tmp_path / "r.gguf", n_layer=6, n_embd=512, head_size=64, n_ff=2048,
                                          n_vocab=32000, header_only=True))
    assert prof.recurrent_kind == "rwkv" and all(prof.is_recurrent) and not any(prof.has_kv)
    cs = memory.context_sizes(prof, 8192, n_parallel=3, kv_unified=False)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(6)] == [(2 * 512 + 512 * 64) * 4 * 3] * 6
    assert memory.kv_layer_bytes(prof, 0, cs) == 0


def test_nemotron_h_mlp_layers_hold_neither_kv_nor_state(tmp_path: Path) -> None:
    """A Nemotron-H layer is recurrent iff it has no KV heads and no FFN (src/models/nemotron-h.cpp): its MLP
    layers, which also have no KV heads, are neither."""
    prof = load_profile(synth.write_nemotron_h(tmp_path / "n.gguf", pattern="M-*M", n_embd=256, n_head=4,
                                               n_head_kv=2, head_dim=64, n_ff=512, d_inner=512, d_state=16,
                                               n_group=2, n_vocab=32000, header_only=True))
    assert prof.is_recurrent == (True, False, False, True) and prof.has_kv == (False, False, True, False)
    cs = memory.context_sizes(prof, 4096)
    conv = 3 * (512 + 2 * 2 * 16)  # (d_conv - 1) * (d_inner + 2 * n_group * d_state)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(4)] == [(conv + 16 * 512) * 4, 0, 0,
                                                                           (conv + 16 * 512) * 4]
    assert memory.kv_layer_bytes(prof, 2, cs) == 2 * 4096 * 2 * 64 * 2
    # the MLP has no gate: one n_ff-wide row at a time, not three
    assert memory.layer_rows(prof, 1) == memory.K_FFN_UP * 512 + memory.K_EMBD * 256


def test_falcon_h1_layers_hold_both_kv_and_state(tmp_path: Path) -> None:
    """Falcon-H1 runs attention and a Mamba-2 mixer side by side in every layer (llama.cpp's hybrid memory with
    both layer filters always true): each layer has a KV cache and a recurrent state."""
    prof = load_profile(synth.write_falcon_h1(tmp_path / "f.gguf", n_layer=3, n_embd=256, n_head=8, n_head_kv=2,
                                              head_dim=64, n_ff=512, d_inner=384, d_state=64, n_vocab=32000,
                                              header_only=True))
    assert prof.known_arch and not prof.warnings
    assert prof.is_recurrent == (True,) * 3 and prof.has_kv == (True,) * 3 and prof.recurrent_kind == "parallel"
    cs = memory.context_sizes(prof, 4096)
    conv = 3 * (384 + 2 * 64)  # (d_conv - 1) * (d_inner + 2 * n_group * d_state)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(3)] == [(conv + 64 * 384) * 4] * 3
    assert [memory.kv_layer_bytes(prof, il, cs) for il in range(3)] == [2 * 4096 * 2 * 64 * 2] * 3


def test_a_mamba2_tail_runs_on_the_next_card_only_between_two_mixers(tmp_path: Path) -> None:
    """llama.cpp pulls a Mamba-2 mixer's tail into the graph with the next layer that writes a cache: when that is
    a mixer on the next card, in_proj's row goes there and z comes back (measured: +48 MiB on that card,
    tests/test_plan_accuracy.py); an attention layer between them, or an MLP-only card, changes nothing."""
    prof = load_profile(synth.write_nemotron_h(tmp_path / "n.gguf", pattern="M-M*-M", n_embd=256, n_head=4,
                                               n_head_kv=2, head_dim=64, n_ff=512, d_inner=512, d_state=16,
                                               n_group=2, n_vocab=32000, header_only=True))
    x, conv = 512, 512 + 2 * 2 * 16
    assert memory.mamba2_hybrid(prof)
    bounce = memory.hybrid_ssm_bounce
    assert (bounce(prof, 0, 2), bounce(prof, 2, 6)) == (x, x + conv)  # M - | M * - M
    assert (bounce(prof, 0, 1), bounce(prof, 1, 2), bounce(prof, 2, 6)) == (x, 0, x + conv)  # M | - | M ...
    assert (bounce(prof, 0, 3), bounce(prof, 3, 6)) == (0, 0)  # M - M | * - M: attention pulls the tail in
    pure = load_profile(synth.write_mamba2(tmp_path / "m.gguf", n_layer=4, header_only=True))
    assert not memory.mamba2_hybrid(pure) and bounce(pure, 0, 2) == 0  # pure Mamba-2's formulas fold it in
