"""Process specs: what each process may see and the flags it gets, per mode and backend. Pure, no processes."""

from __future__ import annotations

import pytest

from arcsplit.errors import BadInput
from arcsplit.planner import HOST_DEVICE, CardPlan, Plan, PlanOptions
from arcsplit.rig import Card
from arcsplit.route import Route
from arcsplit.decide.specs import SERVER_LOG_ARGS, ServeConfig, build_specs, n_rpc_servers, rpc_threads

G = 1 << 30


def make_plan(backend: str, indices: list[int], devices: list[str], n_layer: int = 18) -> Plan:
    """A hand-built plan (the planner's contract types) splitting n_layer+1 layers evenly."""
    n = len(indices)
    bounds = [round(k * (n_layer + 1) / n) for k in range(n + 1)]
    cards = tuple(
        CardPlan(Card(backend, idx, f"{backend} {idx}", 16 * G, 16 * G), dev, bounds[k], bounds[k + 1],
                 100, 10, 0, 5, has_output=k == n - 1)
        for k, (idx, dev) in enumerate(zip(indices, devices)))
    return Plan("/models/m.gguf", "llama", n_layer, 4096, PlanOptions(n_ctx=4096), cards)


def config(backend: str, mode: str, indices: list[int], **kw) -> ServeConfig:
    plan = make_plan(backend, indices, Route.build(mode, backend, indices).devices)
    return ServeConfig(plan=plan, mode=mode, backend=backend, server_bin="/b/llama-server",
                       rpc_bin="/b/ggml-rpc-server", port=8080, cores=8, **kw)


def specs_for(cfg: ServeConfig):
    ports = list(range(50100, 50100 + n_rpc_servers(cfg)))
    return build_specs(cfg, ports)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_sycl_rpc_one_selector_per_rpc_server_and_no_local_gpu_in_llama_server():
    specs = specs_for(config("sycl", "rpc", [0, 1]))
    rpc0, rpc1, server = specs
    assert rpc0.env_dict["ONEAPI_DEVICE_SELECTOR"] == "level_zero:0"
    assert rpc1.env_dict["ONEAPI_DEVICE_SELECTOR"] == "level_zero:1"
    assert server.env_dict["ONEAPI_DEVICE_SELECTOR"] == "level_zero:cpu"  # matches no GPU
    argv = list(server.argv)
    assert flag(argv, "--rpc") == "127.0.0.1:50100,127.0.0.1:50101"
    assert argv.index("--rpc") < argv.index("--device")  # llama.cpp needs --rpc first
    assert flag(argv, "--device") == "RPC0,RPC1"
    assert flag(argv, "-ts") == "10,9" and flag(argv, "--fit") == "off"
    assert flag(argv, "-c") == "4096" and flag(argv, "-np") == "1"
    assert "--metrics" in argv and flag(argv, "-m") == "/models/m.gguf"


def test_rpc_servers_bind_loopback_with_threads_and_sigpipe_ignored():
    specs = specs_for(config("cuda", "rpc", [2, 3]))
    for s in specs[:-1]:
        assert s.role == "rpc" and s.ignore_sigpipe
        assert flag(list(s.argv), "-H") == "127.0.0.1"
        assert flag(list(s.argv), "-t") == "4"  # 8 cores / 2 cards
    assert [s.env_dict["CUDA_VISIBLE_DEVICES"] for s in specs] == ["2", "3", ""]


def test_cuda_hybrid_keeps_first_card_local_and_first_in_device_order():
    rpc0, server = specs_for(config("cuda", "hybrid", [1, 0]))
    assert server.env_dict["CUDA_VISIBLE_DEVICES"] == "1"  # only its own card
    assert rpc0.env_dict["CUDA_VISIBLE_DEVICES"] == "0"
    assert flag(list(server.argv), "--device") == "CUDA0,RPC0"
    assert flag(list(server.argv), "--rpc") == "127.0.0.1:50100"


def test_vulkan_multi_is_one_process_seeing_all_cards():
    (server,) = specs_for(config("vulkan", "multi", [1, 0]))
    assert server.env_dict["GGML_VK_VISIBLE_DEVICES"] == "0,1"
    assert flag(list(server.argv), "--device") == "Vulkan1,Vulkan0"  # card order as --gpus gave it
    assert "--rpc" not in server.argv


