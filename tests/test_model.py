"""GGUF header -> ModelProfile: real files (the demo Gemma 3, synthetic models written by arcsplit.synth)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.errors import ModelError
from arcsplit.model import load_profile, read_header


def test_demo_model_profile(demo_model: Path) -> None:
    p = load_profile(demo_model)
    assert p.arch == "gemma3"
    assert p.n_layer == 18 and p.n_layer_nextn == 0
    assert p.n_vocab == 262144 and p.n_ctx_train == 32768
    # gemma3's default pattern 6: every 6th layer is full attention, the rest slide over 512 tokens
    assert [il for il in range(18) if not p.is_swa[il]] == [5, 11, 17]
    assert p.n_swa == 512
    assert p.tied_output and p.output_bytes >= p.token_embd_bytes  # the duplicated token_embd goes to the last card
    assert p.host_bytes == p.token_embd_bytes
    assert all(k == 256 for k in p.n_embd_k)  # 1 KV head x 256
    total = sum(p.layer_bytes) + p.output_bytes + p.host_bytes - p.token_embd_bytes
    assert abs(total - p.file_bytes) < 0.05 * p.file_bytes


def test_llama_shapes_come_from_the_file(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=400)
    p = load_profile(path)
    assert (p.arch, p.n_layer, p.n_embd, p.n_vocab) == ("llama", 3, 64, 400)
    assert p.n_head == (4, 4, 4) and p.n_head_kv == (2, 2, 2)
    assert p.n_embd_k == (32, 32, 32) and p.n_embd_v == (32, 32, 32)
    per_layer = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96) + 4 * 2 * 64  # f16 matrices, f32 norms
    assert p.layer_bytes == (per_layer,) * 3
    assert not p.tied_output and p.output_bytes == 2 * 64 * 400 + 4 * 64


def test_per_layer_kv_heads(tmp_path: Path) -> None:
    p = load_profile(synth.write_llama(tmp_path / "m.gguf", n_layer=4, n_head_kv=[4, 2, 1, 2]))
    assert p.n_head_kv == (4, 2, 1, 2)
    assert p.n_embd_k == (64, 32, 16, 32)


def test_moe_expert_bytes(tmp_path: Path) -> None:
    p = load_profile(synth.write_qwen3moe(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_expert=8, n_ff_exp=32))
    assert p.n_expert == 8 and p.n_expert_used == 2 and p.n_ff_exp == 32
    assert all(e == 3 * 64 * 32 * 8 * 2 for e in p.expert_bytes)
    assert all(lb > e for lb, e in zip(p.layer_bytes, p.expert_bytes))


def test_hybrid_recurrent_layers(tmp_path: Path) -> None:
    p = load_profile(synth.write_qwen35(tmp_path / "m.gguf", n_layer=8, conv_kernel=4, state_size=16, group_count=2,
                                        time_step_rank=4))
    assert p.is_recurrent == (True, True, True, False, True, True, True, False)
    assert p.has_kv == tuple(not r for r in p.is_recurrent)
    inner = 16 * 4
    assert p.n_embd_r == 3 * (inner + 2 * 2 * 16) and p.n_embd_s == 16 * inner


def test_mla_caches_k_only(tmp_path: Path) -> None:
    p = load_profile(synth.write_deepseek2(tmp_path / "m.gguf", kv_lora_rank=64, rope_dim=32))
    assert p.mla
    assert set(p.n_embd_k) == {96} and set(p.n_embd_v) == {0}


def test_split_model_reads_every_shard(tmp_path: Path) -> None:
    first = synth.write_sharded_llama(tmp_path / "s.gguf", n_shards=3, n_layer=4)
    whole = load_profile(synth.write_llama(tmp_path / "w.gguf", n_layer=4))
    p = load_profile(first)
    assert len(p.shards) == 3
    assert p.layer_bytes == whole.layer_bytes and p.output_bytes == whole.output_bytes
    second = Path(p.shards[1])
    assert load_profile(second).path == p.path  # any shard names the model; the plan points at the first
    second.unlink()
    with pytest.raises(ModelError, match=second.name):
        load_profile(first)


def test_huge_sparse_file_plans_without_reading_it(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "big.gguf", n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672,
                             n_vocab=32000, header_only=True)
    assert path.stat().st_size > 50 * 1024**3
    assert path.stat().st_blocks * 512 < 64 * 1024**2  # sparse: the data was never written
    t0 = time.perf_counter()
    p = load_profile(path, cache=False)
    assert time.perf_counter() - t0 < 0.5
    assert sum(p.layer_bytes) > 50 * 1024**3


def _gguf_prefix(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a gguf file at all, just text" * 4, "not a GGUF"),
        (b"GG", "not a GGUF"),
        (_gguf_prefix(version=7) + b"\0" * 64, "unsupported GGUF version 7"),
        (_gguf_prefix(n_tensors=2**60) + b"\0" * 64, "tensors"),
        (_gguf_prefix(n_kv=2**60) + b"\0" * 64, "metadata keys"),
        (_gguf_prefix(n_kv=1) + struct.pack("<Q", 2**62) + b"k" * 40, "forged"),
        (_gguf_prefix(n_kv=1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 99) + b"\0" * 40, "unknown value type"),
    ],
)
def test_bad_files_are_one_line_model_errors(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "bad.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelError, match=message) as info:
        load_profile(f)
    assert "\n" not in str(info.value)


def test_truncated_header_and_data(tmp_path: Path) -> None:
    good = synth.write_llama(tmp_path / "m.gguf")
    h = read_header(good)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: h.data_offset // 2])
    with pytest.raises(ModelError, match="truncated"):
        load_profile(cut)
    cut.write_bytes(data[: h.data_offset + 100])
    with pytest.raises(ModelError, match="outside the file"):
        load_profile(cut)


def test_absurd_block_count(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=2)
    raw = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = raw.index(key) + len(key) + 4  # past the u32 value type
    raw[at : at + 4] = struct.pack("<I", 100000)
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="block_count"):
        load_profile(path)


def test_unknown_architecture_still_profiles(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=2)
    raw = path.read_bytes().replace(b"llama", b"zorba")  # same length: a valid file of an unknown architecture
    path.write_bytes(raw)
    p = load_profile(path)
    assert p.arch == "zorba" and not p.known_arch
    assert p.warnings and "not modelled" in p.warnings[0]
    assert sum(p.layer_bytes) > 0


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_profile(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match="directory"):
        load_profile(tmp_path)


def test_profile_cache_roundtrip_and_invalidation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=2)
    fresh = load_profile(path, cache=False)
    assert load_profile(path) == fresh  # miss: read and stored
    assert list((tmp_path / "cache" / "profiles").glob("*.json"))
    assert load_profile(path) == fresh  # hit
    synth.write_llama(path, n_layer=3)  # the same path, a different model
    assert load_profile(path).n_layer == 3


@pytest.mark.slow  # a large vocabulary, seconds
def test_string_arrays_of_every_shape_are_walked_exactly(tmp_path: Path) -> None:
    """The bulk path for short strings must land exactly where the one-by-one walk does: long, empty and NUL-holding
    strings in the middle of a large vocabulary, across reader windows, then keys and tensors read right after."""
    import random

    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    rnd = random.Random(7)
    tokens: list[str] = []
    for i in range(60000):
        r = rnd.random()
        if r < 0.002:
            tokens.append("")
        elif r < 0.004:
            tokens.append("x" * rnd.choice((255, 256, 300, 70000)))
        elif r < 0.006:
            tokens.append("\0" * rnd.randint(1, 9))
        else:
            tokens.append("".join(rnd.choice("ab\u00e9\u4e2d ") for _ in range(rnd.randint(1, 24))))
    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_uint32("after.tokens", 4242)
    w.add_array("tokenizer.ggml.merges", [t[:5] for t in tokens[:3000]] + ["\0" * 8] * 200)
    w.add_string("after.merges", "still here")
    w.add_tensor("token_embd.weight", np.zeros((7, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    h = read_header(path)
    assert h.metadata["tokenizer.ggml.tokens"].length == len(tokens)
    assert h.metadata["after.tokens"] == 4242 and h.metadata["after.merges"] == "still here"
    ref = GGUFReader(str(path))  # the official reader, as the reference walk
    assert h.data_offset == ref.data_offset
    assert [(t.name, t.shape, t.offset) for t in h.tensors] == [
        (t.name, tuple(int(x) for x in t.shape), int(t.data_offset) - ref.data_offset) for t in ref.tensors
    ]
