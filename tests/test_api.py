"""The Python API and the ZeroMQ bus against a real running instance (real binaries, demo model, CPU cards)."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import anyio
import httpx
import pytest
import zmq

import arcsplit
from arcsplit.errors import BadInput, NotRunning, RunError
from arcsplit.run.bus import TOPIC_PREFIX, list_runs
from arcsplit.proc.ports import free_port, is_free
from _instance import ENV_KEYS, isolated_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory: pytest.TempPathFactory, llama_bins, demo_model) -> Iterator[dict[str, str]]:
    """State, sockets and caches in a temp dir; the env is also what subprocesses (examples, CLI) get."""
    with isolated_env(tmp_path_factory.mktemp("arcsplit-api"), llama_bins.bin_dir):
        yield {k: os.environ[k] for k in ENV_KEYS}


@pytest.fixture(scope="module")
def server(demo_model) -> Iterator[arcsplit.Server]:
    with arcsplit.serve(demo_model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=1024, threads=1,
                        port=free_port(), max_restarts=3) as srv:
        yield srv


def greedy(url: str, n: int = 16) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=120)
    r.raise_for_status()
    return r.json()["tokens"]


def test_server_handle(server):
    assert server.url.startswith("http://127.0.0.1:")
    assert server.mode == "rpc"
    assert sum(server.plan.tensor_split) == server.plan.n_layer + 1
    status = server.status()
    assert status["state"] == "ready"
    assert set(status["processes"]) == {"rpc0", "rpc1", "server"}
    assert all(p["state"] == "ready" for p in status["processes"].values())
    assert len(greedy(server.url)) == 16


def test_instance_is_listed_and_private(server, isolated):
    (info,) = [r for r in list_runs() if r.run_id == server.run_id]
    assert info.url == server.url
    rt = Path(isolated["ARCSPLIT_RUNTIME_DIR"])
    assert stat.S_IMODE(rt.stat().st_mode) == 0o700
    for endpoint in (info.pub, info.ctl):
        path = Path(endpoint.removeprefix("ipc://"))
        assert path.parent == rt and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((Path(info.run_dir) / "bus.json").stat().st_mode) == 0o600


def test_two_subscribers_and_a_control_client(server):
    """Both subscribers see the snapshot, then the restart's group transitions, in order, without gaps."""
    got: dict[int, list[dict]] = {0: [], 1: []}
    ready = threading.Barrier(3)

    def subscribe(k: int) -> None:
        with arcsplit.attach(server.run_id) as client:
            stream = client.events(idle=60)
            got[k].append(next(stream))  # the snapshot
            ready.wait()
            for msg in stream:
                got[k].append(msg)
                if msg["kind"] == "group" and msg["data"].get("state") == "ready":
                    return

    threads = [threading.Thread(target=subscribe, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    ready.wait()
    with arcsplit.attach(server.run_id) as control:
        generation = control.status()["generation"]
        control.restart()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a subscriber never saw the group ready again"
    for k in (0, 1):
        snap, *events = got[k]
        assert snap["kind"] == "snapshot" and snap["data"]["status"]["state"] == "ready"
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs) and seqs[0] > snap["seq"]
        states = [e["data"]["state"] for e in events if e["kind"] == "group"]
        assert states[0] == "stopping" and states[-1] == "ready" and "starting" in states
    assert server.status()["generation"] == generation + 1
    assert len(greedy(server.url)) == 16


def test_the_documented_events_call_ends_after_its_timeout(server):
    """docs/usage.md's `for event in server.events(timeout=5)`: a snapshot, the events of 5 s (telemetry comes
    every 2 s, so the stream is never silent that long), then the loop ends."""
    assert "for event in server.events(timeout=5):" in (ROOT / "docs" / "usage.md").read_text()
    kinds: list[str] = []
    took: list[float] = []

    def documented() -> None:
        t0 = time.monotonic()
        for event in server.events(timeout=5):
            kinds.append(event["kind"])
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=documented, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"server.events(timeout=5) still running after 30 s, having yielded {kinds}"
    assert kinds[0] == "snapshot" and "telemetry" in kinds, kinds
    assert 5.0 <= took[0] < 10.0, took
    quiet = list(server.events(kinds=("group",), idle=1))  # no state change: ends 1 s after the snapshot
    assert [e["kind"] for e in quiet] == ["snapshot"]


def test_late_subscriber_gets_a_correct_snapshot(server):
    with arcsplit.attach(server.run_id) as client:
        status = client.status()
        snap = next(client.events(timeout=10))
    s = snap["data"]["status"]
    assert s["state"] == "ready" and s["generation"] == status["generation"]
    assert {n: p["pid"] for n, p in s["processes"].items()} == {n: p["pid"] for n, p in status["processes"].items()}
    assert s["plan"]["tensor_split"] == list(server.plan.tensor_split)
    assert any("[server]" in line for line in snap["data"]["logs"])


def test_stalled_subscriber_does_not_slow_the_supervisor(server):
    """A SUB that never reads (tiny queue) is dropped past its high-water mark; others lose nothing."""
    info = next(r for r in list_runs() if r.run_id == server.run_id)
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 5)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
    stalled.connect(info.pub)
    try:
        with arcsplit.attach(server.run_id) as client:
            seqs: list[int] = []
            stop = threading.Event()

            def consume() -> None:
                for msg in client.events(kinds=("log",), idle=1, snapshot=False):
                    seqs.append(msg["seq"])
                    if stop.is_set():
                        return

            t = threading.Thread(target=consume)
            t.start()
            time.sleep(0.5)
            start = time.monotonic()
            for _ in range(12):  # each request logs a few dozen lines at -lv 4
                greedy(server.url, n=8)
            elapsed = time.monotonic() - start
            t0 = time.monotonic()
            with arcsplit.attach(server.run_id) as control:
                control.request("ping")
            ping = time.monotonic() - t0
            stop.set()
            t.join(30)
        assert len(seqs) > 100, "the requests should have produced plenty of log events"
        assert ping < 1.0, f"the control socket took {ping:.2f} s to answer"
        assert elapsed < 120
    finally:
        stalled.close(0)
        ctx.term()