def test_workaround_env_reaches_llama_server():
    cfg = config("sycl", "multi+workaround", [0, 1],
                 mode_env=(("NEOReadDebugKeys", "1"), ("ForceZeDeviceCanAccessPerReturnValue", "0")))
    (server,) = specs_for(cfg)
    assert server.env_dict["NEOReadDebugKeys"] == "1"
    assert server.env_dict["ONEAPI_DEVICE_SELECTOR"] == "level_zero:0,1"


def test_cpu_rpc_and_hybrid():
    specs = specs_for(config("cpu", "rpc", [0, 1], threads=1))
    assert [s.name for s in specs] == ["rpc0", "rpc1", "server"]
    assert flag(list(specs[0].argv), "-t") == "1"
    rpc0, server = specs_for(config("cpu", "hybrid", [0, 1]))
    argv = list(server.argv)
    assert flag(argv, "--device") == "RPC0"
    assert flag(argv, "-ngl") == "9"  # the first card's 10 layers stay on llama-server's CPU
    assert rpc0.cards == (1,) and server.cards == (0,)


def test_single_cpu_and_extra_args_last():
    (server,) = specs_for(config("cpu", "single", [0], extra_args=("--temp", "0")))
    argv = list(server.argv)
    assert flag(argv, "--device") == "none"
    assert argv[-2:] == ["--temp", "0"]


def test_threads_default_is_cores_per_card_at_least_one():
    assert rpc_threads(config("cpu", "rpc", [0, 1])) == 4
    assert rpc_threads(config("cpu", "rpc", [0, 1], threads=0)) == 1
    cfg = ServeConfig(plan=make_plan("cpu", [0, 1, 2], ["RPC0", "RPC1", "RPC2"]), mode="rpc", backend="cpu",
                      server_bin="s", rpc_bin="r", cores=2)
    assert rpc_threads(cfg) == 1


def test_rpc_host_other_than_loopback_only_when_asked():
    specs = specs_for(config("cpu", "rpc", [0, 1], rpc_host="10.0.0.5"))
    assert flag(list(specs[0].argv), "-H") == "10.0.0.5"
    assert flag(list(specs[-1].argv), "--rpc").startswith("10.0.0.5:")


@pytest.mark.parametrize("backend,mode,indices", [("cpu", "multi", [0, 1]), ("cuda", "single", [0, 1])])
def test_impossible_combinations_are_bad_input(backend, mode, indices):
    with pytest.raises(BadInput):
        specs_for(config(backend, mode, indices))


def test_unknown_mode_is_bad_input():
    with pytest.raises(BadInput):
        config("cuda", "warp", [0, 1])


def test_fixed_rpc_ports_must_match_the_number_of_rpc_servers():
    with pytest.raises(BadInput):
        config("cpu", "rpc", [0, 1], rpc_ports=(50000,))


def test_route_devices_per_mode():
    assert Route.build("rpc", "sycl", [0, 1]).devices == ["RPC0", "RPC1"]
    assert Route.build("hybrid", "cpu", [0, 1]).devices == [HOST_DEVICE, "RPC0"]
    assert Route.build("hybrid", "sycl", [1, 0]).devices == ["SYCL0", "RPC0"]
    assert Route.build("multi", "cuda", [2, 0]).devices == ["CUDA1", "CUDA0"]


def test_route_names_each_cards_holder_and_what_it_sees():
    """One answer to "who holds card i": rpc-servers in --gpus order, then llama-server; each sees only its own."""
    r = Route.build("hybrid", "cuda", [3, 1, 2])
    assert [c.holder for c in r.cards] == ["server", "rpc0", "rpc1"]
    assert [dict(c.env)["CUDA_VISIBLE_DEVICES"] for c in r.cards] == ["3", "1", "2"]
    assert [p.name for p in r.processes] == ["rpc0", "rpc1", "server"] and r.server.cards == (0,)
    assert Route.build("rpc", "cuda", [0, 1]).server.cards == ()
    assert [c.holder for c in Route.build("multi", "sycl", [0, 1]).cards] == ["server", "server"]
    assert Route.build("hybrid", "cpu", [0, 1]).host_position == 0 and Route.build("rpc", "cpu", [0, 1]).host_position is None


