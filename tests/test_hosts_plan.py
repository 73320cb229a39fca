"""Several hosts, the pure side (issue 15): layouts with [[hosts]], the route, the process specs and the ssh command
lines across hosts, the inventory check, the output layer and link costs in the plan, and `arcsplit plan --layout`
for a two-host rig. No process is started here; tests/test_multihost*.py run the real thing across namespaces."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.cli import main
from arcsplit.errors import BadInput
from arcsplit.hosts import LINK_CIPHERS, check_inventory, control_argv, forward_argv, node_argv, ssh_base
from arcsplit.llama.build import CONFIG_FILE, build_rpc_proto
from arcsplit.llama.mode import choose_mode
from arcsplit.llama.source import RPC_HEADER, rpc_proto
from arcsplit.model import load_profile
from arcsplit.planner import DEFAULT_LINK_GBIT, PlanOptions, make_plan, plan_for_split
from arcsplit.rig import Card, Host, Rig, dump_layout, load_layout
from arcsplit.route import Route
from arcsplit.decide.specs import ServeConfig, build_specs, card_of_buffer, n_links

MiB = 1024 * 1024
SECRET = "sk-not-for-other-hosts"
B = Host("b", "me@b", ssh_config="/home/me/.ssh/arcsplit_config")
C = Host("c", "me@c", link="direct", address="10.77.0.3")


def _card(i: int, host: str = "", backend: str = "sycl") -> Card:
    return Card(backend, i, f"card {host or 'here'}{i}", 8192 * MiB, 8192 * MiB, 0, host=host)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory):
    return load_profile(synth.write_llama(tmp_path_factory.mktemp("m") / "u.gguf", n_layer=8, n_embd=256,
                                          n_vocab=4096, header_only=True))


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory):
    return load_profile(synth.write_llama(tmp_path_factory.mktemp("m") / "t.gguf", n_layer=8, n_embd=256,
                                          n_vocab=4096, tied=True, header_only=True))


def _layout(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rig.toml"
    p.write_text(text, encoding="utf-8")
    return p


TWO_HOSTS = """
name = "two"
[[hosts]]
name = "b"
ssh = "me@b"
ssh_config = "ssh_config"
[[hosts]]
name = "c"
ssh = "me@c"
link = "direct"
address = "10.77.0.3"
forwards = "own"
[[cards]]
backend = "cpu"
host = "c"
memory_mib = 1024
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 1024
[[cards]]
backend = "cpu"
memory_mib = 1024
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 1024
"""


# -- layouts ---------------------------------------------------------------------------------------------------


def test_layout_keeps_each_hosts_cards_together_main_host_first_and_round_trips(tmp_path: Path) -> None:
    rig = load_layout(_layout(tmp_path, TWO_HOSTS))
    assert [(c.host, c.index) for c in rig.cards] == [("", 0), ("b", 0), ("b", 1), ("c", 0)]  # index: nth on its host
    assert rig.host("c").address == "10.77.0.3" and rig.host("b").link == "ssh"
    assert rig.host("b").forwards == "shared" and rig.host("c").forwards == "own"  # shared: the default
    assert rig.host("b").ssh_config == str(tmp_path / "ssh_config")  # relative to the layout file
    again = tmp_path / "again.toml"
    again.write_text(dump_layout(rig), encoding="utf-8")
    back = load_layout(again)
    assert back.hosts == rig.hosts and back.cards == rig.cards


BAD_LAYOUTS = [
    ('[[cards]]\nbackend = "cpu"\nhost = "x"\nmemory_mib = 1024\n', "names host 'x', which is not in [[hosts]]"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\n[[hosts]]\nname = "b"\nssh = "me@b2"\n', "host 'b' is named twice"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "direct"\n', 'link = "direct" needs an address'),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "direct"\naddress = "0.0.0.0"\n', "on every interface"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "direct"\naddress = "::"\n', "on every interface"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "direct"\naddress = "127.0.0.1"\n', "loopback"),
    # issue 43: the IPv4-mapped wildcard is the wildcard; an ssh:// port out of range; a host no card uses
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "direct"\naddress = "::ffff:0.0.0.0"\n', "on every interface"),
    ('[[hosts]]\nname = "b"\nssh = "ssh://root@b:70000"\n[[cards]]\nbackend = "cpu"\nhost = "b"\nmemory_mib = 1\n',
     "has no valid port"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\n', "host 'b' in [[hosts]] has no card"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\naddress = "10.0.0.2"\n', 'only used with link = "direct"'),
    ('[[hosts]]\nname = "b"\nssh = "-oProxyCommand=touch /tmp/x"\n', "is not an ssh destination"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nadress = "10.0.0.2"\n', "unknown key 'adress'"),
    ('[[hosts]]\nname = "local"\nssh = "me@b"\n', "host name 'local' is not usable"),
    ('[[hosts]]\nname = "b"\n', "hosts[0] has no ssh"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nlink = "udp"\n', "link = 'udp' is unknown"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nforwards = "mux"\n', "forwards = 'mux' is unknown"),
    ('[[hosts]]\nname = "b"\nssh = "me@b"\nbandwidth_gbit = 0\n', "bandwidth_gbit = 0 must be a positive number"),
]


@pytest.mark.parametrize("text,needle", BAD_LAYOUTS, ids=[n for _, n in BAD_LAYOUTS])
def test_bad_host_layouts_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                              needle: str) -> None:
    if "[[cards]]" not in text:
        text += '[[cards]]\nbackend = "cpu"\nmemory_mib = 1024\n'
    path = _layout(tmp_path, text)
    rc = main(["plan", str(tmp_path / "no-model-needed.gguf"), "--layout", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert needle in err and str(path) in err, err


# -- route ------------------------------------------------------------------------------------------------------


def test_route_across_hosts_gives_every_remote_card_its_own_rpc_server() -> None:
    route = Route.build("multi", "sycl", [0, 1, 0, 1], ["", "", "b", "b"])  # the same index on two hosts is fine
    assert route.devices == ["SYCL0", "SYCL1", "RPC0", "RPC1"]
    assert [(p.name, p.host, p.cards) for p in route.processes] == [
        ("rpc0", "b", (2,)), ("rpc1", "b", (3,)), ("server", "", (0, 1))]
    assert dict(route.rpc[1].env)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:1"  # confined to its card there
    d = route.to_dict()
    assert [c["host"] for c in d["cards"]] == ["", "", "b", "b"] and d["processes"][0]["host"] == "b"
    hybrid = Route.build("hybrid", "sycl", [0, 1, 0], ["", "", "b"])
    assert [(p.name, p.host) for p in hybrid.rpc] == [("rpc0", ""), ("rpc1", "b")]  # this machine's first
    assert [p.host for p in Route.build("rpc", "cpu", [0, 0], ["b", "c"]).rpc] == ["b", "c"]
    one_host = Route.build("hybrid", "sycl", [0, 1])
    assert all(p.host == "" for p in one_host.processes) and one_host.to_dict()["cards"][0]["host"] == ""


@pytest.mark.parametrize("mode,indices,hosts,needle", [
    ("single", [0, 0], ["", "b"], "mode single"),
    ("hybrid", [0, 1], ["b", "b"], "needs a card on this machine"),
    ("rpc", [0, 0, 1], ["", "b", ""], "not next to each other"),
    ("rpc", [0, 0], ["b", ""], "not next to each other"),
    ("rpc", [0, 0], ["b", "b"], "names a card twice"),
])
def test_route_refuses_what_cannot_run_across_hosts(mode: str, indices: list[int], hosts: list[str],
                                                     needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        Route.build(mode, "sycl", indices, hosts)


def test_auto_mode_with_cards_on_other_hosts() -> None:
    assert choose_mode("sycl", 3, n_remote=3).mode == "rpc"
    assert choose_mode("sycl", 3, n_remote=2).mode == "hybrid"  # one card here: llama-server holds it
    assert choose_mode("cuda", 4, n_remote=2).mode == "multi"  # the mode's rule on this machine's two
    assert choose_mode("cpu", 2, n_remote=1).mode == "rpc"
    with pytest.raises(BadInput, match="--mode single"):
        choose_mode("sycl", 2, forced="single", n_remote=1)
    with pytest.raises(BadInput, match="every card is on another host"):
        choose_mode("sycl", 2, forced="hybrid", n_remote=2)


# -- the plan: output layer and links -----------------------------------------------------------------------------


def _plan(profile, hosts_of_cards: list[str], mode: str = "hybrid", hosts: tuple[Host, ...] = (B, C),
          output: str = "auto"):
    rig = Rig(tuple(_card(i, h) for i, h in enumerate(hosts_of_cards)), hosts=hosts)
    route = Route.build(mode, "sycl", [c.index for c in rig.cards], [c.host for c in rig.cards])
    options = PlanOptions(n_ctx=2048, n_ubatch=256, output_on_first=route.output_local(output))
    return rig, make_plan(profile, rig, options, devices=route.devices)


def test_auto_output_layer_comes_home_when_the_last_card_is_remote(untied) -> None:
    _, plan = _plan(untied, ["", "", "b", "b"])
    assert plan.cards[0].has_output and not plan.cards[-1].has_output
    args = plan.llama_server_args(devices=["SYCL0", "RPC0", "RPC1", "RPC2"])
    assert args[args.index("-ot") + 1] == "^output=SYCL0"
    (link,) = plan.links
    # llama-server -> SYCL0 -> RPC0 (here) -> RPC1 (b) -> RPC2 (b) -> back to SYCL0 for the output layer: every
    # token's activations go to b and from RPC1 through llama-server to RPC2 (3 crossings, 1 blocking get); the
    # last layer keeps the output rows only, which come back (1 crossing, 1 get; none in mid-prompt ubatches).
    act = untied.n_embd * 4
    assert (link.host, link.act_crossings, link.out_crossings, link.logits_bytes) == ("b", 3, 1, 0)
    assert (link.gets, link.out_gets, link.round_trips) == (1, 1, 2)
    # both cards on b hold attention layers: each gets the f16 mask (flash attention) of every ubatch, n_kv wide
    assert link.masks == (2, 0) and link.mask_bytes == 2 * 2 * 2048 and link.mask_at(256) == 2 * 2 * 256
    assert link.token_bytes == 4 * act + link.mask_bytes and link.rpc_servers == 2
    assert link.ubatch_bytes == (3 * act + link.mask_bytes) * 256
    assert link.gbit == DEFAULT_LINK_GBIT and not link.gbit_given
    one_host = make_plan(untied, Rig((_card(0), _card(1))), PlanOptions(n_ctx=2048))
    assert one_host.cards[-1].has_output and not one_host.links  # one machine: unchanged, no link


def test_tied_output_stays_last_with_a_warning_and_its_logits_are_counted(tied) -> None:
    _, plan = _plan(tied, ["", "b"])
    assert plan.cards[-1].has_output and not plan.options.output_on_first
    assert any("the output layer stays on host b" in w and "ties it" in w for w in plan.warnings)
    (link,) = plan.links
    assert link.logits_bytes == tied.n_vocab * 4
    assert link.token_bytes == tied.n_embd * 4 + 2 * 2048 + tied.n_vocab * 4
    assert link.round_trips == 1  # the logits read; the activations going there are queued


def test_a_card_with_only_the_output_layer_gets_output_rows_only(tied) -> None:
    rig = Rig((_card(0), _card(0, "b")), hosts=(B,))
    plan = plan_for_split(tied, rig, PlanOptions(n_ctx=2048, n_ubatch=256), [tied.n_layer, 1],
                          devices=["SYCL0", "RPC0"])
    (link,) = plan.links
    # the last layer (here) keeps the output rows: in mid-prompt ubatches nothing goes to b at all
    assert (link.act_crossings, link.out_crossings, link.gets, link.out_gets) == (0, 1, 0, 1)
    assert link.masks == (0, 0) and link.ubatch_bytes == 0 and link.prefill_tps_full is None
    assert link.token_bytes == tied.n_embd * 4 + tied.n_vocab * 4


def test_explicit_last_keeps_the_output_remote_and_says_so(untied) -> None:
    _, plan = _plan(untied, ["", "b"], output="last")
    assert plan.cards[-1].has_output
    assert any("stays on host b (--output-layer last)" in w for w in plan.warnings)


def test_prefill_warning_follows_the_links_bandwidth(untied) -> None:
    slow = Host("b", "me@b", bandwidth_gbit=0.01)
    _, plan = _plan(untied, ["", "b"], hosts=(slow,))
    (link,) = plan.links
    assert link.gbit == 0.01 and link.gbit_given
    full, start = link.prefill_tps_full, link.prefill_tps_start
    assert full is not None and start is not None and full < start < 1000  # the masks grow with the context
    assert full == pytest.approx(0.01e9 / 8 / (link.act_bytes * link.act_crossings + (2 * 256 + 2 * 2048) / 2))
    assert any("prefill over the ssh link to b would dominate" in w and "0.01 Gbit/s (given)" in w
               for w in plan.warnings)
    _, fast = _plan(untied, ["", "b"])
    assert not any("would dominate" in w for w in fast.warnings)
    d = plan.to_dict()
    assert d["links"][0]["host"] == "b" and d["links"][0]["token"]["bytes"] == link.token_bytes
    assert [c["host"] for c in d["cards"]] == ["", "b"]


# -- process specs -----------------------------------------------------------------------------------------------


def _config(untied) -> ServeConfig:
    rig, plan = _plan(untied, ["", "", "b", "c"], mode="hybrid")
    return ServeConfig(plan=plan, mode="hybrid", backend="sycl", server_bin="/opt/here/llama-server",
                       rpc_bin="/opt/here/ggml-rpc-server", extra_args=("--api-key", SECRET), hosts=rig.hosts,
                       node_bins=(("b", "/opt/b/ggml-rpc-server"),), rpc_cache_dir="/home/me/.cache/arcsplit/rpc")


def test_specs_for_two_hosts_ssh_and_direct(untied) -> None:
    config = _config(untied)
    assert n_links(config) == 1
    specs = build_specs(config, [50052, 50053, 50054], [41000])
    assert [(s.name, s.role, s.node) for s in specs] == [
        ("rpc0", "rpc", ""), ("rpc1", "rpc", "b"), ("rpc2", "rpc", "c"), ("rpc1-link", "link", "b"),
        ("server", "server", "")]
    rpc0, rpc1, rpc2, link, server = specs
    assert rpc0.argv[:5] == ("/opt/here/ggml-rpc-server", "-H", "127.0.0.1", "-p", "50052")
    assert rpc0.env_dict["LLAMA_CACHE"] == "/home/me/.cache/arcsplit/rpc"  # this machine's cache, here only
    # over ssh: loopback there, the binary the node reported, the weight cache on, no path of this machine
    assert rpc1.argv[:5] == ("/opt/b/ggml-rpc-server", "-H", "127.0.0.1", "-p", "50053") and "-c" in rpc1.argv
    assert "LLAMA_CACHE" not in rpc1.env_dict and rpc1.connect == "127.0.0.1:41000"
    assert dict(rpc1.env)["ONEAPI_DEVICE_SELECTOR"] == "level_zero:2"
    # direct: the named address there, dialled as is; a host without a reported binary: the bare name
    assert rpc2.argv[:5] == ("ggml-rpc-server", "-H", "10.77.0.3", "-p", "50054") and rpc2.dial == "10.77.0.3:50054"
    assert link.host == "127.0.0.1" and link.port == 41000 and link.cards == ()
    assert link.argv[-3:] == ("-L", "127.0.0.1:41000:127.0.0.1:50053", "me@b")
    assert "ExitOnForwardFailure=yes" in link.argv and "-N" in link.argv
    rpc = server.argv[server.argv.index("--rpc") + 1]
    assert rpc == "127.0.0.1:50052,127.0.0.1:41000,10.77.0.3:50054"
    card = card_of_buffer(specs, None)
    assert [card("RPC0[127.0.0.1:50052]"), card("RPC0[127.0.0.1:41000]"), card("RPC0[10.77.0.3:50054]")] == [1, 2, 3]


def test_mode_rpc_brings_the_output_layer_home_to_the_first_rpc_servers_buffer(untied) -> None:
    """All cards rpc-servers, the last one on b: the output layer goes to the first (here), and -ot names that
    rpc-server's buffer type as llama.cpp does, RPC0[endpoint]: the device name RPC0 is "unknown buffer type"."""
    rig, plan = _plan(untied, ["", "b"], mode="rpc")
    assert plan.cards[0].has_output
    config = ServeConfig(plan=plan, mode="rpc", backend="sycl", server_bin="llama-server", rpc_bin="ggml-rpc-server",
                         hosts=rig.hosts)
    server = build_specs(config, [50052, 50053], [41000])[-1]
    assert server.argv[server.argv.index("-ot") + 1] == "^output=RPC0[127.0.0.1:50052]"


