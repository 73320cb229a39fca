"""Driver faults in the members' logs: every verbatim line of tests/fixtures/faults (sources in its SOURCES.md) maps to
its kind, real logs of this build match none, and a failure says its cause in words with the lines below it."""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit.decide.specs import ServeConfig
from arcsplit.llama import logs
from arcsplit.llama.resets import DRM_WEDGED_DOC, NVIDIA_SMI_DOC, XE_DOC, reset_advice
from arcsplit.planner import CardPlan, Plan, PlanOptions
from arcsplit.proc.child import exit_words
from arcsplit.proc.rundir import fault_lines
from arcsplit.proc.spec import ProcessSpec
from arcsplit.proc.states import Cause
from arcsplit.rig import Card
from arcsplit.roles import Role
from arcsplit.route import Route
from arcsplit.run import faults

FX = Path(__file__).parent / "fixtures"
G = 1 << 30

# file -> (failure_kind: what the fallback reads, fault_kind: the cause counted per card)
EXPECTED = {
    "faults/sycl_device_lost_27198.log": ("device_lost", "device_lost"),
    "faults/sycl_device_lost_25286.log": ("device_lost", "device_lost"),
    "faults/sycl_native_api_device_lost_11812.log": ("device_lost", "device_lost"),
    "runtime/device_lost.log": ("device_lost", "device_lost"),
    "faults/sycl_out_of_resources_ggml1072.log": ("out_of_memory", "out_of_memory"),
    "runtime/out_of_resources.log": ("out_of_memory", "out_of_memory"),
    "faults/sycl_pi_out_of_host_memory_sycl_md.log": ("out_of_memory", "out_of_memory"),
    "faults/sycl_unknown_pi_error_9241.log": (None, None),
    # the Intel multi-device failure keeps its kinds (and the one-context fallback); it is no fault
    "runtime/multi_device_oom_22885.log": ("alloc", None),
    "runtime/native_api_39.log": ("alloc", None),
    "runtime/ur_exception_27063.log": ("pinned_output", None),
    "runtime/context_unknown_921.log": (None, None),
    "faults/cuda_illegal_address_16953.log": ("device_error", "device_error"),
    "faults/cuda_illegal_address_27430.log": ("device_error", "device_error"),
    "faults/cuda_launch_failure_8117.log": ("device_error", "device_error"),
    "faults/cuda_launch_failure_ollama9247.log": ("device_error", "device_error"),
    "faults/cuda_launch_timeout_27415.log": ("hang", "hang"),
    "faults/cuda_out_of_memory_ollama3237.log": ("out_of_memory", "out_of_memory"),
    "faults/cuda_malloc_out_of_memory_20431.log": ("alloc", "out_of_memory"),
    "faults/vulkan_device_lost_17334.log": ("device_lost", "device_lost"),
    "faults/vulkan_device_lost_27076.log": ("device_lost", "device_lost"),
    "faults/vulkan_radv_context_lost_25664.log": ("device_lost", "device_lost"),
    "faults/vulkan_anv_gpu_hung_wgpu_rs392.log": ("device_lost", "device_lost"),
    "faults/vulkan_out_of_memory_15256.log": ("out_of_memory", "out_of_memory"),
    "faults/vulkan_anv_out_of_memory_8492.log": ("out_of_memory", "out_of_memory"),
    "faults/this_machine_llama_server.log": (None, None),
    "faults/this_machine_rpc_server.log": (None, None),
}


def lines(name: str) -> list[str]:
    return (FX / name).read_text(encoding="utf-8").splitlines()


def test_every_fault_fixture_is_expected_and_has_a_source():
    sources = (FX / "faults" / "SOURCES.md").read_text()
    files = {f"faults/{p.name}" for p in (FX / "faults").glob("*.log")}
    assert files <= EXPECTED.keys(), f"give {sorted(files - EXPECTED.keys())} an expected kind"
    assert all(Path(f).name in sources for f in files), "name each fixture's source in SOURCES.md"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_fixture_maps_to_its_kind(name):
    want_kind, want_fault = EXPECTED[name]
    got = lines(name)
    assert (logs.failure_kind(got), logs.fault_kind(got)) == (want_kind, want_fault)
    if want_fault is not None:  # and each line that carries it alone does too: no neighbour needed
        pattern = dict(logs._SIGNATURES)[want_fault]
        assert any(logs.fault_kind([line]) == want_fault for line in got if pattern.search(line))


@pytest.mark.parametrize("name", ["faults/this_machine_llama_server.log", "faults/this_machine_rpc_server.log"])
def test_no_line_of_a_real_run_here_is_a_fault(name):
    assert [line for line in lines(name) if logs.fault_kind([line])] == []


def test_the_deciding_lines_are_the_fault_and_where_ggml_says_it_happened():
    got = logs.deciding_lines(lines("faults/sycl_device_lost_27198.log"), "device_lost")
    assert got[0] == "level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"
    assert "in function dev2dev_memcpy" in got[3] and len(got) == 4
    cuda = lines("faults/cuda_illegal_address_16953.log")
    assert logs.deciding_lines(cuda, "device_error")[1].startswith("current device: 1, in function")
    assert logs.fault_position(cuda) == 1 and logs.fault_position(lines("faults/vulkan_device_lost_27076.log")) == 0


@pytest.mark.parametrize("rc,words", [(-9, "exited with signal 9 (killed)"), (-6, "exited with signal 6 (aborted)"),
                                      (134, "exited with signal 6 (aborted)"), (1, "exited with code 1"),
                                      (0, "exited with code 0"), (-64, "exited with signal 64 (SIGRTMAX)")])
def test_exit_words(rc, words):
    assert exit_words(rc) == words


