"""Patch 0015's plan side, pure: an all-RPC group holds the token embeddings on its first card (PlanOptions.
input_on_first) on a GPU backend or where that card is on another host, or where the user asks
(ARCSPLIT_INPUT_ON_CARD=1); llama-server
is told so, and the link to a first card on another host carries token ids instead of embeddings.
tests/test_patches.py serves it for real on one machine."""

from __future__ import annotations

import pytest

from arcsplit import synth
from arcsplit.llama import patches
from arcsplit.model import load_profile
from arcsplit.planner import TOKEN_ID_BYTES, PlanOptions, make_plan, plan_for_split
from arcsplit.rig import Card, Host, Rig
from arcsplit.route import HOST_DEVICE, Route

MiB = 1024 * 1024


def _card(i: int, host: str = "", backend: str = "cuda") -> Card:
    return Card(backend, i, f"card {host or 'here'}{i}", 8192 * MiB, 8192 * MiB, 0, host=host)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    return load_profile(synth.write_llama(tmp_path_factory.mktemp("m") / "u.gguf", n_layer=8, n_embd=256,
                                          n_vocab=4096, header_only=True))


def _plan(profile, mode: str, hosts: list[str], on: bool | None = True, host_list: tuple[Host, ...] = (),
          split: list[int] | None = None):
    rig = Rig(tuple(_card(i, h) for i, h in enumerate(hosts)), hosts=host_list)
    route = Route.build(mode, "cuda", [c.index for c in rig.cards], [c.host for c in rig.cards])
    options = PlanOptions(n_ctx=2048, n_ubatch=256, input_on_first=route.input_on_card(on))
    if split is not None:
        return plan_for_split(profile, rig, options, split, devices=route.devices)
    return make_plan(profile, rig, options, devices=route.devices)


def test_all_rpc_holds_the_token_embeddings_on_its_first_card(llama) -> None:
    on, off = _plan(llama, "rpc", ["", ""], split=[4, 5]), _plan(llama, "rpc", ["", ""], on=False, split=[4, 5])
    assert on.options.input_on_first and not off.options.input_on_first
    assert llama.host_bytes >= llama.token_embd_bytes > 0
    # the same split: the first card carries the embeddings, the host none of them
    assert on.cards[0].weights == off.cards[0].weights + llama.host_bytes
    assert on.cards[1].weights == off.cards[1].weights
    assert on.host_bytes == off.host_bytes - llama.host_bytes
    assert "-ot" not in on.llama_server_args()  # no tensor override: llama.cpp keeps pipeline parallelism
    balanced = _plan(llama, "rpc", ["", ""])
    assert [c.n_layers for c in balanced.cards] == [4, 5]  # the planner weighs them: the first card takes fewer layers


@pytest.mark.parametrize("mode", ["hybrid", "single", "multi"])
def test_groups_whose_first_card_is_llama_servers_own_keep_them_on_its_cpu(llama, mode) -> None:
    cards = ["", ""] if mode != "single" else [""]
    plan = _plan(llama, mode, cards)
    assert not plan.options.input_on_first
    assert plan.host_bytes >= llama.host_bytes


def test_a_cpu_card_holding_layer_zero_keeps_the_input_there(llama) -> None:
    rig = Rig((Card("cpu", 0, "cpu", 8192 * MiB, 8192 * MiB, 0), Card("cpu", 1, "cpu", 8192 * MiB, 8192 * MiB, 0)))
    plan = make_plan(llama, rig, PlanOptions(n_ctx=2048, input_on_first=True), devices=[HOST_DEVICE, "RPC0"])
    assert not plan.options.input_on_first


