"""make_plan: integer layer counts that fit every card, the largest context, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.errors import BadInput, DoesNotFit
from arcsplit.model import load_profile
from arcsplit.planner import HOST_DEVICE, PlanOptions, make_plan, plan_for_split
from arcsplit.rig import Card, Rig

MiB = 1024 * 1024


def card(i: int, mib: int, backend: str = "sycl", margin: int = 0) -> Card:
    return Card(backend, i, f"card{i}", mib * MiB, mib * MiB, margin * MiB)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory):
    """A 7B-class llama (header only, sparse): about 12.5 GiB of f16 weights."""
    d = tmp_path_factory.mktemp("big")
    return load_profile(synth.write_llama(d / "b.gguf", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8,
                                          n_ff=11008, n_vocab=32000, ctx=32768, header_only=True))


def test_every_layer_placed_and_fits(big) -> None:
    rig = Rig((card(0, 16384, margin=1024), card(1, 16384, margin=1024)))
    plan = make_plan(big, rig, PlanOptions(n_ctx=8192))
    assert sum(plan.tensor_split) == big.n_layer + 1
    assert plan.cards[0].first_layer == 0 and plan.cards[-1].end_layer == big.n_layer + 1
    assert plan.cards[-1].has_output and not plan.cards[0].has_output
    for c in plan.cards:
        assert c.total <= c.card.budget_bytes
    args = plan.llama_server_args()
    assert args[args.index("-ts") + 1] == ",".join(map(str, plan.tensor_split))
    assert args[args.index("-ngl") + 1] == str(big.n_layer + 1)
    assert "--fit" in args and args[args.index("--fit") + 1] == "off"


def test_unequal_cards_split_in_proportion(big) -> None:
    """Arc B580 12 GB + Arc Pro B70 32 GB: the big card takes most layers; context is maximised."""
    rig = Rig((card(0, 12216, margin=1024), card(1, 32656, margin=1024)))
    plan = make_plan(big, rig, PlanOptions(n_ctx=None))
    small, large = plan.cards
    assert 0 < small.n_layers < large.n_layers
    assert plan.n_ctx == 32768  # fits the whole training context
    used = [c.total / c.card.budget_bytes for c in plan.cards]
    assert max(used) <= 1.0
    assert abs(used[0] - used[1]) < 0.25  # both cards filled to a similar share


def test_largest_context_is_found_and_is_the_edge(big) -> None:
    rig = Rig((card(0, 8192, margin=512), card(1, 8192, margin=512)))
    plan = make_plan(big, rig, PlanOptions(n_ctx=None))
    assert plan.n_ctx % 256 == 0 and 256 <= plan.n_ctx < 32768
    make_plan(big, rig, PlanOptions(n_ctx=plan.n_ctx))  # fits
    with pytest.raises(DoesNotFit):
        make_plan(big, rig, PlanOptions(n_ctx=plan.n_ctx + 256))


def test_max_context_capped_at_training(tmp_path: Path) -> None:
    p = load_profile(synth.write_llama(tmp_path / "m.gguf", ctx=2048))
    plan = make_plan(p, [card(0, 4096)], PlanOptions(n_ctx=None))
    assert plan.n_ctx == 2048


def test_quantized_kv_buys_context(big) -> None:
    rig = Rig((card(0, 8192, margin=512), card(1, 8192, margin=512)))
    f16 = make_plan(big, rig, PlanOptions(n_ctx=None))
    q8 = make_plan(big, rig, PlanOptions(n_ctx=None, cache_type_k="q8_0", cache_type_v="q8_0"))
    assert q8.n_ctx > f16.n_ctx


def test_does_not_fit_says_why_and_what_helps(big) -> None:
    rig = Rig((card(0, 8192, margin=512), card(1, 8192, margin=512)))
    with pytest.raises(DoesNotFit) as info:
        make_plan(big, rig, PlanOptions(n_ctx=32768, n_parallel=2))
    msg = str(info.value)
    assert "short by" in msg and "--ctx" in msg and "q8_0" in msg and "--np 1" in msg and "add a card" in msg
    assert "\n" not in msg
    with pytest.raises(DoesNotFit, match="short by"):
        make_plan(big, [card(0, 4096)], PlanOptions(n_ctx=None))


def test_host_card_keeps_first_layers(big) -> None:
    host = Card("cpu", 0, "host RAM", 32768 * MiB, 32768 * MiB, 0)
    plan = make_plan(big, [host, card(0, 8192, margin=512)], PlanOptions(n_ctx=4096), devices=[HOST_DEVICE, "SYCL0"])
    cpu, gpu = plan.cards
    assert cpu.first_layer == 0 and cpu.n_layers > 0 and gpu.has_output
    assert plan.tensor_split == (gpu.n_layers,)
    assert plan.n_gpu_layers == gpu.n_layers < big.n_layer + 1
    # as few layers as possible stay on the CPU: with one fewer there, the card would overflow
    fewer = plan_for_split(big, [host, card(0, 8192, margin=512)], PlanOptions(n_ctx=4096),
                           [cpu.n_layers - 1, gpu.n_layers + 1], devices=[HOST_DEVICE, "SYCL0"])
    assert fewer.cards[1].total > fewer.cards[1].card.budget_bytes
    with pytest.raises(BadInput, match="CPU card first"):
        make_plan(big, [card(0, 8192), host], PlanOptions(n_ctx=4096), devices=["SYCL0", HOST_DEVICE])


def test_plan_for_split_matches_llama_cpp_rule(big) -> None:
    rig = [card(0, 65536), card(1, 65536)]
    plan = plan_for_split(big, rig, PlanOptions(n_ctx=4096), [10, 23])
    assert [(c.first_layer, c.end_layer) for c in plan.cards] == [(0, 10), (10, 33)]
    with pytest.raises(BadInput, match="summing to 33"):
        plan_for_split(big, rig, PlanOptions(n_ctx=4096), [10, 10])


def test_bad_options(big) -> None:
    rig = [card(0, 65536)]
    with pytest.raises(BadInput):
        make_plan(big, rig, PlanOptions(n_ctx=4096, n_parallel=0))
    with pytest.raises(BadInput, match="flash attention"):
        make_plan(big, rig, PlanOptions(n_ctx=4096, cache_type_v="q4_0", flash_attn=False))
    with pytest.raises(BadInput):
        make_plan(big, rig, PlanOptions(n_ctx=-5))


def test_json_contract(big) -> None:
    plan = make_plan(big, [card(0, 20000), card(1, 20000)], PlanOptions(n_ctx=4096))
    d = plan.to_dict()
    assert isinstance(d["n_ctx"], int) and d["tensor_split"] == list(plan.tensor_split)
    for c in d["cards"]:
        assert set(c["bytes"]) == {"weights", "kv", "state", "compute", "total"}
        assert len(c["layers"]) == 2
    assert all(isinstance(a, str) for a in d["llama_server_args"])


def test_unknown_architecture_plans_with_warning(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=2)
    path.write_bytes(path.read_bytes().replace(b"llama", b"zorba"))
    plan = make_plan(load_profile(path), [card(0, 1024)], PlanOptions(n_ctx=1024))
    assert plan.warnings and sum(plan.tensor_split) == 3


def test_mtp_layers_count_but_weigh_nothing(tmp_path: Path) -> None:
    path = synth.write_qwen35(tmp_path / "q.gguf", n_layer=8)
    raw = path.read_bytes()
    assert b"qwen35.block_count" in raw
    p = load_profile(path)
    plan = make_plan(p, [card(0, 1024), card(1, 1024)], PlanOptions(n_ctx=1024))
    assert sum(plan.tensor_split) == p.n_layer + 1


def test_output_on_first_moves_the_output_layer_and_its_bytes(big) -> None:
    """Hybrid: the output layer on llama-server's own (first) card, moved there with -ot; the -ts units stay."""
    rig = Rig((card(0, 16384, backend="cuda"), card(1, 16384, backend="cuda")))
    last = make_plan(big, rig, PlanOptions(n_ctx=4096), devices=["CUDA0", "RPC0"])
    first = make_plan(big, rig, PlanOptions(n_ctx=4096, output_on_first=True), devices=["CUDA0", "RPC0"])
    assert first.tensor_split == last.tensor_split and sum(first.tensor_split) == big.n_layer + 1
    assert first.cards[0].has_output and not first.cards[1].has_output
    assert first.cards[0].weights - last.cards[0].weights == big.output_bytes
    assert last.cards[1].weights - first.cards[1].weights == big.output_bytes
    args = first.llama_server_args(["CUDA0", "RPC0"])
    assert args[args.index("-ot") + 1] == "^output=CUDA0"
    assert "-ot" not in last.llama_server_args(["CUDA0", "RPC0"])
    assert first.to_dict()["cards"][0]["has_output"] is True