def test_secrets_stay_on_this_machine_and_nothing_binds_every_interface(untied) -> None:
    specs = build_specs(_config(untied), [50052, 50053, 50054], [41000])
    server = specs[-1]
    assert server.env_dict["LLAMA_API_KEY"] == SECRET and SECRET not in server.argv
    for s in specs[:-1]:
        assert SECRET not in " ".join(s.argv) and SECRET not in json.dumps(s.env), s.name
        if s.role == "rpc":
            assert s.argv[s.argv.index("-H") + 1] not in ("0.0.0.0", "::", "")


def test_specs_need_one_link_port_per_ssh_link(untied) -> None:
    with pytest.raises(BadInput, match="1 ssh links"):
        build_specs(_config(untied), [50052, 50053, 50054])


# -- ssh command lines and the inventory -------------------------------------------------------------------------


def test_ssh_never_prompts_never_trusts_an_unknown_key_and_notices_a_dead_peer() -> None:
    base = ssh_base(B)
    assert base[:3] == ["ssh", "-F", "/home/me/.ssh/arcsplit_config"]
    opts = {base[i + 1] for i, a in enumerate(base) if a == "-o"}
    assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "ServerAliveInterval=2", "ServerAliveCountMax=3",
            "ForwardAgent=no"} <= opts
    assert "-F" not in ssh_base(Host("x", "me@x"))


