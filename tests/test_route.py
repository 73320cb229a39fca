"""Done-when of the Route: `arcsplit plan --mode M --json` shows exactly the argv and environment that
`serve --mode M` starts, for every mode x backend. GPU backends: serve's own preparation and supervisor with an
in-memory launcher (no Intel/NVIDIA card here) and a described rig; CPU: the real `arcsplit serve` process and
the command lines of the processes it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from arcsplit.cli import main as cli_main
from arcsplit.llama.locate import LlamaBinaries
from arcsplit.rig import Card, Rig
from arcsplit.decide import prepare as prepare_mod
from arcsplit.run.supervisor import Supervisor, Timeouts

from _fake_launcher import FakeLauncher

G = 1 << 30
# sycl + auto is left out: on 2+ Intel cards serve probes one multi-device context first, plan (offline) does not.
GPU_MODES = {"sycl": ("single", "multi", "multi+workaround", "hybrid", "rpc"),
             "cuda": ("auto", "single", "multi", "hybrid", "rpc"),
             "vulkan": ("auto", "single", "multi", "hybrid", "rpc")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def described_rig(tmp_path, monkeypatch):
    """serve's preparation on cards that are not here: the rig and binaries it would have discovered."""
    for key in ("STATE", "CACHE", "RUNTIME"):
        monkeypatch.setenv(f"ARCSPLIT_{key}_DIR", str(tmp_path / key.lower()))
    bins = LlamaBinaries(server=Path("/opt/llama/bin/llama-server"), rpc_server=Path("/opt/llama/bin/ggml-rpc-server"),
                         cli=None, bench=None, fit_params=None, found_by="managed")  # a managed build: all flags
    monkeypatch.setattr(prepare_mod, "find_llama", lambda *a, **kw: bins)

    def discover(backend: str, gpus: Any, binaries: Any = None, cpu_memory_mib: Any = None) -> Rig:
        return Rig(tuple(Card(backend, i, f"{backend} card {i}", 16 * G, 15 * G) for i in gpus))

    monkeypatch.setattr(prepare_mod, "discover_rig", discover)


def _plan_json(capsys, argv: list[str]) -> dict[str, Any]:
    capsys.readouterr()
    cut = argv.index("--") if "--" in argv else len(argv)
    assert cli_main(["plan", *argv[:cut], "--json", *argv[cut:]]) == 0
    return json.loads(capsys.readouterr().out)


def _served_specs(argv: list[str]) -> tuple[Any, list[Any]]:
    """What `serve` hands its launcher: its own flag parsing and preparation, then the supervisor."""
    from arcsplit.cli import build_parser
    from arcsplit.cli.serve_run import request_from_args

    prepared = prepare_mod.prepare(request_from_args(build_parser().parse_args(["serve", *argv])))
    fake = FakeLauncher()

    async def main() -> None:
        async with Supervisor(prepared.config, launcher=fake, sweep_leftovers=False,
                              timeouts=Timeouts(health_interval=60)):
            pass

    anyio.run(main)
    return prepared, fake.specs


@pytest.mark.parametrize("backend,mode", [(b, m) for b, modes in GPU_MODES.items() for m in modes])
def test_plan_shows_exactly_what_serve_starts_on_gpu_backends(backend, mode, demo_model, described_rig, capsys):
    gpus = "0" if mode == "single" else "2,0,1" if mode in ("hybrid", "rpc") else "1,0"
    n_rpc = {"hybrid": 2, "rpc": 3}.get(mode, 0)
    ports = [_free_port() for _ in range(n_rpc)]
    argv = [str(demo_model), "--backend", backend, "--gpus", gpus, "--ctx", "2048", "--port", str(_free_port())]
    argv += ["--mode", mode] if mode != "auto" else []
    argv += ["--rpc-ports", ",".join(map(str, ports))] if ports else []
    argv += ["--", "--temp", "0"]
    planned = _plan_json(capsys, argv)
    prepared, specs = _served_specs(argv)
    assert planned["mode"] == prepared.config.mode != "auto"
    assert [(p["name"], p["argv"], p["env"]) for p in planned["processes"]] == \
        [(s.name, list(s.argv), s.env_dict) for s in specs]
    assert [c["holder"] for c in planned["route"]["cards"]] == [
        c.holder for c in prepared.config.route.cards]
    server = planned["processes"][-1]["argv"]
    assert server[-2:] == ["--temp", "0"] and server[:2] == ["/opt/llama/bin/llama-server", "-m"]


def test_plan_text_prints_each_process_argv(demo_model, described_rig, capsys):
    capsys.readouterr()
    assert cli_main(["plan", str(demo_model), "--backend", "cuda", "--gpus", "3,1", "--mode", "hybrid",
                     "--rpc-ports", "50321", "--port", "8321"]) == 0
    out = capsys.readouterr().out
    assert "rpc0: ARCSPLIT_RPC_SHM=1 CUDA_VISIBLE_DEVICES=1 /opt/llama/bin/ggml-rpc-server -H 127.0.0.1 -p 50321" in out
    assert ("server: ARCSPLIT_RPC_SHM=1 CUDA_VISIBLE_DEVICES=3 LLAMA_SERVER_ROUTER_PORT=8321 "
            "/opt/llama/bin/llama-server") in out
    assert "--device CUDA0,RPC0" in out and "-ub 256" in out


def test_plan_auto_and_the_api_default_to_serves_mode(demo_model, described_rig, capsys):
    """No --mode: the mode serve --mode auto picks (multi on CUDA); arcsplit.plan() agrees (it used to say rpc)."""
    import arcsplit

    planned = _plan_json(capsys, [str(demo_model), "--backend", "cuda", "--gpus", "0,1", "--ctx", "2048"])
    assert planned["mode"] == "multi" and planned["cards"][0]["device"] == "CUDA0"
    api = arcsplit.plan(demo_model, [0, 1], backend="cuda", ctx=2048)
    assert [c.device for c in api.cards] == ["CUDA0", "CUDA1"] and api.options.n_ubatch == 512
    assert planned["tensor_split"] == list(api.tensor_split)


