"""The seeds' models on the seeds' rigs: Qwen3-Coder-Next 80B-A3B (seed 003, 2x Arc Pro B70), Qwen3.6-35B-A3B
and Qwen3-30B-A3B (seeds 000/001, B70/B60), written header-only with their real tensor shapes and Q4_K_M types.

All slow: writing the three headers (150k-250k-token vocabularies) takes seconds. The files carry the shapes and
types llama.cpp expects; every layout plans them (offloading experts where the cards are too small); per card, the
plan against llama.cpp's own no-weights dry run (llama-fit-params -fitp on) for the same split and --n-cpu-moe over
real CPU rpc-servers: weights and KV exact, compute never below by more than 16 MiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf.constants import GGMLQuantizationType as Q

from arcsplit import synth
from arcsplit.model import load_profile, read_header
from arcsplit.planner import PlanOptions, make_plan, plan_for_split
from arcsplit.rig import load_layout

from arcsplit.llama.fitparams import RpcServers, fit_print

MiB = 1024 * 1024
GiB = 1024 * MiB
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("2x-arc-pro-b70", "arc-b580-plus-pro-b70", "4x-arc-pro-b60")


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("seeds")
    return {name: synth.write_seed(name, tmp / f"{name}.gguf") for name in synth.SEEDS}


def _tensors(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    return {t.name: (t.shape, t.ggml_type) for t in read_header(path).tensors}


def test_qwen3_coder_next_has_the_published_shapes_and_types(seeds) -> None:
    path = seeds["qwen3-coder-next-80b-a3b-q4_k_m"]
    t = _tensors(path)
    assert t["token_embd.weight"] == ((2048, 151936), Q.Q4_K)
    assert t["output.weight"] == ((2048, 151936), Q.Q6_K)
    assert t["blk.0.ffn_gate_exps.weight"] == ((2048, 512, 512), Q.Q4_K)
    assert t["blk.0.ffn_down_exps.weight"] == ((512, 2048, 512), Q.Q6_K)  # first eighth: more bits
    assert t["blk.6.ffn_down_exps.weight"][1] == Q.Q4_K
    assert t["blk.0.ffn_gate_inp.weight"] == ((2048, 512), Q.F32)
    assert t["blk.0.attn_qkv.weight"] == ((2048, 8192), Q.Q6_K)  # 2 x 16 k heads x 128 + 32 v heads x 128
    assert t["blk.0.ssm_ba.weight"] == ((2048, 64), Q.Q4_K)
    assert t["blk.0.ssm_conv1d.weight"] == ((4, 8192), Q.F32)
    assert t["blk.3.attn_q.weight"] == ((2048, 8192), Q.Q4_K)  # 16 heads x 256, query + gate
    assert t["blk.3.attn_k.weight"] == ((2048, 512), Q.Q4_K)
    p = load_profile(path)
    assert (p.arch, p.n_layer, p.n_expert, p.n_expert_used, p.n_ctx_train) == ("qwen3next", 48, 512, 10, 262144)
    assert sum(p.is_recurrent) == 36 and sum(p.has_kv) == 12 and p.compute_checked
    assert 44.5 * GiB < p.file_bytes < 45.5 * GiB  # published Q4_K_M: 48.5 GB


def test_qwen36_and_qwen3_30b_profiles(seeds) -> None:
    a = load_profile(seeds["qwen3.6-35b-a3b-q4_k_m"])
    assert (a.arch, a.n_layer, a.n_expert, a.n_expert_used, a.n_vocab) == ("qwen35moe", 40, 256, 8, 248320)
    assert sum(a.has_kv) == 10 and sum(a.is_recurrent) == 30
    b = load_profile(seeds["qwen3-30b-a3b-q4_k_m"])
    assert (b.arch, b.n_layer, b.n_expert, b.n_expert_used, b.n_head_kv[0]) == ("qwen3moe", 48, 128, 8, 4)
    assert 17 * GiB < b.file_bytes < 17.5 * GiB  # published Q4_K_M: 18.6 GB


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_seed_plans_on_every_layout(seeds, layout: str) -> None:
    rig = load_layout(ROOT / "layouts" / f"{layout}.toml")
    for name, path in seeds.items():
        prof = load_profile(path)
        plan = make_plan(prof, rig, PlanOptions(n_ctx=32768, moe_offload=None))
        for c in plan.cards:
            assert 0 < c.total <= c.card.budget_bytes, (name, layout, c.device)
        if (name, layout) == ("qwen3-coder-next-80b-a3b-q4_k_m", "arc-b580-plus-pro-b70"):
            assert plan.options.moe_offload > 0  # 45 GiB of weights, 42 GiB of cards: some experts stay in RAM
        else:
            assert plan.options.moe_offload == 0, (name, layout)


def test_seed_003_on_two_b70_holds_its_full_training_context(seeds) -> None:
    rig = load_layout(ROOT / "layouts" / "2x-arc-pro-b70.toml")
    plan = make_plan(load_profile(seeds["qwen3-coder-next-80b-a3b-q4_k_m"]), rig, PlanOptions(n_ctx=None))
    assert plan.n_ctx == 262144 and plan.tensor_split in ((24, 25), (25, 24))


@pytest.fixture(scope="module")
def rpc4(llama_bins):
    with RpcServers(llama_bins, 4) as servers:
        yield servers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_plans_match_llama_fit_params(llama_bins, rpc4, seeds, layout: str) -> None:
    rig = load_layout(ROOT / "layouts" / f"{layout}.toml")
    devs = [f"RPC{i}" for i in range(len(rig.cards))]
    for name, path in seeds.items():
        prof = load_profile(path)
        chosen = make_plan(prof, rig, PlanOptions(n_ctx=32768, moe_offload=None), devices=devs)
        n_off = chosen.options.moe_offload
        ts = list(chosen.tensor_split)
        opts = PlanOptions(n_ctx=32768, n_outputs=512, moe_offload=n_off)  # fit-params reserves n_ubatch logits rows
        plan = plan_for_split(prof, rig, opts, ts, devs)
        rows, _ = fit_print(llama_bins, path, rpc4, ["-c", "32768", "-np", "1", "-ub", "512", "-b", "2048", "-fa", "on",
                                                      "-ngl", str(sum(ts)), "-ts", ",".join(map(str, ts)),
                                                      "--device", ",".join(devs), "--n-cpu-moe", str(n_off)],
                            timeout=300)
        for cp in plan.cards:
            f = rows[cp.device]
            assert abs(cp.weights - f.model_mib * MiB) <= MiB, (name, layout, cp.device, "weights")
            assert abs(cp.kv + cp.state - f.context_mib * MiB) <= MiB, (name, layout, cp.device, "kv")
            under = f.compute_mib * MiB - cp.compute
            assert under <= 16 * MiB, (name, layout, cp.device, "compute under by MiB", under / MiB)