def test_async_twin(demo_model):
    async def main() -> tuple[str, int, list[str]]:
        async with arcsplit.aserve(demo_model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=1024,
                                   threads=1, port=free_port(), bus=False) as srv:
            states: list[str] = []

            async def watch() -> None:
                async for ev in srv.events():
                    if ev.kind == "group":
                        states.append(ev.data["state"])

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await anyio.sleep(0)
                await srv.restart()
                with anyio.fail_after(10):  # the watcher sees the last transition a moment after restart()
                    while not states or states[-1] != "ready":
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            async with httpx.AsyncClient(timeout=120) as http:
                r = await http.post(f"{srv.url}/completion", json={"prompt": PROMPT, "n_predict": 4})
            state = srv.status()["state"]
            srv.stop()  # a restart that meets a stop: an ArcsplitError with one line, not a RuntimeError
            with pytest.raises(RunError, match="stopped instead of restarting"):
                await srv.restart()
            return state, r.json()["tokens_predicted"], states

    state, n, states = anyio.run(main)
    assert state == "ready" and n == 4
    assert states[0] == "stopping" and states[-1] == "ready"


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arcsplit", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_cli_ps_and_logs(server, isolated):
    ps = run_cli("ps", "--json", env=isolated)
    assert ps.returncode == 0, ps.stderr
    runs = {r["run"]: r for r in json.loads(ps.stdout)["runs"]}
    assert runs[server.run_id]["state"] == "ready" and runs[server.run_id]["url"] == server.url
    logs = run_cli("logs", server.run_id, "-p", "rpc0", "-n", "5", env=isolated)
    assert logs.returncode == 0 and logs.stdout.strip()