def test_np_and_parallel_are_one_flag_on_plan_and_serve(demo_model, described_rig, capsys):
    from arcsplit.cli import build_parser

    for cmd in ("plan", "serve"):
        assert build_parser().parse_args([cmd, "m.gguf", "--np", "3"]).parallel == 3
        assert build_parser().parse_args([cmd, "m.gguf", "--parallel", "3"]).parallel == 3
    planned = _plan_json(capsys, [str(demo_model), "--backend", "cuda", "--gpus", "0,1", "--np", "2", "--ctx", "2048"])
    server = planned["processes"][-1]["argv"]
    assert server[server.index("-np") + 1] == "2"


# -- the CPU backend, for real ----------------------------------------------------------------------------------


def _serving(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("mode,gpus", [("rpc", "0,1"), ("hybrid", "0,1"), ("single", "0"), ("auto", "0,1")])
def test_plan_shows_exactly_what_the_real_serve_starts_on_cpu(mode, gpus, demo_model, llama_bins, tmp_path, capsys):
    env = {**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_CACHE_DIR": str(tmp_path / "cache"),
           "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt"), "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    n_rpc = {"rpc": 2, "hybrid": 1, "auto": 2}.get(mode, 0)
    port = _free_port()
    argv = [str(demo_model), "--backend", "cpu", "--gpus", gpus, "--cpu-memory", "1024", "--ctx", "1024",
            "--threads", "1", "--port", str(port)]
    argv += ["--mode", mode] if mode != "auto" else []
    argv += ["--rpc-ports", ",".join(str(_free_port()) for _ in range(n_rpc))] if n_rpc else []
    # Arguments after -- are part of the argv that plan shows and serve starts.
    plan = subprocess.run([sys.executable, "-m", "arcsplit", "plan", *argv, "--json", "--", "--no-repack"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    serve = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", *argv, "--no-bus", "--", "--no-repack"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _serving(port) and time.monotonic() < deadline and serve.poll() is None:
            time.sleep(0.2)
        assert _serving(port), serve.stderr.read() if serve.poll() is not None else "serve never got ready"
        (state_file,) = (tmp_path / "state").glob("runs/*/state.json")
        state = json.loads(state_file.read_text())
        started = {p["name"]: psutil.Process(p["pid"]).cmdline() for p in state["processes"]}
        assert started == {p["name"]: p["argv"] for p in planned["processes"]}
        for p in planned["processes"]:
            pid = next(s["pid"] for s in state["processes"] if s["name"] == p["name"])
            environ = psutil.Process(pid).environ()
            assert {k: environ.get(k) for k in p["env"]} == p["env"], p["name"]
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)


def test_telemetry_and_the_dashboard_read_each_cards_holder_from_status():
    """No string surgery on device names: the holder comes from status["route"] (here llama-server holds the
    CPU-backend hybrid's first card, which is named CPU, not RPCk)."""
    import asyncio

    from arcsplit.route import Route
    from arcsplit.telemetry import Telemetry
    from arcsplit.tui.state import DashState
    from arcsplit.tui.widgets import process_rows

    status = {"state": "starting", "route": Route.build("hybrid", "cpu", [0, 1]).to_dict(),
              "processes": {"rpc0": {"pid": None, "state": "new", "role": "rpc"},
                            "server": {"pid": os.getpid(), "state": "starting", "role": "server",
                                       "argv": ["llama-server", "-t", "1"]}},
              "plan": {"cards": [{"device": "CPU", "backend": "cpu", "index": 0, "free": G},
                                 {"device": "RPC0", "backend": "cpu", "index": 1, "free": G}]}}
    data = asyncio.run(Telemetry(nvml=False).sample(status))
    assert [c["holder"] for c in data["cards"]] == ["server", "rpc0"]
    assert data["cards"][0]["source"] is not None  # sampled from llama-server's own process
    state = DashState()
    state.status = status
    assert {row[0]: row[2] for row in process_rows(state)} == {"rpc0": "1", "server": "0"}


def test_members_on_other_hosts_show_their_host_and_are_not_sampled_here():
    """A remote member's pid is a pid on that host: telemetry must not read this machine's process of that number
    (here: our own pid stands in for it), and the dashboard says where each member runs."""
    import asyncio

    from arcsplit.route import Route
    from arcsplit.telemetry import Telemetry
    from arcsplit.tui.state import DashState
    from arcsplit.tui.widgets import process_rows

    me = os.getpid()
    status = {"state": "ready", "route": Route.build("hybrid", "cpu", [0, 0], ["", "b"]).to_dict(),
              "processes": {"rpc0": {"pid": me, "state": "ready", "role": "rpc", "host": "b"},
                            "rpc0-link": {"pid": me, "state": "ready", "role": "link", "host": "b"},
                            "server": {"pid": me, "state": "ready", "role": "server", "host": ""}},
              "plan": {"cards": [{"device": "CPU", "backend": "cpu", "index": 0, "free": G},
                                 {"device": "RPC0", "backend": "cpu", "index": 0, "free": G}]}}
    data = asyncio.run(Telemetry(nvml=False).sample(status))
    assert set(data["processes"]) == {"rpc0-link", "server"}  # the link is an ssh process here
    state = DashState()
    state.status = status
    assert {row[0]: row[1] for row in process_rows(state)} == {"rpc0": "rpc@b", "rpc0-link": "link@b",
                                                               "server": "server"}
