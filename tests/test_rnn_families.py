"""Mamba-1, Jamba and RWKV-6: the synthetic writers make files the real llama.cpp loads and runs, and the planner
profiles them as llama.cpp does (recurrent state per layer, KV only on Jamba's attention layers).

State sizes: llama_hparams::n_embd_r / n_embd_s (src/llama-hparams.cpp); which layers are recurrent: jamba.cpp
load_arch_hparams (head_count_kv 0), mamba.cpp and rwkv6.cpp (every layer).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest

from arcsplit import memory, synth
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, plan_for_split
from arcsplit.rig import Card

MiB = 1024 * 1024


def test_mamba_state_is_a_conv_window_and_a_scan_state_per_layer(tmp_path: Path) -> None:
    """Mamba-1: conv state (d_conv - 1) * d_inner (no B/C groups), scan state d_state * d_inner, d_inner = 2 n_embd."""
    prof = load_profile(synth.write_mamba(tmp_path / "m.gguf", n_layer=6, n_embd=512, d_state=16, n_vocab=32000,
                                          header_only=True))
    assert prof.recurrent_kind == "all" and all(prof.is_recurrent) and not any(prof.has_kv)
    assert (prof.n_embd_r, prof.n_embd_s) == (3 * 1024, 16 * 1024)
    cs = memory.context_sizes(prof, 4096, n_parallel=2, kv_unified=False)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(6)] == [(3 * 1024 + 16 * 1024) * 4 * 2] * 6


def test_jamba_attention_layers_hold_kv_and_the_others_state(tmp_path: Path) -> None:
    """Jamba: a layer is recurrent iff its KV head count is 0; its experts are feed_forward_length wide."""
    prof = load_profile(synth.write_jamba(tmp_path / "j.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2,
                                          attn_period=4, attn_offset=2, n_ff=512, n_expert=4, n_expert_used=2,
                                          n_vocab=32000, header_only=True))
    assert prof.has_kv == tuple(il % 4 == 2 for il in range(8))
    assert prof.is_recurrent == tuple(il % 4 != 2 for il in range(8))
    assert prof.n_ff_exp == 512 and prof.n_expert_used == 2
    assert [bool(b) for b in prof.expert_bytes] == [il % 2 == 1 for il in range(8)]
    cs = memory.context_sizes(prof, 4096)
    assert memory.kv_layer_bytes(prof, 2, cs) == 2 * 4096 * 2 * 64 * 2 and memory.state_layer_bytes(prof, 2, cs) == 0
    assert memory.state_layer_bytes(prof, 0, cs) == (3 * 512 + 16 * 512) * 4 and memory.kv_layer_bytes(prof, 0, cs) == 0


def test_rwkv6_state_is_two_token_shifts_and_a_wkv_matrix_per_layer(tmp_path: Path) -> None:
    prof = load_profile(synth.write_rwkv6(tmp_path / "r.gguf", n_layer=6, n_embd=512, head_size=64, n_ff=1792,
                                          n_vocab=32000, header_only=True))
    assert prof.recurrent_kind == "rwkv" and all(prof.is_recurrent) and not any(prof.has_kv)
    cs = memory.context_sizes(prof, 8192, n_parallel=3, kv_unified=False)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(6)] == [(2 * 512 + 512 * 64) * 4 * 3] * 6


@pytest.fixture(scope="module")
def rpc(llama_bins):
    from arcsplit.llama.fitparams import RpcServers

    with RpcServers(llama_bins, 2) as servers:
        yield servers


def _small(family: str, tmp: Path) -> Path:
    """Full-weights files of a few MB (random weights: the text is noise, the graph is the real one)."""
    if family == "mamba":
        return synth.write_mamba(tmp / "mamba.gguf", n_layer=6, n_embd=256, n_vocab=4096)
    if family == "jamba":
        return synth.write_jamba(tmp / "jamba.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, attn_period=4,
                                 attn_offset=1, n_ff=512, n_expert=4, n_expert_used=2, n_vocab=4096)
    return synth.write_rwkv6(tmp / "rwkv6.gguf", n_layer=6, n_embd=256, head_size=64, n_ff=896, n_vocab=4096)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "jamba", "rwkv6"])
def test_writer_loads_in_llama_server_within_the_plan(llama_bins, rpc, tmp_path: Path, family: str) -> None:
    """The file loads in a real llama-server over two rpc-servers and generates; each card's buffers as
    llama-server reports them are never above the plan by more than 16 MiB, and its weights and KV+state are the
    plan's to the MiB."""
    from arcsplit.llama.logs import parse_buffer_line, sum_buffers
    from arcsplit.run.ports import free_port

    path = _small(family, tmp_path)
    prof = load_profile(path)
    assert prof.known_arch and prof.arch == family
    cards = [Card("cpu", i, f"rpc{i}", 65536 * MiB, 65536 * MiB, 0) for i in range(2)]
    plan = plan_for_split(prof, cards, PlanOptions(n_ctx=4096), [3, 4], ["RPC0", "RPC1"])
    port = free_port()
    argv = [str(llama_bins.server), "-m", str(path), "--rpc", ",".join(rpc.endpoints), "--host", "127.0.0.1",
            "--port", str(port), "-t", "1", "-lv", "4", *plan.llama_server_args()]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, log.read_text()[-2000:]
                time.sleep(0.1)
            r = httpx.post(f"{url}/completion", json={"prompt": "hello", "n_predict": 4, "temperature": 0}, timeout=120)
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        finally:
            proc.terminate()
            proc.wait(30)
    used = sum_buffers(b for b in map(parse_buffer_line, log.read_text().splitlines()) if b)
    for cp, ep in zip(plan.cards, rpc.endpoints):
        assert {"model", "compute"} <= set(used[ep]), used  # llama-server reported this card's buffers
        assert abs(cp.weights - used[ep]["model"]) <= MiB, (family, cp.device, cp.weights / MiB, used[ep])
        ctx = used[ep].get("KV", 0) + used[ep].get("RS", 0)
        assert abs(cp.kv + cp.state - ctx) <= MiB, (family, cp.device, (cp.kv + cp.state) / MiB, used[ep])
        assert cp.total >= sum(used[ep].values()) - 16 * MiB, (family, cp.device, cp.total / MiB, used[ep])