def test_cli_logs_hide_llama_servers_trace_lines_unless_verbose(server, isolated):
    """arcsplit runs llama-server at -lv 4 for its buffer lines; `logs` shows what its default verbosity would
    ("all slots are idle" was 16 of the last 50 lines), `logs --verbose` everything."""
    httpx.post(f"{server.url}/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60).raise_for_status()
    quiet = run_cli("logs", server.run_id, "-p", "server", "-n", "1000", env=isolated)
    loud = run_cli("logs", server.run_id, "-p", "server", "-n", "1000", "--verbose", env=isolated)
    assert quiet.returncode == 0 and loud.returncode == 0, (quiet.stderr, loud.stderr)
    assert "all slots are idle" in loud.stdout and "model buffer size" in loud.stdout
    assert "all slots are idle" not in quiet.stdout and "model buffer size" not in quiet.stdout
    assert "model loaded" in quiet.stdout and "print_timing" in quiet.stdout
    assert len(quiet.stdout.splitlines()) < len(loud.stdout.splitlines()) / 3


def test_attach_errors_are_one_line(server, isolated):
    with pytest.raises(NotRunning):
        arcsplit.attach("no-such-run")
    r = run_cli("stop", "no-such-run", env=isolated)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no-such-run" in r.stderr


@pytest.mark.parametrize("example", ["serve_and_query.py", "async_events.py"])
def test_examples_run(example, isolated, demo_model):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example), str(demo_model)], capture_output=True,
                       text=True, env={**os.environ, **isolated}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "serving http://127.0.0.1:" in r.stdout


def test_example_attach(server, isolated):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "attach_status.py"), server.run_id],
                       capture_output=True, text=True, env={**os.environ, **isolated}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{server.run_id} ready rpc {server.url}" in r.stdout
    assert "event: snapshot group" in r.stdout


def test_load_places_layers_on_rpc_servers_and_matches_the_served_tokens(server, isolated, demo_model):
    """arcsplit.load in a fresh process: same plan, layers on the rpc-servers, same greedy tokens."""
    import importlib.util

    assert importlib.util.find_spec("llama_cpp"), "scripts/test installs llama-cpp-python 0.3.36 (arcsplit[inproc])"
    script = f"""
import json, sys
import arcsplit
llm = arcsplit.load({str(demo_model)!r}, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=1024, threads=1,
                    verbose=True)
toks = llm.tokenize({PROMPT!r}.encode(), add_bos=True)
out = []
for tok in llm.generate(toks, temp=0.0, top_k=1, reset=True):
    out.append(int(tok))
    if len(out) == 16:
        break
print("RESULT " + json.dumps({{"split": list(llm.arcsplit_plan.tensor_split), "endpoints": llm.arcsplit_endpoints,
                              "tokens": out}}), flush=True)
llm.close()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, **isolated}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result["split"] == list(server.plan.tensor_split)
    for k, endpoint in enumerate(result["endpoints"]):
        assert f"using device RPC{k} ({endpoint})" in r.stderr  # RPCk is that rpc-server
    placed = dict(re.findall(r"load_tensors: layer +(\d+) assigned to device (\w+)", r.stderr))
    expected = {str(il): c["device"] for c in server.plan.to_dict()["cards"] for il in range(*c["layers"])}
    assert placed == expected  # every layer, the output layer included, on the card the plan chose
    assert result["tokens"] == greedy(server.url)


def test_a_stop_during_a_generation_ends_llama_server_with_its_own_forced_exit(demo_model):
    """A SIGTERMed llama-server with a request in flight never exits on its own (its HTTP thread waits for the task
    loop that the signal stopped): the stop's second SIGTERM is llama-server's forced exit, where waiting out the grace
    for a SIGKILL took 10 s. The client's stream is cut off either way."""
    opts = dict(gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=1024, threads=1, bus=False, canary=False)
    first = threading.Event()
    ended: list[str] = []

    def generate(url: str) -> None:
        try:
            with httpx.stream("POST", f"{url}/completion", json={"prompt": PROMPT, "n_predict": 900, "stream": True,
                                                                 "ignore_eos": True}, timeout=120) as r:
                for _ in r.iter_lines():
                    first.set()
            ended.append("finished")
        except httpx.HTTPError as exc:
            ended.append(type(exc).__name__)

    with arcsplit.serve(demo_model, port=free_port(), **opts) as srv:
        run_dir = Path(srv.status()["run_dir"])
        t = threading.Thread(target=generate, args=(srv.url,), daemon=True)
        t.start()
        assert first.wait(60), "no token streamed"
        stopping = time.monotonic()
    took = time.monotonic() - stopping
    t.join(30)
    server_log = (run_dir / "server.log").read_text()
    if "a second SIGTERM" in server_log:  # the usual case: the forced exit
        assert "Received second interrupt" in server_log, server_log[-2000:]
        assert server_log.rstrip().endswith("=== exited exit 1"), server_log[-2000:]
    else:  # the task loop got to the first SIGTERM between two tokens (a busy machine): a clean exit, as fast
        assert server_log.rstrip().endswith("=== exited exit 0"), server_log[-2000:]
    assert took < 8.0, took  # never the 10 s grace and a SIGKILL
    assert ended and ended != ["finished"]


