"""Gated sets' device-side path, run where no GPU is.

An rpc-server takes that path only where its one device can wait on a host word (patch 0009 offers the wait on
CUDA): it queues the wait and the input's copy at GATE, launches the graph behind them on another thread at
GRAPH_RECOMPUTE (or GRAPH_COMPUTE, once built), and stores the word when the data comes. Here the managed build's
own ggml-rpc-server (and, for hybrid, llama-server) runs with a test device preloaded (tests/native/queue_device.cpp, "QUEUE"): an in-order queue on a host thread in front of the
CPU backend, with the stream semantics that path relies on. What it checks is the rpc-server's logic (slots, the
word, the launch thread, the rules, releasing a wait on a closed connection) and the tokens; not CUDA's wait itself,
nor any speed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from arcsplit import serve as serve_group
from arcsplit.llama.build import cache_trees
from arcsplit.proc.ports import free_port

from _procs import wait_healthy
from test_patches import (GATE, GET_TENSOR, GRAPH_RECOMPUTE, SET_TENSOR, SET_TENSOR_GATED, RawRpc,
                          gated_sets_hold_their_rules, rpc_server_on, sum_graph)

SOURCE = Path(__file__).parent / "native" / "queue_device.cpp"
WAITED = "QUEUE: waited for the host word"
PROMPT = "The keeper of the lighthouse climbed the stairs and"


@pytest.fixture(scope="module")
def queue_device(llama_bins, tmp_path_factory) -> Path:
    """The test device, compiled against the managed build's libraries and the tree it was built from."""
    tree = next((t for t in cache_trees(llama_bins.bin_dir) if (t / "ggml/src/ggml-backend-impl.h").is_file()), None)
    if tree is None:
        pytest.skip(f"no llama.cpp source tree beside {llama_bins.bin_dir} (a build outside arcsplit's cache)")
    cache = llama_bins.bin_dir.parent / "CMakeCache.txt"  # the compiler the build itself used
    found = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", cache.read_text(), re.M) if cache.is_file() else None
    cxx = found.group(1).strip() if found else shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler recorded by the build or on PATH")
    out = tmp_path_factory.mktemp("queue") / "libqueue_device.so"
    bins = llama_bins.bin_dir
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{tree}/ggml/include", f"-I{tree}/ggml/src",
                        str(SOURCE), f"-L{bins}", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{bins}",
                        "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def greedy(url: str) -> list[int]:
    """12 greedy tokens of PROMPT from the llama-server at ``url``."""
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                              "ignore_eos": True, "return_tokens": True}, timeout=300)
    r.raise_for_status()
    return r.json()["tokens"]


def greedy_on_two_queue_devices(model: Path, llama_bins, mode: str) -> tuple[list[int], list[str]]:
    """Serve ``model`` on two cards through arcsplit (their rpc-servers hold QUEUE devices where LD_PRELOAD names
    the test device), take one greedy completion, stop: the tokens and every rpc-server's log."""
    with serve_group(str(model), gpus=[0, 1], backend="cpu", mode=mode, ctx=1024, parallel=1, threads=1,
                     port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir)) as server:
        tokens = greedy(server.url)
        run_dir = Path(server.status()["run_dir"])
    return tokens, [p.read_text(errors="replace") for p in sorted(run_dir.glob("rpc*.log"))]