def config(mode: str, backend: str, n: int = 2, driver: str | None = None) -> ServeConfig:
    devices = Route.build(mode, backend, list(range(n))).devices
    cards = tuple(CardPlan(Card(backend, i, f"card {i}", 16 * G, 16 * G, pci=f"0000:0{i + 3}:00.0", driver=driver),
                           d, 10 * i, 10 * (i + 1), 1, 1, 0, 1, has_output=i == n - 1) for i, d in enumerate(devices))
    plan = Plan("/m.gguf", "llama", 10 * n - 1, 4096, PlanOptions(n_ctx=4096), cards)
    return ServeConfig(plan=plan, mode=mode, backend=backend, server_bin="/b/llama-server", rpc_bin="/b/rpc",
                       port=8080, cores=2)


def spec(name: str, role: Role, cards: tuple[int, ...], node: str = "") -> ProcessSpec:
    return ProcessSpec(name=name, role=role, argv=("x",), env=(), host="127.0.0.1", port=1, cards=cards,
                       node=node)


def test_a_lost_device_is_said_in_words_with_the_lines_below():
    f = faults.judge(config("rpc", "sycl", driver="xe"), spec("rpc1", Role.RPC, (1,)),
                     lines("faults/sycl_device_lost_27198.log"), -6)
    assert f.message == "rpc1 (SYCL1) lost its device: level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"
    assert "|" not in f.message and f.lines[0] in f.message and len(f.lines) == 4
    assert (f.cause, f.card, f.kind) == (Cause.DEVICE_LOST, "SYCL1", "device_lost")


def test_the_fault_names_the_card_among_several_a_member_holds():
    f = faults.judge(config("multi", "cuda"), spec("server", Role.SERVER, (0, 1)),
                     lines("faults/cuda_illegal_address_16953.log"), -6)
    assert f.message.startswith("llama-server (CUDA1) lost its CUDA context") and f.card == "CUDA1"
    oom = faults.judge(config("multi", "cuda"), spec("server", Role.SERVER, (0, 1)),
                       lines("faults/cuda_malloc_out_of_memory_20431.log"), 1, " while loading")
    assert oom.message.startswith("llama-server ran out of memory on CUDA0,CUDA1 while loading: ggml_backend_cuda_")
    assert (oom.kind, oom.cause) == ("alloc", Cause.OUT_OF_MEMORY)  # the fallback still reads "alloc"


def test_an_exit_without_a_fault_is_said_as_an_exit():
    f = faults.judge(config("rpc", "cpu"), spec("rpc0", Role.RPC, (0,)), ["Starting RPC server v7.0.0"], -9)
    assert (f.message, f.cause, f.lines) == ("rpc0 (CPU0) exited with signal 9 (killed)", Cause.EXIT,
                                             ("Starting RPC server v7.0.0",))
    gone = faults.judge(config("rpc", "cpu"), spec("rpc1", Role.RPC, (1,), node="b"),
                        ["node agent on b exited: ssh: connect to host b port 22: Connection refused"], 255)
    assert gone.message == ("rpc1 (CPU1) exited with code 255: node agent on b exited: ssh: connect to host b port "
                            "22: Connection refused")  # run/remote.py's line when a host's agent goes: quoted
    hang = faults.judge(config("rpc", "cuda"), spec("rpc0", Role.RPC, (0,), node="b"),
                        lines("faults/cuda_launch_timeout_27415.log"), -6)
    assert hang.cause == Cause.HANG and hang.message.startswith("rpc0 (CUDA0) hung: the driver stopped a kernel")


def test_a_card_lost_twice_needs_a_driver_reset_said_per_driver():
    counts: dict[str, dict[str, int]] = {}
    cfg = config("rpc", "sycl", driver="xe")
    faults.count(counts, "SYCL1", None, Cause.DEVICE_LOST)
    faults.count(counts, "SYCL0", None, Cause.EXIT)
    assert faults.resets(cfg, counts) == []  # once can be transient: the restart gets a fresh context
    faults.count(counts, "SYCL1", None, Cause.DEVICE_LOST)
    (reset,) = faults.resets(cfg, counts)
    assert reset["card"] == "SYCL1" and reset["device_lost"] == faults.RESET_AFTER == 2
    assert reset["line"].startswith("SYCL1 needs a driver reset (its device was lost 2 times in this run): on the xe")
    assert "echo 0000:04:00.0 | sudo tee /sys/bus/pci/drivers/xe/unbind" in reset["line"] and XE_DOC in reset["line"]
    assert "xe.wedged_mode" in reset["line"]
    assert counts == {"SYCL1": {"device_lost": 2}, "SYCL0": {"exit": 1}}
    assert fault_lines({"card_faults": counts, "resets": [reset]}) == [
        "failures by card: SYCL1 device_lost x2; SYCL0 exit x1", reset["line"]]


def test_reset_advice_follows_the_driver():
    assert "nvidia-smi -r -i 0000:03:00.0" in reset_advice("cuda", "nvidia", "0000:03:00.0") \
        and NVIDIA_SMI_DOC in reset_advice("cuda")
    assert "nvidia-smi -r -i 1" in reset_advice("vulkan", None, None, 1, "NVIDIA GeForce RTX 4090")
    assert "/sys/bus/pci/drivers/xe/" in reset_advice("vulkan", "xe") and XE_DOC in reset_advice("sycl")
    assert "/sys/bus/pci/drivers/i915/unbind" in reset_advice("sycl", "i915") and DRM_WEDGED_DOC in reset_advice("sycl", "i915")
    assert "/sys/bus/pci/drivers/amdgpu/unbind" in reset_advice("vulkan", "amdgpu", "0000:0c:00.0")