def test_node_command_is_quoted_for_the_remote_shell() -> None:
    odd = Host("b", "me@b", arcsplit="/opt/my tools/arcsplit")
    argv = node_argv(odd)
    assert argv[:len(ssh_base(odd))] == ssh_base(odd) and argv[-2] == "me@b"
    assert shlex.split(argv[-1]) == ["/opt/my tools/arcsplit", "node", "--stdio"]
    assert shlex.split(node_argv(C)[-1])[-2:] == ["--allow-bind", "10.77.0.3"]  # direct: that one address


def test_forward_argv() -> None:
    argv = forward_argv(B, 41000, 50053)
    assert argv[-8:] == ["-N", "-o", "ExitOnForwardFailure=yes", "-o",
                         "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com",
                         "-L", "127.0.0.1:41000:127.0.0.1:50053", "me@b"]
    assert forward_argv(B, 41000, 50053, "fd00::2")[-2] == "127.0.0.1:41000:[fd00::2]:50053"


def _opts(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]


def test_links_ride_the_agents_ssh_as_its_own_control_master() -> None:
    """forwards = "shared": the agent's ssh is the ControlMaster of arcsplit's own socket (never a master of the
    user's: every other ssh keeps ControlPath=none), it lives exactly as long as that session, and carries the
    links' tensors, hence their ciphers; a link is an `ssh -O forward` on that socket that never logs in itself."""
    master = node_argv(B, "/run/user/1000/arcsplit/ssh-0a1b2c3d")
    opts = _opts(master)
    assert {"ControlPath=/run/user/1000/arcsplit/ssh-0a1b2c3d", "ControlMaster=yes", "ControlPersist=no",
            LINK_CIPHERS, "BatchMode=yes", "StrictHostKeyChecking=yes"} <= set(opts)
    assert "ControlPath=none" not in opts and master[-2:] == node_argv(B)[-2:]
    assert "ControlPath=none" in _opts(node_argv(B)) and "ControlMaster=yes" not in _opts(node_argv(B))
    assert "ControlPath=/tmp/a%%b" in _opts(node_argv(B, "/tmp/a%b"))  # ssh expands % tokens in a ControlPath
    link = forward_argv(B, 41000, 50053)
    add = control_argv(B, "/run/user/1000/arcsplit/ssh-0a1b2c3d", "forward", link)
    assert add[-7:] == ["-o", "ControlMaster=no", "-O", "forward", "-L", "127.0.0.1:41000:127.0.0.1:50053", "me@b"]
    assert "ControlPath=/run/user/1000/arcsplit/ssh-0a1b2c3d" in _opts(add) and "-N" not in add
    assert control_argv(B, "/s", "cancel", link)[-4:] == ["cancel", "-L", "127.0.0.1:41000:127.0.0.1:50053", "me@b"]


