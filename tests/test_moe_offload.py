"""MoE expert offload (``--moe-offload``): routed experts of the first N layers in host RAM via ``--n-cpu-moe``.

The fast tests plan header-only models; the slow ones plan seed 003's model through the CLI and serve a small real MoE on CPU cards that cannot hold it,
with the experts llama.cpp keeps on llama-server's CPU, and checks the greedy tokens against a run that holds
everything on the cards.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from arcsplit import synth
from arcsplit.cli import main
from arcsplit.errors import BadInput, DoesNotFit
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, make_plan
from arcsplit.rig import Card

MiB = 1024 * 1024
GiB = 1024 * MiB


def _cards(mib: int, n: int = 2) -> list[Card]:
    return [Card("cpu", i, f"rpc{i}", mib * MiB, mib * MiB, 16 * MiB) for i in range(n)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):
    """About 1.5 GiB of routed experts in 12 layers, header only."""
    path = synth.write_qwen3moe(tmp_path_factory.mktemp("moe") / "moe.gguf", n_layer=12, n_embd=1024, n_head=16,
                                n_head_kv=4, head_dim=64, n_expert=64, n_expert_used=4, n_ff_exp=512,
                                n_vocab=32000, header_only=True)
    return load_profile(path)


def test_fitting_model_keeps_every_expert_on_the_cards(moe) -> None:
    plan = make_plan(moe, _cards(4096), PlanOptions(n_ctx=4096, moe_offload=None))
    assert plan.options.moe_offload == 0 and plan.host_expert_bytes == 0
    assert "--n-cpu-moe" not in plan.llama_server_args()


def test_auto_offloads_the_fewest_layers_that_fit(moe) -> None:
    cards = _cards(800)
    with pytest.raises(DoesNotFit, match="--moe-offload auto"):
        make_plan(moe, cards, PlanOptions(n_ctx=4096, moe_offload=0))
    plan = make_plan(moe, cards, PlanOptions(n_ctx=4096, moe_offload=None))
    n = plan.options.moe_offload
    assert 0 < n < moe.n_layer
    with pytest.raises(DoesNotFit):  # one layer fewer does not fit: n is the fewest
        make_plan(moe, cards, PlanOptions(n_ctx=4096, moe_offload=n - 1))
    args = plan.llama_server_args()
    assert args[args.index("--n-cpu-moe") + 1] == str(n)
    assert plan.host_expert_bytes == sum(moe.expert_bytes[:n])
    assert plan.host_read_per_token == int(plan.host_expert_bytes * moe.n_expert_used / moe.n_expert)
    assert plan.host_bytes > plan.host_expert_bytes + moe.host_bytes  # plus the CPU's compute for those experts
    for c in plan.cards:
        assert c.total <= c.card.budget_bytes
    # the cards hold every layer's attention, norms and router; only the routed experts of layers < n moved
    assert sum(c.weights for c in plan.cards) == sum(moe.layer_bytes) + moe.output_bytes - plan.host_expert_bytes
    assert plan.to_dict()["moe_offload"]["layers"] == n


def test_a_given_count_is_used_as_is(moe) -> None:
    plan = make_plan(moe, _cards(4096), PlanOptions(n_ctx=4096, moe_offload=3))
    assert plan.options.moe_offload == 3 and plan.host_expert_bytes == sum(moe.expert_bytes[:3])


def test_host_ram_too_small_says_so(moe) -> None:
    with pytest.raises(DoesNotFit, match="host RAM"):
        make_plan(moe, _cards(800), PlanOptions(n_ctx=4096, moe_offload=None, host_budget=64 * MiB))


def test_bad_counts_are_one_line_errors(moe, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="more than the model's 12 layers"):
        make_plan(moe, _cards(4096), PlanOptions(n_ctx=4096, moe_offload=13))
    dense = load_profile(synth.write_llama(tmp_path / "dense.gguf", header_only=True))
    with pytest.raises(BadInput, match="no routed experts"):
        make_plan(dense, _cards(4096), PlanOptions(n_ctx=4096, moe_offload=2))
    assert make_plan(dense, _cards(4096), PlanOptions(n_ctx=4096, moe_offload=None)).options.moe_offload == 0


@pytest.mark.slow  # writes seed 003's header (a 152k-token vocabulary): seconds
def test_cli_proposes_offload_for_seed_003_on_b580_plus_b70(tmp_path: Path, capsys) -> None:
    """Qwen3-Coder-Next Q4_K_M (46 GiB) does not fit 12 + 32 GB cards; ``plan`` keeps some experts in host RAM."""
    model = synth.write_seed("qwen3-coder-next-80b-a3b-q4_k_m", tmp_path / "coder-next.gguf")
    root = Path(__file__).resolve().parent.parent
    cmd = ["plan", str(model), "--layout", str(root / "layouts" / "arc-b580-plus-pro-b70.toml"), "--ctx", "32768"]
    assert main([*cmd, "--moe-offload", "off"]) == 2
    assert "--moe-offload auto" in capsys.readouterr().err
    assert main(cmd) == 0
    out = capsys.readouterr().out
    assert "--n-cpu-moe" in out and "reads about" in out
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--moe-offload", "some"])
    assert exc.value.code == 2 and "not auto, off or a layer count" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_with_experts_in_host_ram_matches_all_on_cards(llama_bins, tmp_path_factory) -> None:
    """Two 64 MiB CPU cards cannot hold the 8-layer MoE: auto keeps some experts on llama-server's CPU, the
    group loads for real, and greedy tokens equal a run with every expert on the cards."""
    import arcsplit
    from arcsplit.proc.ports import free_port
    from _instance import isolated_env

    model = synth.write_qwen3moe(tmp_path_factory.mktemp("moe-real") / "moe.gguf", n_layer=8, n_embd=256,
                                 n_head=4, n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=2, n_ff_exp=256,
                                 n_vocab=2000, seed=3)
    prof = load_profile(model)
    assert sum(prof.expert_bytes) > 40 * MiB

    def greedy(**kw) -> tuple[list[int], object]:
        with arcsplit.serve(model, gpus=[0, 1], backend="cpu", ctx=512, threads=1, port=free_port(),
                            max_restarts=0, extra_args=("--no-repack",), **kw) as srv:
            r = httpx.post(f"{srv.url}/completion", json={"prompt": "a b c", "n_predict": 16, "temperature": 0,
                                                         "top_k": 1, "cache_prompt": False, "return_tokens": True},
                           timeout=120)
            r.raise_for_status()
            return r.json()["tokens"], srv.plan

    with isolated_env(tmp_path_factory.mktemp("moe-state"), llama_bins.bin_dir):
        ref, ref_plan = greedy(cpu_memory_mib=1024, moe_offload=0)
        got, plan = greedy(cpu_memory_mib=40, moe_offload=None, host_memory_mib=1024)
    assert ref_plan.options.moe_offload == 0
    assert 0 < plan.options.moe_offload < prof.n_layer
    assert "--n-cpu-moe" in plan.llama_server_args()
    assert len(ref) == 16 and got == ref