@pytest.mark.slow
@pytest.mark.parametrize("blocking,relay_kib", [("0", ""), ("1", "1")])
def test_gated_sets_on_a_device_that_waits_give_the_same_tokens(llama_bins, demo_model, queue_device, monkeypatch,
                                                                   blocking, relay_kib):
    """All-RPC on two QUEUE devices with ARCSPLIT_RPC_GATE=1: the second rpc-server queues each decoded token's
    input behind a wait on the host word ("device wait: yes"), its graph is launched before the data has come (the
    device's queue reached the wait first: "waited for the host word"), and the greedy tokens equal those of the
    same group with gated sets off and of plain CPU cards. ``blocking``: the device's graph launch returns only when
    the graph has run (as ggml-cuda's does mid-graph for MUL_MAT_ID), which would deadlock an rpc-server that
    launched it on the thread that takes the data in. ``relay_kib`` 1: the demo model's 2.5 KiB activation is
    relayed in three chunks, so a graph has three gates (three slots; the first graph's later two, arriving while
    the device waits, take the host path that once)."""
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    if relay_kib:
        monkeypatch.setenv("ARCSPLIT_RPC_RELAY_KIB", relay_kib)
    monkeypatch.setenv("ARCSPLIT_RPC_GATE", "0")
    plain, _ = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    monkeypatch.setenv("LD_PRELOAD", str(queue_device))
    monkeypatch.setenv("ARCSPLIT_TEST_QUEUE_BLOCKING", blocking)
    off, off_logs = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    monkeypatch.setenv("ARCSPLIT_RPC_GATE", "1")
    monkeypatch.setenv("ARCSPLIT_TEST_QUEUE_LOG_LAUNCH", "1")
    on, (first, second) = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    assert all("QUEUE: host-thread queue" in log for log in off_logs + [first, second]), "the test device was not used"
    assert len(plain) == 12 and on == off == plain
    assert "device wait: yes" not in "".join(off_logs)
    gates_per_token = 3 if relay_kib else 1
    assert second.count("device wait: yes") >= 10 * gates_per_token, second[-3000:]
    if relay_kib:
        assert second.count("device wait: no") == 2, second[-3000:]
    assert WAITED in second, "no graph was queued before its data came"
    # gated graphs are launched by one thread kept for the connection, not a thread per token: the second server's
    # launches come from at most two threads (that one, and the command thread for a graph computed when its data
    # came), over at least the 11 decoded tokens after the first
    launchers = re.findall(r"QUEUE: graph launched on thread (\d+)", second)
    assert len(launchers) >= 11 and len(set(launchers)) <= 2, launchers
    assert "before the data of a gated set" not in second and "still open after" not in second
    # the prompt's graph is new (GRAPH_COMPUTE): it too is built and launched before its data comes
    events = re.findall(r"^\[(gate|graph_compute|graph_recompute|set_tensor_gated)\]", second, re.M)
    assert any(events[i - 1] == "gate" and events[i + 1] == "set_tensor_gated"
               for i in range(1, len(events) - 1) if events[i] == "graph_compute"), events


@pytest.mark.slow
def test_graph_inputs_are_queued_on_a_device_and_give_the_same_tokens(llama_bins, demo_model, queue_device,
                                                                       monkeypatch):
    """All-RPC on two QUEUE devices, gated sets off: each rpc-server queues a decoded token's inputs on its device
    ("queued" sets) instead of waiting for each copy, and the greedy tokens equal plain CPU cards' and the same group's
    with ARCSPLIT_RPC_QUEUED_SETS=0 (no set queued). The device reads each queued set's source 300 us late, so an
    rpc-server that reused the memory a set's data waits in before its device had copied it would feed the graphs
    other bytes."""
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    monkeypatch.setenv("ARCSPLIT_RPC_GATE", "0")
    plain, _ = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    monkeypatch.setenv("LD_PRELOAD", str(queue_device))
    monkeypatch.setenv("ARCSPLIT_TEST_QUEUE_LATE_COPY_US", "300")
    queued, logs = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    monkeypatch.setenv("ARCSPLIT_RPC_QUEUED_SETS", "0")
    waited, waited_logs = greedy_on_two_queue_devices(demo_model, llama_bins, "rpc")
    assert all("QUEUE: host-thread queue" in log for log in logs + waited_logs), "the test device was not used"
    assert len(plain) == 12 and queued == waited == plain
    # every decoded token's inputs on the first server (token, positions, mask, cache indices), and its activation
    # on the second (which holds only the output layer of the demo model): the 11 tokens after the first at least
    counts = [len(re.findall(r"^\[set_tensor\] .*, queued$", log, re.M)) for log in logs]
    assert counts[0] >= 3 * 11 and counts[1] >= 11, counts
    assert not any(", queued" in log for log in waited_logs)


@pytest.mark.slow  # a real rpc-server of the managed build
def test_a_device_waiting_for_gated_data_is_released_when_its_client_goes(llama_bins, queue_device, tmp_path):
    """Over a raw socket to an rpc-server holding a QUEUE device: gated data is copied from its slot after the word
    is stored (read back, it is the data). A client that breaks an open gate, or goes away before its data, is closed
    alone, and the wait it left queued on the device is released, so the server serves the next client at once
    (the device would otherwise wait until the test device gives up after 60 s)."""
    log = tmp_path / "rpc.log"
    with rpc_server_on(llama_bins, log, LD_PRELOAD=str(queue_device), GGML_RPC_DEBUG="1") as port:
        gated_sets_hold_their_rules(port, log, device_waits=True)
        assert "still open after" not in log.read_text()