def test_route_defaults():
    """-ub 256 over an RPC link, 512 on a native context; link polling only on GPU groups with cores to spare."""
    assert Route.build("hybrid", "cuda", [0, 1]).ubatch == Route.build("rpc", "cpu", [0]).ubatch == 256
    assert Route.build("multi", "cuda", [0, 1]).ubatch == Route.build("single", "cpu", [0]).ubatch == 512


@pytest.mark.parametrize("mode,backend,indices", [("multi", "cpu", [0, 1]), ("single", "cuda", [0, 1]),
                                                  ("hybrid", "cuda", [0]), ("multi+workaround", "cuda", [0, 1]),
                                                  ("warp", "cuda", [0, 1]), ("rpc", "cuda", [0, 0]),
                                                  ("rpc", "quantum", [0])])
def test_impossible_routes_are_one_line_errors(mode, backend, indices):
    with pytest.raises(BadInput):
        Route.build(mode, backend, indices)


def test_specs_refuse_a_plan_made_for_another_route():
    cfg = config("cuda", "hybrid", [0, 1])
    with pytest.raises(BadInput, match="arcsplit plan --mode"):
        build_specs(ServeConfig(plan=cfg.plan, mode="rpc", backend="cuda", server_bin="s", rpc_bin="r"), [1, 2])


def test_llama_server_argv_is_complete_verbosity_and_router_protocol_included():
    """The spec is what runs: -lv 4 (buffer lines) before the user's args, the router env, stdin kept."""
    server = specs_for(config("cpu", "rpc", [0, 1], extra_args=("--temp", "0")))[-1]
    argv = list(server.argv)
    assert argv[-4:] == [*SERVER_LOG_ARGS, "--temp", "0"]
    assert server.env_dict["LLAMA_SERVER_ROUTER_PORT"] == "8080" and server.keep_stdin
    own = specs_for(config("cpu", "rpc", [0, 1], extra_args=("-lv", "1")))[-1]
    assert list(own.argv)[-2:] == ["-lv", "1"] and list(own.argv).count("-lv") == 1


def test_output_layer_per_route() -> None:
    """local only when asked, and only on a hybrid route; auto keeps llama.cpp's place (measured no faster)."""
    assert Route.build("hybrid", "cuda", [0, 1]).output_local("local")
    assert not any(Route.build(m, "cuda", [0, 1]).output_local("local") for m in ("rpc", "multi"))
    for choice in ("auto", "last"):
        assert not Route.build("hybrid", "cuda", [0, 1]).output_local(choice)
    with pytest.raises(BadInput, match="--output-layer"):
        Route.build("hybrid", "cuda", [0, 1]).output_local("first")


def test_rpc_link_polling_only_for_gpu_groups_with_cores_to_spare() -> None:
    """Patch 0005's ARCSPLIT_RPC_SPIN_US: set by arcsplit on GPU groups of a machine with cores to spare, never on
    the CPU backend (there the cards are the cores); the user's own value wins; nonsense is one clear line."""
    from arcsplit.route import RPC_SPIN_US
    from arcsplit.decide.prepare import rpc_spin_us

    cuda, sycl, cpu = (Route.build("rpc", b, [0, 1]) for b in ("cuda", "sycl", "cpu"))
    assert rpc_spin_us(cuda, 32, {}) == RPC_SPIN_US > 0
    assert rpc_spin_us(sycl, 4, {}) == 0 and rpc_spin_us(cpu, 64, {}) == 0
    assert rpc_spin_us(cpu, 2, {"ARCSPLIT_RPC_SPIN_US": "500"}) == 500
    assert rpc_spin_us(cuda, 32, {"ARCSPLIT_RPC_SPIN_US": "0"}) == 0
    with pytest.raises(BadInput, match="ARCSPLIT_RPC_SPIN_US"):
        rpc_spin_us(cuda, 32, {"ARCSPLIT_RPC_SPIN_US": "fast"})


@pytest.mark.parametrize("name", ["ARCSPLIT_RPC_RELAY_KIB", "ARCSPLIT_RPC_GATE_HOST_KIB"])
def test_a_size_switch_that_is_not_a_number_is_one_clear_line(name: str) -> None:
    """Patch 0007 reads ARCSPLIT_RPC_RELAY_KIB, and 0001 ARCSPLIT_RPC_GATE_HOST_KIB, in llama-server and takes a word
    it cannot parse as 0 (whole tensors; every host input gated), silently; arcsplit refuses it before any process
    starts and names the fix."""
    from arcsplit.llama.patches import check_switches, rpc_gate_host_kib, rpc_relay_kib

    read = rpc_relay_kib if name == "ARCSPLIT_RPC_RELAY_KIB" else rpc_gate_host_kib
    assert read({name: "256"}) == 256
    assert read({name: "0"}) == 0
    assert read({name: ""}) is None is read({})  # as unset
    for bad in ("1M", "-4", " "):
        for check in (read, check_switches):
            with pytest.raises(BadInput, match=name) as err:
                check({name: bad})
            assert "whole number of KiB" in (err.value.fix or "")


