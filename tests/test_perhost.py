"""One rpc-server per host (issue 15), the pure side: the layout key, the route (one process holds all of a host's
cards, confined to them, -d naming each in layer order), the specs (one port, one link, the buffer types llama-server
gives each card), the link costs and `arcsplit plan --layout`. tests/test_multihost.py runs it for real on host b."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.cli import main
from arcsplit.errors import BadInput
from arcsplit.llama.features import parse_help
from arcsplit.llama.logs import parse_buffer_line, sum_buffers
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, make_plan
from arcsplit.rig import Card, Host, Rig, dump_layout, load_layout, per_host
from arcsplit.route import Route
from arcsplit.decide.specs import ServeConfig, build_specs, card_of_buffer, n_links, n_rpc_servers, rpc_buffer_types

MiB = 1024 * 1024
B = Host("b", "me@b", rpc_servers="per-host")
C = Host("c", "me@c")


def _layout(tmp_path: Path, backend: str = "cuda", extra: str = 'rpc_servers = "per-host"\n') -> Path:
    p = tmp_path / "rig.toml"
    cards = "".join(f'[[cards]]\nbackend = "{backend}"\nmemory_mib = 1024\n{host}'
                    for host in ("", 'host = "b"\n', 'host = "b"\n'))
    p.write_text(f'name = "ph"\n[[hosts]]\nname = "b"\nssh = "me@b"\n{extra}{cards}', encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory):
    return load_profile(synth.write_llama(tmp_path_factory.mktemp("m") / "u.gguf", n_layer=8, n_embd=256,
                                          n_vocab=4096, header_only=True))


# -- the layout key -------------------------------------------------------------------------------------------------


def test_layout_key_reads_writes_back_and_defaults_to_per_card(tmp_path: Path) -> None:
    rig = load_layout(_layout(tmp_path))
    assert rig.host("b").rpc_servers == "per-host" and rig.host("b").per_host and per_host(rig.hosts) == ("b",)
    again = tmp_path / "again.toml"
    again.write_text(dump_layout(rig), encoding="utf-8")
    assert load_layout(again).hosts == rig.hosts
    plain = load_layout(_layout(tmp_path, extra=""))
    assert plain.host("b").rpc_servers == "per-card" and per_host(plain.hosts) == ()
    assert "rpc_servers" not in dump_layout(plain)  # the default is not written


@pytest.mark.parametrize("backend,extra,needle", [
    ("cuda", 'rpc_servers = "one"\n', "rpc_servers = 'one' is unknown"),
    ("cuda", "rpc_servers = 2\n", "hosts[0].rpc_servers has the wrong type"),
    ("sycl", 'rpc_servers = "per-host"\n', 'rpc_servers = "per-host" is refused on sycl'),
])
def test_bad_rpc_servers_is_one_line_naming_the_layout_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   backend: str, extra: str, needle: str) -> None:
    path = _layout(tmp_path, backend, extra)
    rc = main(["plan", str(tmp_path / "no-model-needed.gguf"), "--layout", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert needle in err and str(path) in err, err
    if backend == "sycl":  # why, and what to do
        assert "Level Zero context spans two GPUs" in err and "per-card is the default" in err


@pytest.mark.parametrize("backend", ["cpu", "cuda", "vulkan"])
def test_per_host_is_allowed_where_one_process_holds_several_cards(tmp_path: Path, backend: str) -> None:
    assert load_layout(_layout(tmp_path, backend)).host("b").per_host


# -- the route ------------------------------------------------------------------------------------------------------


def test_route_one_rpc_server_holds_all_of_a_per_host_hosts_cards() -> None:
    # here: CUDA0; b (per-host): its cards 3 and 1, in that layer order; c (per-card): two cards
    route = Route.build("hybrid", "cuda", [0, 3, 1, 0, 1], ["", "b", "b", "c", "c"], per_host=("b",))
    assert route.devices == ["CUDA0", "RPC0", "RPC1", "RPC2", "RPC3"]  # RPCk: the k-th card rpc-servers hold
    assert [(p.name, p.host, p.cards, p.devices) for p in route.processes] == [
        ("rpc0", "b", (1, 2), ("RPC0", "RPC1")), ("rpc1", "c", (3,), ("RPC2",)), ("rpc2", "c", (4,), ("RPC3",)),
        ("server", "", (0,), ("CUDA0",))]
    b = route.rpc[0]
    assert dict(b.env)["CUDA_VISIBLE_DEVICES"] == "1,3"  # confined to b's cards, which it numbers ascending
    assert b.select == ("CUDA1", "CUDA0")  # so card 3 is CUDA1 there, and -d keeps the layer order
    assert route.rpc[1].select == () and dict(route.rpc[1].env)["CUDA_VISIBLE_DEVICES"] == "0"  # per-card: as before
    assert [route.holder(p) for p in range(5)] == ["server", "rpc0", "rpc0", "rpc1", "rpc2"]
    assert route.to_dict()["processes"][0]["select"] == ["CUDA1", "CUDA0"]


def test_route_per_host_on_vulkan_and_cpu() -> None:
    vk = Route.build("rpc", "vulkan", [0, 1], ["b", "b"], per_host=("b",))
    (rpc,) = vk.rpc
    assert dict(rpc.env)["GGML_VK_VISIBLE_DEVICES"] == "0,1" and rpc.select == ("Vulkan0", "Vulkan1")
    cpu = Route.build("rpc", "cpu", [0, 0, 1], ["", "b", "b"], per_host=("b",))
    assert [(p.name, p.host, p.cards, p.select, p.env) for p in cpu.rpc] == [
        ("rpc0", "", (0,), (), ()), ("rpc1", "b", (1, 2), ("CPU", "CPU"), ())]
    assert cpu.devices == ["RPC0", "RPC1", "RPC2"]
    # this machine's cards are never grouped: the mode decides those
    assert len(Route.build("rpc", "cpu", [0, 1], ["", ""], per_host=("b",)).rpc) == 2


def test_route_refuses_per_host_on_sycl() -> None:
    with pytest.raises(BadInput, match="refused on sycl"):
        Route.build("rpc", "sycl", [0, 1], ["b", "b"], per_host=("b",))
    assert len(Route.build("rpc", "sycl", [0, 1], ["b", "b"]).rpc) == 2


# -- specs ----------------------------------------------------------------------------------------------------------


def _config(untied, backend: str = "cuda", hosts: tuple[Host, ...] = (B, C)) -> ServeConfig:
    rig = Rig((Card(backend, 0, "here", 8192 * MiB, 8192 * MiB, 0),
               Card(backend, 3, "b3", 8192 * MiB, 8192 * MiB, 0, host="b"),
               Card(backend, 1, "b1", 8192 * MiB, 8192 * MiB, 0, host="b"),
               Card(backend, 0, "c0", 8192 * MiB, 8192 * MiB, 0, host="c")), hosts=hosts)
    route = Route.build("hybrid", backend, [c.index for c in rig.cards], [c.host for c in rig.cards],
                        per_host(rig.hosts))
    plan = make_plan(untied, rig, PlanOptions(n_ctx=2048, n_ubatch=256, output_on_first=True), devices=route.devices)
    return ServeConfig(plan=plan, mode="hybrid", backend=backend, server_bin="llama-server",
                       rpc_bin="ggml-rpc-server", hosts=rig.hosts, node_bins=(("b", "/opt/b/ggml-rpc-server"),))


def test_specs_one_rpc_server_one_port_one_link_for_bs_cards(untied) -> None:
    config = _config(untied)
    assert n_rpc_servers(config) == 2 and n_links(config) == 2
    specs = build_specs(config, [50052, 50053], [41000, 41001])
    rpc_b, rpc_c, link_b, link_c, server = specs
    assert rpc_b.argv[:9] == ("/opt/b/ggml-rpc-server", "-H", "127.0.0.1", "-p", "50052", "-t", "1", "-d",
                              "CUDA1,CUDA0")
    assert rpc_b.cards == (1, 2) and rpc_b.devices == ("RPC0", "RPC1") and rpc_b.node == "b"
    assert rpc_b.env_dict["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "-d" not in rpc_c.argv and rpc_c.env_dict["CUDA_VISIBLE_DEVICES"] == "0"
    assert link_b.argv[-3:] == ("-L", "127.0.0.1:41000:127.0.0.1:50052", "me@b") and link_c.node == "c"
    argv = server.argv
    assert argv[argv.index("--rpc") + 1] == "127.0.0.1:41000,127.0.0.1:41001"
    assert argv[argv.index("--device") + 1] == "CUDA0,RPC0,RPC1,RPC2"
    # llama-server names a buffer type by the card's index on its rpc-server and the endpoint (ggml-rpc.cpp)
    assert rpc_buffer_types(specs) == {"RPC0": "RPC0[127.0.0.1:41000]", "RPC1": "RPC1[127.0.0.1:41000]",
                                       "RPC2": "RPC0[127.0.0.1:41001]"}
    card = card_of_buffer(specs, None)
    assert [card("RPC0[127.0.0.1:41000]"), card("RPC1[127.0.0.1:41000]"), card("RPC0[127.0.0.1:41001]"),
            card("CUDA0")] == [1, 2, 3, 0]
    with pytest.raises(BadInput, match="3 rpc ports given for 2 rpc-servers"):
        ServeConfig(plan=config.plan, mode="hybrid", backend="cuda", server_bin="s", rpc_bin="r", hosts=config.hosts,
                    rpc_ports=(1, 2, 3))


def test_an_rpc_server_on_another_host_never_shares_memory_with_llama_server(untied) -> None:
    """Patch 0008's rings live in this machine's /dev/shm: llama-server offers them to every rpc-server, and one on
    another host declines (ARCSPLIT_RPC_SHM=0 there), even where that "host" shares this machine's memory (a test's
    network namespace)."""
    from dataclasses import replace

    specs = build_specs(replace(_config(untied), rpc_shm=True), [50052, 50053], [41000, 41001])
    rpc_b, rpc_c, _, _, server = specs
    assert rpc_b.env_dict["ARCSPLIT_RPC_SHM"] == rpc_c.env_dict["ARCSPLIT_RPC_SHM"] == "0"
    assert server.env_dict["ARCSPLIT_RPC_SHM"] == "1"


def test_an_rpc_server_build_without_d_cannot_hold_several_cards(untied) -> None:
    from dataclasses import replace

    old = parse_help("  -H HOST   host to bind to\n  -p PORT   port to bind to\n  -t N   threads\n")
    config = replace(_config(untied), rpc_features=old)
    with pytest.raises(BadInput, match="does not accept -d"):
        build_specs(config, [50052, 50053], [41000, 41001])
    per_card = replace(_config(untied, hosts=(Host("b", "me@b"), C)), rpc_features=old)
    assert len(build_specs(per_card, [50052, 50053, 50054], [41000, 41001, 41002])) == 7  # no -d: as before


def test_buffer_lines_of_one_rpc_server_are_told_apart_by_the_cards_index_on_it() -> None:
    lines = ["load_tensors: RPC0[127.0.0.1:41000] model buffer size =    35.82 MiB",
             "load_tensors: RPC1[127.0.0.1:41000] model buffer size =   199.34 MiB"]
    totals = sum_buffers(b for b in map(parse_buffer_line, lines) if b)
    assert totals == {"RPC0[127.0.0.1:41000]": {"model": int(35.82 * MiB)},
                      "RPC1[127.0.0.1:41000]": {"model": int(199.34 * MiB)}}


# -- link costs and the plan ----------------------------------------------------------------------------------------


def test_link_costs_a_hop_between_one_servers_cards_stays_on_that_host(untied) -> None:
    shared = _config(untied).plan.links[0]
    apart = _config(untied, hosts=(Host("b", "me@b"), C)).plan.links[0]
    assert (shared.host, shared.rpc_servers, shared.graph_computes) == ("b", 1, 2)
    assert (apart.rpc_servers, apart.graph_computes) == (2, 2)
    # here -> b's first card, (b's first -> b's second: a copy on b, not through llama-server), -> c
    assert apart.act_crossings - shared.act_crossings == 2 and shared.gets == apart.gets  # the copy's reply
    assert shared.token_bytes == apart.token_bytes - 2 * untied.n_embd * 4


def test_plan_cli_shows_one_rpc_server_for_bs_cards(tmp_path: Path, demo_model: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    layout = _layout(tmp_path, "cpu")
    base = ["plan", str(demo_model), "--layout", str(layout), "--ctx", "2048", "--mode", "rpc"]
    assert main([*base, "--rpc-ports", "50052,50053", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    procs = {p["name"]: p for p in d["processes"]}
    assert sorted(procs) == ["rpc0", "rpc1", "rpc1-link", "server"]
    assert procs["rpc1"]["node"] == "b" and procs["rpc1"]["cards"] == [1, 2]
    assert procs["rpc1"]["argv"][procs["rpc1"]["argv"].index("-d") + 1] == "CPU,CPU"
    assert d["links"][0]["rpc_servers"] == 1 and d["links"][0]["ubatch"]["graph_computes"] == 2
    assert main([*base, "--rpc-ports", "50052,50053"]) == 0
    text = capsys.readouterr().out
    b_part = text.split("\nhost b (ssh")[1]
    rpc_lines = [line for line in b_part.splitlines() if "ggml-rpc-server" in line]
    assert len(rpc_lines) == 1 and "-p 50053" in rpc_lines[0] and "-d CPU,CPU" in rpc_lines[0], b_part
    assert "1 rpc-server(s) for 2 cards" in text


def test_the_dashboard_shows_every_card_of_a_per_host_rpc_server() -> None:
    from arcsplit.tui.state import DashState
    from arcsplit.tui.widgets import process_rows

    status = {"state": "ready", "route": Route.build("rpc", "cpu", [0, 0, 1], ["", "b", "b"], ("b",)).to_dict(),
              "processes": {"rpc0": {"pid": 1, "state": "ready", "role": "rpc", "host": ""},
                            "rpc1": {"pid": 2, "state": "ready", "role": "rpc", "host": "b"},
                            "rpc1-link": {"pid": None, "state": "ready", "role": "link", "host": "b"},
                            "server": {"pid": 3, "state": "ready", "role": "server", "host": ""}}}
    state = DashState()
    state.status = status
    rows = {row[0]: (row[1], row[2]) for row in process_rows(state)}
    assert rows["rpc1"] == ("rpc@b", "1,2") and rows["rpc0"] == ("rpc", "0")
