"""Log-line parsers. Lines are verbatim: from this CPU build's llama-server -lv 4 output (captured while writing
this file) and from public issues (ggml-org/llama.cpp#22885, #27063; tests/fixtures/runtime/SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

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