def test_a_pinned_reads_switch_that_is_not_0_or_1_is_one_clear_line() -> None:
    """Patch 0001 reads ARCSPLIT_RPC_PINNED in llama-server and takes anything but a leading 0 as on; arcsplit
    refuses a word before any process starts, so "off" does not silently mean on."""
    from arcsplit.llama.patches import pinned_reads_on

    assert pinned_reads_on({}) and pinned_reads_on({"ARCSPLIT_RPC_PINNED": ""})  # unset: on
    assert pinned_reads_on({"ARCSPLIT_RPC_PINNED": "1"}) and not pinned_reads_on({"ARCSPLIT_RPC_PINNED": "0"})
    for bad in ("off", "no", "2"):
        with pytest.raises(BadInput, match="ARCSPLIT_RPC_PINNED") as err:
            pinned_reads_on({"ARCSPLIT_RPC_PINNED": bad})
        assert "ARCSPLIT_RPC_PINNED=0" in (err.value.fix or "")


def test_an_async_reads_switch_that_is_not_0_or_1_is_one_clear_line() -> None:
    """Patch 0001 reads ARCSPLIT_RPC_ASYNC_READ in llama-server; as with every switch, a word is refused before
    any process starts."""
    from arcsplit.llama.patches import async_reads_on

    assert async_reads_on({}) and async_reads_on({"ARCSPLIT_RPC_ASYNC_READ": "1"})
    assert not async_reads_on({"ARCSPLIT_RPC_ASYNC_READ": "0"})
    with pytest.raises(BadInput, match="ARCSPLIT_RPC_ASYNC_READ") as err:
        async_reads_on({"ARCSPLIT_RPC_ASYNC_READ": "off"})
    assert "ARCSPLIT_RPC_ASYNC_READ=0" in (err.value.fix or "")


def test_the_queued_sets_switch_is_on_by_default_and_refuses_a_word() -> None:
    """Patch 0003's rpc-servers read ARCSPLIT_RPC_QUEUED_SETS (a graph input's copy queued on the device, not waited
    for): on when unset; 0 waits as stock does; any other word is refused before a process starts."""
    from arcsplit.llama.patches import check_switches, queued_sets_on

    assert queued_sets_on({}) and queued_sets_on({"ARCSPLIT_RPC_QUEUED_SETS": "1"})
    assert not queued_sets_on({"ARCSPLIT_RPC_QUEUED_SETS": "0"})
    for bad in ("off", "no", "2"):
        with pytest.raises(BadInput, match="ARCSPLIT_RPC_QUEUED_SETS") as err:
            check_switches({"ARCSPLIT_RPC_QUEUED_SETS": bad})
        assert "ARCSPLIT_RPC_QUEUED_SETS=0" in (err.value.fix or "")


def test_the_gated_sets_switch_is_off_by_default_and_refuses_a_word() -> None:
    """The user's ARCSPLIT_RPC_GATE (gated sets, patches 0001, 0003, 0007, 0009) reads off when unset (the route
    then decides, next test): llama-server reads it and takes only a leading 1 as on, so arcsplit refuses any other
    word before a process starts ("on" is not on)."""
    from arcsplit.llama.patches import check_switches, gated_sets_on

    assert not gated_sets_on({}) and not gated_sets_on({"ARCSPLIT_RPC_GATE": ""})
    assert gated_sets_on({"ARCSPLIT_RPC_GATE": "1"}) and not gated_sets_on({"ARCSPLIT_RPC_GATE": "0"})
    for bad in ("on", "yes", "2"):
        with pytest.raises(BadInput, match="ARCSPLIT_RPC_GATE") as err:
            check_switches({"ARCSPLIT_RPC_GATE": bad})
        assert "ARCSPLIT_RPC_GATE=1" in (err.value.fix or "")


