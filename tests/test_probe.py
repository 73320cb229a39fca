"""The probe: classification on recorded Intel failure logs, and the real mechanism on the CPU build.

What the CPU runs prove: a real llama-bench loads a real generated GGUF across two real rpc-servers (the
process plumbing of the hybrid/rpc probes, and the same launch/timeout/cleanup/classify path the one-context
probe uses), times out when told, and leaves no process or temp file behind, also on Ctrl-C. What they do not
prove: anything about an Intel card; the SYCL failure signatures are only checked on recorded text.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from arcsplit.errors import BadInput
from arcsplit.llama.probe import (ProbeResult, classify, load_cached, plan_probe, run_probe, run_probes,
                                  save_cached, cache_key)

FX = Path(__file__).parent / "fixtures" / "runtime"
ROOT = Path(__file__).resolve().parents[1]


def log(name: str) -> str:
    return (FX / name).read_text()


# ---------------------------------------------------------------- classification on recorded (verbatim) logs

@pytest.mark.parametrize("name, rc, status, code, needle", [
    ("multi_device_oom_22885.log", 1, "alloc_failed", None, "can't allocate 427970304 Bytes"),
    # #27063 ran `-dev sycl1`: UR 39 copying the output off device 1, the llama.cpp#28765 bug, not NEO's
    ("ur_exception_27063.log", -6, "pinned_output", 39, "in function ggml_backend_sycl_get_tensor_async"),
    ("backtrace_28765.txt", -6, "pinned_output", None, "ggml_backend_sycl_get_tensor_async"),
    ("native_api_39.log", 1, "ur_error", 39, "Native API returns: 39"),
    ("ur_trace_916.log", 1, "ur_error", 39, "urUSMDeviceAlloc"),
    ("context_unknown_921.log", -6, "context_failed", 2147483646, "2147483646"),
    ("device_lost.log", -6, "ur_error", 20, "DEVICE_LOST"),
    ("out_of_resources.log", 1, "ur_error", 40, "OUT_OF_RESOURCES"),
])
def test_classify_recorded_failures(name, rc, status, code, needle):
    got_status, detail, ur_code, _ = classify(log(name), rc, False, ("SYCL0", "SYCL1"))
    assert (got_status, ur_code) == (status, code)
    assert needle in detail


def test_classify_alloc_failure_keeps_the_ur_code_when_both_are_printed():
    text = log("multi_device_oom_22885.log") + log("native_api_39.log")
    status, _, code, _ = classify(text, 1, False)
    assert (status, code) == ("alloc_failed", 39)


def test_pinned_output_failure_names_its_own_remedy_not_the_kernel():
    """Same UR error 39 as the NEO bug, other cause: the detail points at llama.cpp#28765 and its workaround."""
    status, detail, _, _ = classify(log("ur_exception_27063.log"), -6, False, ("SYCL0", "SYCL1"))
    assert status == "pinned_output"
    assert "llama.cpp#28765" in detail and "GGML_SYCL_ENABLE_HOST_PINNED_MEM=0" in detail


def test_the_pinned_tree_has_the_28765_fix():
    """The managed build's llama.cpp allocates pinned host memory on the buffer's own device (PR #28895), not on
    device 0 (PR #26789's regression): arcsplit's own SYCL build is not affected. Read from the extracted tree."""
    from arcsplit.llama.source import llama_root

    src = llama_root() / "src" / "ggml" / "src" / "ggml-sycl" / "ggml-sycl.cpp"
    if not src.is_file():
        pytest.skip(f"the pinned llama.cpp tree is not extracted at {src.parent}")
    text = src.read_text(errors="replace")
    assert "static void * ggml_backend_sycl_host_malloc(int device, size_t size)" in text
    assert "static void * ggml_backend_sycl_host_malloc(size_t size)" not in text


def test_classify_crash_in_context_creation_vs_later():
    init_only = "Build with Macros:\n  GGML_SYCL_F16: yes\n"  # ggml-sycl init, no model load yet (#21747)
    assert classify(init_only, -11, False)[0] == "context_crash"
    assert "SIGSEGV" in classify(init_only, -11, False)[1]
    assert classify(init_only + log("multi_device_oom_22885.log")[:200], -11, False)[0] == "crash"
    assert classify("llama_model_load: ...\n", 139, False)[0] == "crash"