def _free_pair_below_ephemeral() -> int:
    """A port P with P and P+1 free, below the kernel's ephemeral range: a port from free_port() is in that range,
    and any outgoing connection of the suite (HTTP clients, probes) may take P+1 before the bus binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 12000), low - 1), 200):
        if is_free("127.0.0.1", port) and is_free("127.0.0.1", port + 1):
            return port
    raise RuntimeError("no two consecutive free ports below the ephemeral range")


def test_tcp_bus_needs_the_private_curve_keys(demo_model):
    """Over TCP the bus is only for whoever can read the 0600 keys file: a client without them gets nothing."""
    port = _free_pair_below_ephemeral()
    with arcsplit.serve(demo_model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=512, threads=1,
                        port=free_port(), bus_tcp=f"tcp://127.0.0.1:{port}") as srv:
        info = next(r for r in list_runs() if r.run_id == srv.run_id)
        assert info.ctl == f"tcp://127.0.0.1:{port + 1}" and info.keys
        assert stat.S_IMODE(Path(info.keys).stat().st_mode) == 0o600
        with arcsplit.attach(srv.run_id) as client:
            assert client.status()["state"] == "ready"
        ctx = zmq.Context()
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(info.ctl)
        plain.send(json.dumps({"v": 1, "id": "x", "cmd": "status"}).encode())
        answered = plain.poll(1500)
        plain.close(0)
        ctx.term()
        assert not answered, "a client without the CURVE keys must not be answered"


def test_a_group_that_cannot_start_raises_its_run_error_and_the_blocks_own_error_comes_out_as_itself(demo_model):
    """The API's errors are what a caller catches (ArcsplitError, or its own), never anyio's ExceptionGroup wrapper:
    an argument this build's llama-server lacks is BadInput before anything starts, one it refuses on its first
    start is BadInput naming llama-server's own line; a KeyError in the block is that KeyError, after the group
    stopped."""
    opts = dict(gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=1024, threads=1, bus=False, max_restarts=0)
    with pytest.raises(BadInput, match="'--no-such-flag' is not an option"):
        with arcsplit.serve(demo_model, port=free_port(), extra_args=["--no-such-flag"], **opts):
            pass
    with pytest.raises(BadInput, match="refused its arguments: .*--timeout"):
        with arcsplit.serve(demo_model, port=free_port(), extra_args=["--timeout", "soon"], **opts):
            pass
    port = free_port()
    with pytest.raises(KeyError, match="mine"):
        with arcsplit.serve(demo_model, port=port, **opts) as srv:
            assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
            run_dir = Path(srv.status()["run_dir"])
            raise KeyError("mine")
    assert is_free("127.0.0.1", port)  # stopped on the way out
    # in order, as stop() does: llama-server exits on its own (no abort for an rpc-server gone under it, no kill
    # after the grace), and every member's last lines reach its log
    server_log = (run_dir / "server.log").read_text()
    assert server_log.rstrip().endswith("=== exited exit 0"), server_log[-2000:]
    assert "crashed" not in server_log
    for rpc in ("rpc0", "rpc1"):
        assert "=== exited" in (run_dir / f"{rpc}.log").read_text()
