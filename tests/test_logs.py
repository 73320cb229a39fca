"""Log-line parsers. Lines are verbatim: from this CPU build's llama-server -lv 4 output (captured while writing
this file) and from public issues (ggml-org/llama.cpp#22885, #27063; tests/fixtures/runtime/SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit.llama.logs import (MULTI_DEVICE_KINDS, MiB, error_lines, failure_kind, link_on_tcp, parse_buffer_line,
                                 sum_buffers)

# llama-server -lv 4, two rpc-servers, demo Gemma (this build).
RPC_LOAD = """\
0.00.468.531 I load_tensors: offloaded 19/19 layers to GPU
0.00.468.532 I load_tensors:   CPU_Mapped model buffer size =   170.00 MiB
0.00.468.533 I load_tensors: RPC0[127.0.0.1:50301] model buffer size =    32.39 MiB
0.00.468.534 I load_tensors: RPC0[127.0.0.1:50302] model buffer size =   202.77 MiB
0.01.145.672 I llama_context:        CPU  output buffer size =     1.00 MiB
0.01.150.297 I llama_kv_cache: RPC0[127.0.0.1:50301] KV buffer size =     1.00 MiB
0.01.152.156 I llama_kv_cache: RPC0[127.0.0.1:50302] KV buffer size =     2.00 MiB
0.01.152.215 I llama_kv_cache: size =    3.00 MiB (  1024 cells,   3 layers,  1/1 seqs), K (f16):    1.50 MiB, V (f16):    1.50 MiB
0.01.152.459 I llama_kv_cache: RPC0[127.0.0.1:50301] KV buffer size =     8.00 MiB
0.01.157.022 I llama_kv_cache: RPC0[127.0.0.1:50302] KV buffer size =     7.00 MiB
0.01.165.415 I sched_reserve: RPC0[127.0.0.1:50301] compute buffer size =    29.57 MiB
0.01.165.435 I sched_reserve: RPC0[127.0.0.1:50302] compute buffer size =    29.57 MiB
0.01.165.450 I sched_reserve:        CPU compute buffer size =    14.33 MiB
""".splitlines()

# The Intel multi-device-context failure (ggml-org/llama.cpp#22885) and its UR form (#27063).
ALLOC_22885 = """\
ggml_backend_sycl_buffer_type_alloc_buffer: can't allocate 427970304 Bytes of memory on device
alloc_tensor_range: failed to allocate SYCL0 buffer of size 427970304
llama_model_load: error loading model: unable to allocate SYCL0 buffer
""".splitlines()
ALLOC_27063 = ["level_zero backend failed with error: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)"]
# ggml-org/llama.cpp#27063 in full (tests/fixtures/runtime/ur_exception_27063.log): the same error 39 at decode, in
# ggml_backend_sycl_get_tensor_async - the #28765 bug (output on a device other than 0), not the NEO one.
PINNED_27063 = (Path(__file__).parent / "fixtures" / "runtime" / "ur_exception_27063.log").read_text().splitlines()
# llama-server after kill -9 of an rpc-server (this build; docs/llama-cpp-notes.md).
RPC_CRASH = ["ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response"]


def test_rpc_buffers_are_told_apart_by_endpoint_not_name():
    parsed = [b for b in map(parse_buffer_line, RPC_LOAD) if b]
    assert len(parsed) == 11  # the KV summary line is not a buffer
    first = parsed[1]
    assert (first.kind, first.buffer, first.endpoint) == ("model", "RPC0", "127.0.0.1:50301")
    assert first.bytes == int(32.39 * MiB)
    totals = sum_buffers(parsed)
    assert totals["RPC0[127.0.0.1:50302]"]["model"] == int(202.77 * MiB)
    assert totals["RPC0[127.0.0.1:50301]"]["KV"] == int(1.0 * MiB) + int(8.0 * MiB)  # SWA and non-SWA caches add up
    assert totals["CPU"] == {"output": int(1.0 * MiB), "compute": int(14.33 * MiB)}
    assert totals["CPU_Mapped"] == {"model": int(170.0 * MiB)}


def test_gpu_buffer_names_without_timestamps():
    b = parse_buffer_line("load_tensors:        SYCL0 model buffer size =  4096.50 MiB")
    assert b is not None and (b.buffer, b.endpoint, b.kind) == ("SYCL0", None, "model")
    assert parse_buffer_line("llama_kv_cache: size =    3.00 MiB (  1024 cells") is None


def test_failure_signatures():
    assert failure_kind(ALLOC_22885) == "alloc"
    assert failure_kind(ALLOC_27063) == "alloc"
    assert failure_kind(PINNED_27063) == "pinned_output"
    assert {"alloc", "pinned_output"} == set(MULTI_DEVICE_KINDS)  # both make a one-context group fall back
    assert failure_kind(RPC_CRASH) == "rpc_crashed"
    assert failure_kind(["Failed to create server socket"]) == "port_busy"
    assert failure_kind(RPC_LOAD) is None


def test_error_lines_quote_the_cause():
    lines = RPC_LOAD + ALLOC_22885
    assert error_lines(lines, 2) == ALLOC_22885[1:]


def test_a_link_left_on_tcp_is_read_with_its_cause():
    # patch 0008's warning, as llama-server prints it (tests/test_patches.py runs it in a 1 MiB /dev/shm)
    line = "RPC: no shared-memory link (/dev/shm: No space left on device); TCP only"
    assert link_on_tcp(line) == "/dev/shm: No space left on device"
    assert link_on_tcp("RPC: shared-memory link (4 MiB each way)") is None


# -- the lines llama-server prints only at the -lv 4 arcsplit runs it with -------------------------------------------

def test_trace_filter_on_verbatim_lines():
    from arcsplit.llama.logs import trace_filter

    trace = trace_filter()
    lines = [("0.02.623.948 I srv  update_slots: all slots are idle", True),
             ("0.02.424.012 I load_tensors:   CPU_Mapped model buffer size =   235.16 MiB", True),
             ("0.02.614.982 I slot   load_model: id  0 | task -1 | new slot, n_ctx = 512", True),
             ("0.02.617.387 I srv          init: init: chat template, example_format: '<|im_start|>system", True),
             ("You are a helpful assistant<|im_end|>", True),  # the same message, continued
             ("0.02.623.798 I srv  llama_server: model loaded", False),
             ("0.08.151.646 I slot      release: id  3 | task 0 | stop processing: n_tokens = 3, truncated = 0", False),
             ("0.02.193.091 W load: control-looking token:    212 '</s>' was not control-type", False),
             ("error: invalid argument: --bogus", False)]
    assert [(line, trace(line)) for line, _ in lines] == lines


def test_shipped_trace_formats_are_the_pinned_trees():
    """arcsplit/data/llama_trace.txt is read from the pinned llama.cpp tree: regenerate it when the pin moves."""
    from arcsplit.llama.logs import TRACE_FILE, trace_formats
    from arcsplit.llama.source import llama_root

    src = llama_root() / "src"
    if not (src / "tools" / "server").is_dir():
        pytest.skip("the pinned llama.cpp tree is not extracted here (arcsplit llama build extracts it)")
    assert TRACE_FILE.read_text(encoding="utf-8").splitlines() == trace_formats(src)


@pytest.mark.slow  # two real llama-servers
def test_filtered_lv4_output_is_what_the_default_verbosity_prints(llama_bins, demo_model, tmp_path):
    """The same load and request at llama-server's default verbosity and at -lv 4: the filter leaves the first."""
    import re
    import subprocess
    import time

    import httpx

    from arcsplit.llama.logs import trace_filter
    from arcsplit.proc.ports import free_port

    def run(*extra: str) -> list[str]:
        port = free_port()
        log = tmp_path / f"server{len(extra)}.log"
        with log.open("w") as fh:
            proc = subprocess.Popen([str(llama_bins.server), "-m", str(demo_model), "-c", "512", "-np", "1", "-t", "1",
                                     "--port", str(port), *extra], stdout=fh, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60)
            time.sleep(1.5)
        finally:
            proc.terminate()
            proc.wait(30)
        return log.read_text().splitlines()

    def shape(line: str) -> str:  # without the clock and the figures that differ between two runs
        return re.sub(r"[\d.]+", "N", re.sub(r"^\d+\.\d+\.\d+\.\d+ ", "", line))

    default, verbose = run(), run("-lv", "4")
    trace = trace_filter()
    kept = [line for line in verbose if not trace(line)]
    assert len(verbose) > 3 * len(kept)
    assert not [line for line in default if trace_filter()(line)]
    extra = {shape(line) for line in kept} - {shape(line) for line in default}
    # two lines print their own variable text at TRACE (common_params_print_info's verbosity and system_info)
    assert all("verbosity = N" in s or "system_info:" in s for s in extra), extra