def f32s(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.slow  # a real rpc-server of the managed build
@pytest.mark.parametrize("blocking", ["0", "1"])
def test_a_gated_graph_runs_on_its_data_and_a_launch_left_waiting_is_released(llama_bins, queue_device, tmp_path,
                                                                              blocking):
    """A one-node graph (b = a + a) over a raw socket to an rpc-server holding a QUEUE device: computed once, then
    repeated as gated sets repeat it (GATE on a, GRAPH_RECOMPUTE before a's data, then the data), it reads the
    data that came after it was launched: b is twice the new a. A client that goes away between the launch and the
    data is closed with its wait released, and the next client is served at once, also when the device's launch
    returns only once the graph has run (``blocking``: the launching thread then waits on the word until the
    server releases it, so a server that joined that thread first would hang)."""
    log = tmp_path / "rpc.log"
    n = 256
    first, second = [float(i) for i in range(n)], [float(3 * i + 1) for i in range(n)]
    env = {"LD_PRELOAD": str(queue_device), "GGML_RPC_DEBUG": "1", "ARCSPLIT_TEST_QUEUE_BLOCKING": blocking}

    def graph(c: RawRpc) -> tuple[bytes, bytes]:
        a = c.f32_tensor(n)
        c.call(SET_TENSOR, a + b"\0" + struct.pack("<Q", 0) + f32s(first))
        return a, sum_graph(c, a, n)

    with rpc_server_on(llama_bins, log, **env) as port:
        c = RawRpc(port)
        a, b = graph(c)
        assert c.call(GET_TENSOR, b + struct.pack("<QQ", 0, 4 * n), 4 * n) == f32s([2 * v for v in first])
        c.call(GATE, a + struct.pack("<QQ", 0, 4 * n))
        c.call(GRAPH_RECOMPUTE, struct.pack("<I", 0))
        c.call(SET_TENSOR_GATED, a + b"\0" + struct.pack("<Q", 0) + f32s(second))
        assert c.call(GET_TENSOR, b + struct.pack("<QQ", 0, 4 * n), 4 * n) == f32s([2 * v for v in second])
        c.close()
        text = log.read_text()
        assert text.count("device wait: yes") == 1 and "computed when its gated sets' data comes" not in text

        c = RawRpc(port)
        a, b = graph(c)
        c.call(GATE, a + struct.pack("<QQ", 0, 4 * n))
        c.call(GRAPH_RECOMPUTE, struct.pack("<I", 0))
        c.close()  # gone before the data
        assert RawRpc(port).padding & 1, "the rpc-server did not serve the next client"
        text = log.read_text()
        assert text.count("device wait: yes") == 2 and "still open after" not in text


@contextlib.contextmanager
def llama_server_on(llama_bins, args: list[str], log: Path, **env: str) -> Iterator[str]:
    """The managed build's llama-server with ``args`` on a free loopback port, its output in ``log``; its URL, once
    /health answers."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(llama_bins.server), "--host", "127.0.0.1", "--port", str(port), "-c", "1024",
                                 "-np", "1", "-t", "1", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)



def even_split(llama_bins, model: Path, queue_device: Path, tmp_path: Path, route: str, gate: str,
               **env: str) -> tuple[list[int], list[str]]:
    """llama-server started directly on an even split (-ts 1,1: attention layers on both sides), every card a QUEUE
    device, gated sets ``gate`` ("1" on, "0" off), ``env`` for llama-server: the greedy tokens and every rpc-server's
    log. ``hybrid``: llama-server's own card is one too, taken for a CUDA card by its RPC client
    (ARCSPLIT_TEST_QUEUE_REG_NAME=CUDA; patch 0001 reads an activation asynchronously only off CUDA and SYCL cards).
    ``rpc``: two rpc-servers, the activation relayed between them (0007)."""
    queue = {"LD_PRELOAD": str(queue_device), "GGML_RPC_DEBUG": "1"}
    logs = [tmp_path / f"rpc{i}-{gate}.log" for i in range(2 if route == "rpc" else 1)]
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(rpc_server_on(llama_bins, log, **queue)) for log in logs]
        devices = [f"RPC{i}" for i in range(len(ports))]
        if route == "hybrid":
            devices.insert(0, "QUEUE")
        url = stack.enter_context(llama_server_on(
            llama_bins, ["-m", str(model), "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports),
                         "--device", ",".join(devices), "-ngl", "99", "-ts", "1,1"],
            tmp_path / f"server-{gate}.log", LD_PRELOAD=str(queue_device), ARCSPLIT_TEST_QUEUE_PROCS="llama-server",
            ARCSPLIT_TEST_QUEUE_REG_NAME="CUDA", ARCSPLIT_RPC_GATE=gate, **env))
        return greedy(url), [log.read_text(errors="replace") for log in logs]


def alone(llama_bins, model: Path, tmp_path: Path) -> list[int]:
    """The greedy tokens of llama-server alone on its CPU."""
    with llama_server_on(llama_bins, ["-m", str(model), "-ngl", "0"], tmp_path / "alone.log") as url:
        return greedy(url)


def windows(log: str) -> list[list[str]]:
    """Every gate window of an rpc-server's log: the events from a GATE to the data of the gate it opened."""
    events = re.findall(r"^\[(gate|set_tensor|graph_compute|graph_recompute|set_tensor_gated)\]", log, re.M)
    return [events[i:events.index("set_tensor_gated", i)] for i, e in enumerate(events) if e == "gate"]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["hybrid", "rpc"])