def test_gated_sets_are_on_for_all_rpc_cuda_groups_of_one_machine_and_the_user_decides() -> None:
    """Gated sets were measured faster on all-RPC CUDA (one H100, MPS: decode in 3 of 3 paired runs, MoE and
    dense) and not in hybrid, so arcsplit turns them on there only, with no host input gated (a MoE's prompt
    embeddings gated cost 5 % of prefill); the user's ARCSPLIT_RPC_GATE wins either way, and their
    ARCSPLIT_RPC_GATE_HOST_KIB reaches llama-server unchanged."""
    from arcsplit.decide.prepare import rpc_gate

    rpc_cuda = Route.build("rpc", "cuda", [0, 1])
    assert rpc_gate(rpc_cuda, {}) is True
    for off in (Route.build("hybrid", "cuda", [0, 1]), Route.build("rpc", "sycl", [0, 1]),
                Route.build("rpc", "vulkan", [0, 1]), Route.build("rpc", "cpu", [0, 1]),
                Route.build("rpc", "cuda", [0, 1], ["", "b"])):
        assert rpc_gate(off, {}) is False, off
    assert rpc_gate(rpc_cuda, {"ARCSPLIT_RPC_GATE": "0"}) is False
    assert rpc_gate(Route.build("hybrid", "cuda", [0, 1]), {"ARCSPLIT_RPC_GATE": "1"}) is True

    for spec in specs_for(config("cuda", "rpc", [0, 1], rpc_gate=True)):
        assert spec.env_dict["ARCSPLIT_RPC_GATE"] == "1"
        assert spec.env_dict["ARCSPLIT_RPC_GATE_HOST_KIB"] == str(4 << 20)  # no host input gated
    for spec in specs_for(config("cuda", "rpc", [0, 1], rpc_gate=True, rpc_gate_host_kib=256)):
        assert spec.env_dict["ARCSPLIT_RPC_GATE_HOST_KIB"] == "256"
    for spec in specs_for(config("cuda", "rpc", [0, 1])) + specs_for(config("cuda", "multi", [0, 1], rpc_gate=True)):
        assert "ARCSPLIT_RPC_GATE" not in spec.env_dict, spec.name


def test_rpc_spin_reaches_every_process_of_an_rpc_group_only() -> None:
    for mode in ("hybrid", "rpc"):
        for spec in specs_for(config("cuda", mode, [0, 1], rpc_spin_us=20000)):
            assert spec.env_dict["ARCSPLIT_RPC_SPIN_US"] == "20000", (mode, spec.name)
    for spec in specs_for(config("cuda", "multi", [0, 1], rpc_spin_us=20000)):
        assert "ARCSPLIT_RPC_SPIN_US" not in spec.env_dict
    for spec in specs_for(config("cuda", "rpc", [0, 1])):
        assert "ARCSPLIT_RPC_SPIN_US" not in spec.env_dict


def test_shared_memory_link_reaches_llama_server_and_the_rpc_servers_of_this_host() -> None:
    """Patch 0008 needs ARCSPLIT_RPC_SHM=1 on both ends; arcsplit sets it (or 0, when the user said 0) in every
    process of an RPC group of one host, and in none of a group without an RPC link."""
    for on in (True, False):
        for mode in ("hybrid", "rpc"):
            for spec in specs_for(config("cuda", mode, [0, 1], rpc_shm=on)):
                assert spec.env_dict["ARCSPLIT_RPC_SHM"] == ("1" if on else "0"), (mode, spec.name)
    for spec in specs_for(config("cuda", "multi", [0, 1], rpc_shm=True)):
        assert "ARCSPLIT_RPC_SHM" not in spec.env_dict


def test_the_shared_memory_switch_is_zero_or_one_else_one_clear_line() -> None:
    from arcsplit.decide.prepare import rpc_shm

    assert rpc_shm({}) is True and rpc_shm({"ARCSPLIT_RPC_SHM": ""}) is True  # on by default
    assert rpc_shm({"ARCSPLIT_RPC_SHM": "0"}) is False and rpc_shm({"ARCSPLIT_RPC_SHM": "1"}) is True
    for bad in ("yes", "2", "off"):
        with pytest.raises(BadInput, match="ARCSPLIT_RPC_SHM") as err:
            rpc_shm({"ARCSPLIT_RPC_SHM": bad})
        assert "ARCSPLIT_RPC_SHM=0" in (err.value.fix or "")