def test_classify_success_needs_every_card():
    both = ("load_tensors:        SYCL0 model buffer size =    35.82 MiB\n"
            "load_tensors:        SYCL1 model buffer size =   199.34 MiB\n")
    assert classify(both, 0, False, ("SYCL0", "SYCL1"))[0] == "ok"
    one = "load_tensors:        SYCL0 model buffer size =    35.82 MiB\n"
    status, detail, _, allocated = classify(one, 0, False, ("SYCL0", "SYCL1"))
    assert status == "incomplete" and "SYCL1" in detail and allocated == ("SYCL0",)
    # RPC buffers are named RPC0[endpoint] for every server: matched by endpoint, not by name
    rpc = ("load_tensors: RPC0[127.0.0.1:50211] model buffer size =    35.82 MiB\n"
           "load_tensors: RPC0[127.0.0.1:50212] model buffer size =   199.34 MiB\n")
    tokens = {"RPC0": "[127.0.0.1:50211]", "RPC1": "[127.0.0.1:50212]"}
    assert classify(rpc, 0, False, ("RPC0", "RPC1"), tokens)[3] == ("RPC0", "RPC1")


def test_classify_rpc_and_timeout():
    assert classify("Failed to connect to 127.0.0.1:50052\n", -6, False)[0] == "rpc_error"
    assert classify("ggml-rpc.cpp:498: Remote RPC server crashed or returned malformed response\n", -6, False)[0] == "rpc_error"
    status, detail, _, _ = classify("load_tensors: ...", None, True, timeout_s=5)
    assert status == "timeout" and "5 s" in detail


def test_plans_keep_each_process_to_its_cards():
    multi = plan_probe("multi", "sycl", [1, 2])
    assert multi.bench_env["ONEAPI_DEVICE_SELECTOR"] == "level_zero:1,2" and multi.local_devices == ("SYCL0", "SYCL1")
    wa = plan_probe("multi+workaround", "sycl", [0, 1])
    assert wa.bench_env["NEOReadDebugKeys"] == "1" and wa.bench_env["ForceZeDeviceCanAccessPerReturnValue"] == "0"
    hybrid = plan_probe("hybrid", "sycl", [0, 1, 2])
    assert hybrid.bench_env["ONEAPI_DEVICE_SELECTOR"] == "level_zero:0" and hybrid.local_devices == ("SYCL0",)
    assert [env["ONEAPI_DEVICE_SELECTOR"] for _, env in hybrid.servers] == ["level_zero:1", "level_zero:2"]
    rpc = plan_probe("rpc", "cuda", [0, 1])
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in rpc.servers] == ["0", "1"] and rpc.local_devices == ()
    for bad in (("multi", "cpu", [0, 1]), ("multi+workaround", "cuda", [0, 1]), ("multi", "sycl", [0]), ("x", "sycl", [0, 1])):
        with pytest.raises(BadInput):
            plan_probe(*bad)


# ---------------------------------------------------------------- the real mechanism on the CPU build

def _leftovers(before: set[str]) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "arcsplit-probe-*"))) - before


def _tmp_before() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "arcsplit-probe-*")))


def _my_children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.mark.slow
def test_cpu_rpc_probe_end_to_end(llama_bins):
    before = _tmp_before()
    results = run_probes(["rpc"], "cpu", [0, 1], llama_bins, timeout=120)
    assert len(results) == 1
    r = results[0]
    assert r.ok and r.status == "ok", r.log_tail
    assert r.devices == ("RPC0", "RPC1") and r.allocated == ("RPC0", "RPC1")  # both servers got layers
    assert r.returncode == 0 and r.seconds > 0
    assert _my_children() == [] and _leftovers(before) == set()


