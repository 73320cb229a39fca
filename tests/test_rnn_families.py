"""Mamba-1, Jamba and RWKV-6: the synthetic writers make files the real llama.cpp loads and runs, and the planner
profiles them as llama.cpp does (recurrent state per layer, KV only on Jamba's attention layers).

State sizes: llama_hparams::n_embd_r / n_embd_s (src/llama-hparams.cpp); which layers are recurrent: jamba.cpp
load_arch_hparams (head_count_kv 0), mamba.cpp and rwkv6.cpp (every layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit import memory, synth
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, plan_for_split
from arcsplit.rig import Card

from _plan_load import load_plan

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
    assert prof.recurrent_kind == "rwkv6" and all(prof.is_recurrent) and not any(prof.has_kv)
    cs = memory.context_sizes(prof, 8192, n_parallel=3, kv_unified=False)
    assert [memory.state_layer_bytes(prof, il, cs) for il in range(6)] == [(2 * 512 + 512 * 64) * 4 * 3] * 6
    # its time mix is sized as RWKV-6's, not RWKV-7's
    assert memory.layer_rows(prof, 0) == memory.K_RWKV6 * 512


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
    path = _small(family, tmp_path)
    prof = load_profile(path)
    assert prof.known_arch and prof.arch == family
    cards = [Card("cpu", i, f"rpc{i}", 65536 * MiB, 65536 * MiB, 0) for i in range(2)]
    plan = plan_for_split(prof, cards, PlanOptions(n_ctx=4096), [3, 4], ["RPC0", "RPC1"])
    used = load_plan(llama_bins, rpc, path, plan, tmp_path)
    for cp, ep in zip(plan.cards, rpc.endpoints):
        assert abs(cp.weights - used[ep]["model"]) <= MiB, (family, cp.device, cp.weights / MiB, used[ep])
        ctx = used[ep].get("KV", 0) + used[ep].get("RS", 0)
        assert abs(cp.kv + cp.state - ctx) <= MiB, (family, cp.device, (cp.kv + cp.state) / MiB, used[ep])
        assert cp.total >= sum(used[ep].values()) - 16 * MiB, (family, cp.device, cp.total / MiB, used[ep])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "jamba", "rwkv6"])
def test_plan_matches_fit_params(llama_bins, rpc, tmp_path: Path, family: str) -> None:
    """At the accuracy bench's shapes (n_embd 1024, 12 layers, 32000 tokens), one card and a 1 : 2 split: weights
    and KV+state to the MiB of llama-fit-params' dry run, each card's total within max(2 %, 16 MiB) and never
    more than 16 MiB below (issue 16's target; the three families are marked checked on the strength of it)."""
    from arcsplit.llama.fitparams import fit_print

    if family == "mamba":
        path = synth.write_mamba(tmp_path / "m.gguf", n_layer=12, n_embd=1024, n_vocab=32000, header_only=True)
    elif family == "jamba":
        path = synth.write_jamba(tmp_path / "j.gguf", n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, attn_period=4,
                                 attn_offset=2, n_ff=2816, n_expert=16, n_expert_used=2, n_vocab=32000,
                                 header_only=True)
    else:
        path = synth.write_rwkv6(tmp_path / "r.gguf", n_layer=12, n_embd=1024, n_vocab=32000, header_only=True)
    prof = load_profile(path)
    assert prof.compute_checked
    for ts in ([13], [4, 9]):
        devs = [f"RPC{i}" for i in range(len(ts))]
        cards = [Card("cpu", i, f"rpc{i}", 65536 * MiB, 65536 * MiB, 0) for i in range(len(ts))]
        plan = plan_for_split(prof, cards, PlanOptions(n_ctx=4096, n_outputs=512), ts, devs)
        args = ["-c", "4096", "-np", "1", "-ub", "512", "-fa", "on", "-ngl", "13", "--device", ",".join(devs)]
        rows, _ = fit_print(llama_bins, path, rpc, args + (["-ts", ",".join(map(str, ts))] if len(ts) > 1 else []))
        for cp in plan.cards:
            f = rows[cp.device]
            fit = (f.model_mib + f.context_mib + f.compute_mib) * MiB
            err = cp.total - fit
            assert abs(cp.weights - f.model_mib * MiB) <= MiB, (ts, cp.device, "weights")
            assert abs(cp.kv + cp.state - f.context_mib * MiB) <= MiB, (ts, cp.device, "kv+state")
            assert abs(err) <= max(0.02 * fit, 16 * MiB) and err >= -16 * MiB, (ts, cp.device, err / MiB)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "mamba2", "rwkv6", "rwkv7", "jamba"])
def test_middle_cards_of_a_recurrent_pipeline_match_fit_params(llama_bins, tmp_path: Path, family: str) -> None:
    """Four cards: a card between two others sees the mixer's tail cross both of its boundaries and come back (four
    copies each way); planned within max(2 %, 16 MiB) of llama-fit-params and never more than 16 MiB below, like
    the first and last cards."""
    from arcsplit.llama.fitparams import RpcServers, fit_print

    kw = dict(n_layer=12, n_embd=1024, n_vocab=32000, header_only=True)
    path = {"mamba": lambda: synth.write_mamba(tmp_path / "m.gguf", **kw),
            "mamba2": lambda: synth.write_mamba2(tmp_path / "m2.gguf", d_inner=2048, d_state=128, head_dim=64, **kw),
            "rwkv6": lambda: synth.write_rwkv6(tmp_path / "r6.gguf", **kw),
            "rwkv7": lambda: synth.write_rwkv7(tmp_path / "r7.gguf", **kw),
            # attention every 4th layer from the 2nd, experts in odd layers: card boundaries after a dense Mamba-1
            # layer (its gate crosses) and after an attention layer
            "jamba": lambda: synth.write_jamba(tmp_path / "j.gguf", n_head=16, n_head_kv=4, attn_period=4, attn_offset=1,
                                               n_ff=2816, n_expert=16, n_expert_used=2, **kw)}[family]()
    prof = load_profile(path)
    ts = [3, 3, 3, 4]
    devs = [f"RPC{i}" for i in range(4)]
    cards = [Card("cpu", i, f"rpc{i}", 65536 * MiB, 65536 * MiB, 0) for i in range(4)]
    plan = plan_for_split(prof, cards, PlanOptions(n_ctx=4096, n_outputs=512), ts, devs)
    with RpcServers(llama_bins, 4) as rpc:
        rows, _ = fit_print(llama_bins, path, rpc, ["-c", "4096", "-np", "1", "-ub", "512", "-fa", "on", "-ngl", "13",
                                                    "-ts", "3,3,3,4", "--device", ",".join(devs)])
    for cp in plan.cards:
        f = rows[cp.device]
        fit = (f.model_mib + f.context_mib + f.compute_mib) * MiB
        err = cp.total - fit
        assert abs(err) <= max(0.02 * fit, 16 * MiB) and err >= -16 * MiB, (cp.device, err / MiB)