def test_gated_sets_on_an_even_split_with_attention_on_both_sides(llama_bins, demo_model, queue_device, tmp_path,
                                                                 route):
    """An even split (``even_split``; arcsplit's CPU plan for the demo model leaves only the output layer on the
    last card). With ARCSPLIT_RPC_GATE=1 the last rpc-server's device waits on the word every decoded token, its graph
    queued ahead of the data, while the graph's other inputs (positions, masks, cache indices: plain SET_TENSORs,
    below ARCSPLIT_RPC_GATE_HOST_KIB) pass the held data. The greedy tokens equal gated sets off and llama-server
    alone on its CPU."""
    plain = alone(llama_bins, demo_model, tmp_path)
    on, on_logs = even_split(llama_bins, demo_model, queue_device, tmp_path, route, "1")
    off, off_logs = even_split(llama_bins, demo_model, queue_device, tmp_path, route, "0")
    on_log, off_log = on_logs[-1], off_logs[-1]
    assert len(plain) == 12 and on == off == plain
    assert on_log.count("device wait: yes") >= 10 and WAITED in on_log, on_log[-3000:]
    assert "device wait" not in off_log and "still open after" not in on_log
    # all-RPC: between a gate and its graph come the graph's other inputs, passing the held data (in hybrid, patch
    # 0004 sends them before the activation's gate)
    passed = [w for w in windows(on_log) if "set_tensor" in w and w[-1] in ("graph_compute", "graph_recompute")]
    if route == "rpc":
        assert len(passed) >= 10, windows(on_log)[:20]
    else:
        assert not passed and on_log.count("[set_tensor]") >= 10, on_log[-3000:]


@pytest.mark.slow
def test_graph_inputs_from_host_memory_go_gated_from_their_size_up(llama_bins, demo_model, queue_device, tmp_path):
    """ARCSPLIT_RPC_GATE_HOST_KIB=0 gates every graph input llama-server sets from host memory (by default only those
    of 256 KiB and more: a prompt's embeddings on all-RPC's first server). All-RPC on an even split: the first
    rpc-server, whose inputs all come from llama-server's host memory, now queues them behind the word too, and its
    graph goes ahead of their data on every token (the data received into the slots the device copies from). Tokens
    equal llama-server alone."""
    plain = alone(llama_bins, demo_model, tmp_path)
    on, (first, last) = even_split(llama_bins, demo_model, queue_device, tmp_path, "rpc", "1",
                                   ARCSPLIT_RPC_GATE_HOST_KIB="0")
    assert len(plain) == 12 and on == plain
    for log in (first, last):
        assert log.count("device wait: yes") >= 20 and "still open after" not in log, log[-3000:]
        assert "before the data of a gated set" not in log
    ahead = [w for w in windows(first) if w[-1] in ("graph_compute", "graph_recompute")]
    assert len(ahead) >= 10 and WAITED in first, windows(first)[:20]
    # every set while serving is a gated set's (the host path logs its set as [set_tensor] right after); the
    # weights' plain SET_TENSORs come before the first graph
    events = re.findall(r"^\[(\w+)\]", first[first.index("[graph_compute]"):], re.M)
    assert all(events[i - 1] == "set_tensor_gated" for i, e in enumerate(events) if e == "set_tensor"), events[:40]