def test_llama_server_is_told_where_the_plan_put_them(llama, tmp_path, monkeypatch) -> None:
    """ARCSPLIT_INPUT_ON_CARD=1 in llama-server's environment exactly when the plan holds the embeddings on the first
    card: on one machine only when the user asks; a plan that keeps them on the CPU passes the user's variable on as 0
    (llama-server would otherwise read a 1 where the plan has no room for them)."""
    from arcsplit.decide.prepare import ServeRequest, planned_specs, preview

    model = synth.write_llama(tmp_path / "m.gguf", n_layer=8, n_embd=256, n_vocab=4096)
    for env, mode, want in ((None, "rpc", None), ("1", "rpc", "1"), ("0", "rpc", "0"), (None, "hybrid", None),
                            ("1", "hybrid", "0")):
        if env is None:
            monkeypatch.delenv(patches.INPUT_ON_CARD_ENV, raising=False)
        else:
            monkeypatch.setenv(patches.INPUT_ON_CARD_ENV, env)
        p = preview(ServeRequest(model=str(model), gpus="0,1", backend="cpu", mode=mode, ctx=1024))
        server = next(s for s in planned_specs(p) if s.role == "server")
        assert server.env_dict.get(patches.INPUT_ON_CARD_ENV) == want, (env, mode)
        assert p.config.plan.options.input_on_first == (want == "1")


def test_the_switch_is_0_or_1_or_one_clear_line() -> None:
    from arcsplit.errors import BadInput

    assert patches.input_on_card({}) is None  # auto: Route.input_on_card decides
    assert patches.input_on_card({patches.INPUT_ON_CARD_ENV: "0"}) is False
    assert patches.input_on_card({patches.INPUT_ON_CARD_ENV: "1"}) is True
    with pytest.raises(BadInput, match=patches.INPUT_ON_CARD_ENV) as err:
        patches.check_switches({patches.INPUT_ON_CARD_ENV: "first"})
    assert "=1" in (err.value.fix or "") and "0 to keep" in (err.value.fix or "") and "unset it" in (err.value.fix or "")


def test_auto_holds_them_on_a_gpu_first_card_or_one_on_another_host() -> None:
    assert Route.build("rpc", "cuda", [0, 1], ["b", "b"]).input_on_card() is True
    assert Route.build("rpc", "cuda", [0, 1]).input_on_card() is True  # measured: dense first token 0.94x, 3 of 3
    assert Route.build("rpc", "sycl", [0, 1]).input_on_card() is True
    assert Route.build("rpc", "cpu", [0, 1]).input_on_card() is False  # CPU cards here: compute-bound, nothing to gain
    assert Route.build("rpc", "cpu", [0, 1], ["b", "b"]).input_on_card() is True
    assert Route.build("rpc", "cpu", [0, 1], ["", "b"]).input_on_card() is False  # first card here: no link to cross
    assert Route.build("rpc", "cpu", [0, 1]).input_on_card(True) is True
    assert Route.build("rpc", "cuda", [0, 1], ["b", "b"]).input_on_card(False) is False
    assert Route.build("hybrid", "cuda", [0, 1], ["", "b"]).input_on_card(True) is False


def test_a_first_card_on_another_host_gets_token_ids_not_embeddings(llama) -> None:
    b = Host("b", "me@b")
    on = _plan(llama, "rpc", ["b", "b"], on=None, host_list=(b,))
    off = _plan(llama, "rpc", ["b", "b"], on=False, host_list=(b,))
    (lon,), (loff,) = on.links, off.links
    act = llama.n_embd * 4
    # llama-server -> RPC0 (b) -> llama-server -> RPC1 (b) -> logits back: the first crossing is the embeddings or ids
    assert loff.act_crossings == lon.act_crossings + 1 and lon.id_crossings == 1 and loff.id_crossings == 0
    assert loff.token_bytes - lon.token_bytes == act - TOKEN_ID_BYTES
    assert loff.ubatch_bytes - lon.ubatch_bytes == (act - TOKEN_ID_BYTES) * 256
    assert on.to_dict()["links"][0]["token"]["token_id_bytes"] == TOKEN_ID_BYTES