@pytest.mark.slow
def test_cpu_probe_reports_a_broken_model_as_a_failure(llama_bins, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = run_probe("rpc", "cpu", [0, 1], llama_bins, bad, timeout=60)
    assert not r.ok and r.status == "error" and r.returncode not in (0, None)
    assert _my_children() == []


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [0.01, 0.8])
def test_cpu_probe_times_out_and_cleans_up(llama_bins, demo_model, timeout):
    # 0.01 s: before the rpc-servers listen; 0.8 s: while llama-bench sends the 253 MB demo model to them
    before = _tmp_before()
    t0 = time.monotonic()
    r = run_probe("rpc", "cpu", [0, 1], llama_bins, demo_model, timeout=timeout)
    assert not r.ok and r.status == "timeout"
    assert time.monotonic() - t0 < timeout + 10  # the kill is prompt
    assert _my_children() == [] and _leftovers(before) == set()


@pytest.mark.slow
def test_ctrl_c_during_probe_leaves_nothing(llama_bins, demo_model):
    before = _tmp_before()
    # As in a terminal: a child of a background job starts with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; a user's Ctrl-C reaches a process whose SIGINT is Python's default handler.
    script = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from pathlib import Path
        from arcsplit.llama.locate import find_llama
        from arcsplit.llama.probe import run_probe
        run_probe("rpc", "cpu", [0, 1], find_llama({str(llama_bins.bin_dir)!r}), Path({str(demo_model)!r}), timeout=300)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE)
    proc = psutil.Process(child.pid)
    seen: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not seen:
        seen = [p for p in proc.children(recursive=True) if "rpc-server" in " ".join(p.cmdline())]
        time.sleep(0.02)
    assert seen, "the probe never started an rpc-server"
    time.sleep(0.3)
    seen = proc.children(recursive=True)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert b"KeyboardInterrupt" in err
    gone, alive = psutil.wait_procs(seen, timeout=5)
    assert alive == [], [p.cmdline() for p in alive]
    assert _leftovers(before) == set()


# ---------------------------------------------------------------- cache

def test_cache_roundtrip_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    key = cache_key("26.09.37435.12", "6.19.10-300.fc44.x86_64", "build 9093", "sycl", ["0: B70", "1: B70"])
    assert load_cached(key) is None
    r = ProbeResult("multi", False, "alloc_failed", "alloc_tensor_range: failed to allocate SYCL0 buffer", 39, 1, 3.2,
                    ("SYCL0", "SYCL1"), (), (("A", "1"),))
    path = save_cached(key, [r])
    assert path.parent == tmp_path / "probe"
    results, at = load_cached(key)
    assert results == [r] and at[:4].isdigit()
    other = cache_key("26.09.37435.12", "7.1.0", "build 9093", "sycl", ["0: B70", "1: B70"])
    assert load_cached(other) is None  # a new kernel means a new probe
    path.write_text("{not json")
    assert load_cached(key) is None


def test_doctor_gives_the_pinned_output_failure_its_own_remedies():
    """A one-context probe failing with #28765 must not send the user to a kernel upgrade or a NEO downgrade."""
    from arcsplit.cli.doctor import _render, remedies
    from arcsplit.llama import facts as F
    from arcsplit.llama.childenv import clean_env
    from arcsplit.llama.mode import choose_mode
    from arcsplit.llama.runtime import RuntimeReport
    from arcsplit.llama.verdict import judge

    facts = F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", "7.2.0", None, sysfs_root=None)
    verdict = judge("sycl", 38308, "7.2.0", None)  # kernel >= 7.1: NEO/kernel bug ruled out by versions
    status, detail, code, _ = classify(log("ur_exception_27063.log"), -6, False, ("SYCL0", "SYCL1"))
    multi = ProbeResult("multi", False, status, detail, code)
    _, dropped = clean_env("sycl", {"GGML_SYCL_DISABLE_OPT": "1"})
    report = RuntimeReport("sycl", (0, 1), facts, verdict, choose_mode("sycl", 2, verdict=verdict,
                           probe_results=[multi]), (multi,), env_dropped=dropped)
    fixes = remedies(report)
    text = " ".join(f["title"] + " " + f["command"] for f in fixes)
    assert "#28765" in fixes[0]["title"] and "GGML_SYCL_ENABLE_HOST_PINNED_MEM=0" in text and "--mode hybrid" in text
    assert "7.1" not in text and "25.40" not in text
    out = _render(report, [], None, fixes)
    assert "not the NEO/kernel bug" in out and "follows the probe" in out
    assert "GGML_SYCL_DISABLE_OPT=1 removed" in out