def test_inventory_mismatch_names_both_sides() -> None:
    here = {"commit": "0c1e57098", "rpc_proto": "7.0.0"}
    with pytest.raises(BadInput) as exc:
        check_inventory(here, {"commit": "abc1234", "rpc_proto": "6.1.0"}, B)
    msg = str(exc.value)
    assert "\n" not in msg and "host b" in msg
    assert "abc1234 on b (me@b), 0c1e57098 here" in msg and "RPC protocol 6.1.0 on b (me@b), 7.0.0 here" in msg
    check_inventory(here, dict(here), B)
    check_inventory(here, {"commit": "0c1e57098", "rpc_proto": None}, B)  # unknown there: the commit decides


def test_rpc_proto_is_read_from_the_tree_or_the_builds_record(tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    header = tree / RPC_HEADER
    header.parent.mkdir(parents=True)
    header.write_text("#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION    1\n"
                      "#define RPC_PROTO_PATCH_VERSION    2\n", encoding="utf-8")
    assert rpc_proto(tree) == "7.1.2" and rpc_proto(tmp_path) is None
    bin_dir = tree / "build" / "bin"  # a user's own cmake build inside a checkout
    bin_dir.mkdir(parents=True)
    assert build_rpc_proto(bin_dir) == "7.1.2"
    (bin_dir / CONFIG_FILE).write_text(json.dumps({"backend": "cpu", "rpc_proto": "8.0.0"}), encoding="utf-8")
    assert build_rpc_proto(bin_dir) == "8.0.0"  # the managed build's record wins


# -- arcsplit plan --layout with two hosts -------------------------------------------------------------------------


def test_plan_cli_groups_processes_by_host_with_links_and_costs(tmp_path: Path, demo_model: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    layout = _layout(tmp_path, TWO_HOSTS)
    base = ["plan", str(demo_model), "--layout", str(layout), "--ctx", "2048", "--rpc-ports", "50052,50053,50054,50055"]
    assert main([*base, "--json", "--", "--api-key", SECRET]) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert SECRET not in out
    assert d["mode"] == "rpc" and [c["host"] for c in d["cards"]] == ["", "b", "b", "c"]
    procs = {p["name"]: p for p in d["processes"]}
    assert [procs[n]["node"] for n in ("rpc0", "rpc1", "rpc2", "rpc3")] == ["", "b", "b", "c"]
    assert procs["rpc1-link"]["role"] == "link" and procs["rpc2-link"]["node"] == "b" and "rpc3-link" not in procs
    assert procs["rpc3"]["argv"][1:3] == ["-H", "10.77.0.3"] and procs["rpc3"]["connect"] == "10.77.0.3:50055"
    assert [h["name"] for h in d["hosts"]] == ["b", "c"]
    assert d["hosts"][0]["node_argv"][-1] == "arcsplit node --stdio"
    # b's forwards ride its node's ssh (forwards = "shared"): the plan shows that master and the -O forward
    assert "ControlMaster=yes" in d["hosts"][0]["node_argv"] and "ControlMaster=yes" not in d["hosts"][1]["node_argv"]
    assert procs["rpc1-link"]["argv"][-5:-3] == ["-O", "forward"]
    assert [lc["host"] for lc in d["links"]] == ["b", "c"]
    assert d["links"][1]["token"]["logits_bytes"] == 262144 * 4  # Gemma 3 ties its output: it stays on c's card

    assert main(base) == 0
    text = capsys.readouterr().out
    assert "this machine:" in text and "host b (ssh me@b, link ssh):" in text
    assert "host c (ssh me@c, link direct to 10.77.0.3):" in text
    b_part = text.split("host b (")[1].split("host c (")[0]
    assert "node: ssh" in b_part and "rpc1-link: ssh" in b_part and "(started there by the node)" in b_part
    assert "(a forward added to the node's ssh here)" in b_part
    assert "links, at a full context of 2,048 tokens" in text and "  b (ssh, 1 Gbit/s assumed, 2 rpc-server(s)):" in text


def test_plan_save_keeps_the_hosts(tmp_path: Path, demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "saved.toml"
    assert main(["plan", str(demo_model), "--layout", str(_layout(tmp_path, TWO_HOSTS)), "--ctx", "2048",
                 "--save", str(saved), "--json"]) == 0
    capsys.readouterr()
    rig = load_layout(saved)
    assert [h.name for h in rig.hosts] == ["b", "c"] and [c.host for c in rig.cards] == ["", "b", "b", "c"]


@pytest.mark.slow
def test_link_model_against_real_rpc_traffic(llama_bins, tmp_path: Path) -> None:
    """bench/link_bytes.py on the real CPU build: the blocking exchanges through each rpc-server's socket are the
    plan's round trips, and the model's bytes are a lower bound of what crosses (headers and graphs on top)."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "link_bytes.md"
    env = {**os.environ, "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    proc = subprocess.run([sys.executable, str(root / "bench" / "link_bytes.py"), "--prompts", "40,300", "--tokens",
                           "4", "--reps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = re.findall(r"^\| (rpc\d) \| (\d+) \| \d+ \| ([\d,]+) / .*? \| ([\d,]+) \| .*? \| (\d+) \| (\d+) \|$",
                      out.read_text(), re.MULTILINE)
    assert len(rows) == 4, out.read_text()
    for name, _prompt, measured, predicted, replies, trips in rows:
        assert replies == trips, (name, replies, trips)
        m, p = int(measured.replace(",", "")), int(predicted.replace(",", ""))
        assert p <= m < 4 * p, (name, m, p)