def test_output_on_first_host_card_and_single_card(big) -> None:
    """On the CPU backend's hybrid the first card is llama-server's own CPU; one card has nowhere to move it."""
    rig = Rig((card(0, 65536, backend="cpu"), card(1, 65536, backend="cpu")))
    plan = make_plan(big, rig, PlanOptions(n_ctx=4096, output_on_first=True), devices=[HOST_DEVICE, "RPC0"])
    args = plan.llama_server_args(["RPC0"])
    assert args[args.index("-ot") + 1] == "^output=CPU" and plan.cards[0].has_output
    solo = make_plan(big, Rig((card(0, 65536),)), PlanOptions(n_ctx=4096, output_on_first=True))
    assert not solo.options.output_on_first and "-ot" not in solo.llama_server_args() and solo.cards[0].has_output


def test_output_on_first_refused_for_a_tied_output(tmp_path: Path) -> None:
    tied = load_profile(synth.write_llama(tmp_path / "t.gguf", n_layer=2, tied=True))
    with pytest.raises(BadInput, match="tie") as e:
        make_plan(tied, Rig((card(0, 4096), card(1, 4096))), PlanOptions(n_ctx=512, output_on_first=True))
    assert "--output-layer last" in str(e.value) and "\n" not in str(e.value)


def test_unchecked_architecture_says_so(tmp_path: Path) -> None:
    path = synth.write_llama(tmp_path / "m.gguf", n_layer=2)
    path.write_bytes(path.read_bytes().replace(b"llama", b"qwen2"))  # modelled, but compute never measured on it
    prof = load_profile(path)
    assert prof.known_arch and not prof.compute_checked
    plan = make_plan(prof, [card(0, 1024)], PlanOptions(n_ctx=1024))
    assert any("not checked on this architecture" in w for w in plan.warnings)


def test_plan_says_what_bounds_the_context(big) -> None:
    plan = make_plan(big, [card(0, 8192, margin=512), card(1, 8192, margin=512)], PlanOptions(n_ctx=None))
    assert plan.ctx_limit.startswith(plan.cards[0].device) or plan.ctx_limit.startswith(plan.cards[1].device)
    assert f"{plan.n_ctx + 256} tokens" in plan.ctx_limit
    assert {c.largest for c in plan.cards} <= {"weights", "kv", "state", "compute"}
    roomy = make_plan(big, [card(0, 65536), card(1, 65536)], PlanOptions(n_ctx=None))
    assert roomy.ctx_limit.startswith("the model's training context")
    assert make_plan(big, [card(0, 65536)], PlanOptions(n_ctx=2048)).ctx_limit == ""
