"""The node agent (`arcsplit node --stdio`) through its pipes, with the real ggml-rpc-server: no ssh here
(tests/test_multihost*.py run it over a real sshd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from arcsplit.errors import BadInput
from arcsplit.node.agent import check_rpc_argv
from arcsplit.proc.ports import free_port
from arcsplit.proc.rundir import since_boot

from _node_client import NodeClient, gone as _gone


class Agent(NodeClient):
    """An agent process (`arcsplit node --stdio`) and its event stream."""

    def __init__(self, state_dir: Path, bin_dir: Path, *extra: str, quick: bool = True) -> None:
        super().__init__([sys.executable, "-m", "arcsplit", "node", "--stdio", "--llama-dir", str(bin_dir), *extra],
                         env={**os.environ, "ARCSPLIT_STATE_DIR": str(state_dir),
                              "ARCSPLIT_NODE_QUICK": "1" if quick else "0"})

    def hello(self, run: str) -> dict[str, Any]:
        self.send(op="hello", run=run, proto=1)
        return self.wait("hello")

    def start_rpc(self, name: str = "rpc0", host: str = "127.0.0.1", port: int | None = None,
                  argv0: str = "ggml-rpc-server") -> dict[str, Any]:
        if port is None:
            self.send(op="ports", n=1, bind="127.0.0.1")
            port = self.wait("ports")["ports"][0]
        self.send(op="start", spec={"name": name, "argv": [argv0, "-H", host, "-p", str(port), "-t", "1"],
                                    "env": {}, "host": host, "port": port, "cards": [0], "devices": ["RPC0"]})
        return self.wait("started", name)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def agents(tmp_path, llama_bins):
    made: list[Agent] = []

    def make(*extra: str, quick: bool = True) -> Agent:
        a = Agent(tmp_path / "state", llama_bins.bin_dir, *extra, quick=quick)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


# -- pure: what the agent refuses ---------------------------------------------------------------------------

RPC = "/opt/llama/bin/ggml-rpc-server"


def test_argv_check_resolves_the_bare_name_and_keeps_loopback():
    argv, host, port = check_rpc_argv(["ggml-rpc-server", "-H", "127.0.0.1", "-p", "5000", "-t", "2", "-c"], RPC, ())
    assert argv[0] == RPC and (host, port) == ("127.0.0.1", 5000)
    assert check_rpc_argv([RPC, "-p", "5001"], RPC, ())[1:] == ("127.0.0.1", 5001)  # rpc-server's default bind
    assert check_rpc_argv([RPC, "-H", "10.77.0.2", "-p", "5001"], RPC, ("10.77.0.2",))[1] == "10.77.0.2"


@pytest.mark.parametrize("argv, allow, words", [
    (["/bin/sh", "-c", "id"], (), "not this host's rpc-server"),
    (["/tmp/x/ggml-rpc-server", "-p", "1"], (), "not this host's rpc-server"),
    ([RPC, "-H", "0.0.0.0", "-p", "5000"], (), "binding 0.0.0.0"),
    ([RPC, "-H", "10.77.0.2", "-p", "5000"], (), "--allow-bind"),
    ([RPC, "-H", "10.77.0.3", "-p", "5000"], ("10.77.0.2",), "binding 10.77.0.3"),
    ([RPC, "-p", "5000", "--log-file", "/etc/x"], (), "'--log-file' is not an rpc-server option"),
    ([RPC, "-H", "127.0.0.1"], (), "needs -p PORT"),
    ([RPC, "-p"], (), "-p needs a value"),
])
def test_argv_check_refuses(argv, allow, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_rpc_argv(argv, RPC, allow)


def test_argv_check_without_a_build_names_the_fix():
    with pytest.raises(BadInput, match="arcsplit llama build"):
        check_rpc_argv(["ggml-rpc-server", "-p", "1"], None, ())


# -- the agent for real ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("quick", [True, False], ids=["first-phase", "imports-first"])
def test_the_hello_says_how_long_the_agent_took_to_start_from_its_process_creation(tmp_path, llama_bins, quick):
    """Over SSH the agent's process is the login shell sshd forked, so its age at the first answer includes the
    shell's rc: a wrapper that sleeps 1 s before exec'ing the agent (a slow ~/.bashrc) shows up in ``started_s``."""
    ages = {}
    for rc in (0.0, 1.0):
        argv = [sys.executable, "-m", "arcsplit", "node", "--stdio", "--llama-dir", str(llama_bins.bin_dir)]
        env = {**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / f"s{rc}"), "ARCSPLIT_NODE_QUICK": "1" if quick else "0"}
        a = NodeClient(["sh", "-c", f'sleep {rc}; exec "$@"', "sh", *argv], env=env)
        try:
            a.send(op="ping")
            a.wait("pong")
            a.send(op="hello", run="run-age", proto=1)
            ages[rc] = a.wait("hello")["started_s"]
        finally:
            a.proc.kill()
            a.proc.wait(10)
    assert 0 < ages[0.0] < 5 and ages[1.0] >= 1.0 and ages[1.0] - ages[0.0] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("quick", [True, False], ids=["first-phase", "imports-first"])
def test_hello_reports_the_build_and_rpc_server_gets_ready_then_dies_with_stdin(agents, llama_bins, quick):
    """The same answers whether the first ops are handled before the imports (the default) or after them
    (ARCSPLIT_NODE_QUICK=0, the fallback and bench/node_start.py's comparison)."""
    a = agents(quick=quick)
    hello = a.hello("run-a")
    assert hello["proto"] == 1 and hello["pid"] == a.proc.pid
    assert Path(hello["llama"]["rpc_bin"]).resolve() == llama_bins.rpc_server.resolve()
    assert hello["llama"]["commit"] and hello["devices"] and hello["devices"][0]["backend"] == "cpu"
    started = a.start_rpc()
    a.wait("ready", "rpc0")
    rpc = psutil.Process(started["pid"])
    assert rpc.cmdline()[0] == str(llama_bins.rpc_server) and rpc.create_time() == pytest.approx(
        started["create_time"], abs=0.05)
    a.send(op="ping")
    a.wait("pong")
    assert a.wait("stats")["cpu"].keys() == {"rpc0"}
    assert a.proc.stdin is not None
    a.proc.stdin.close()  # the ssh session ended
    assert _gone(started["pid"], 5), "the rpc-server outlived the agent's stdin"
    assert a.proc.wait(10) == 0


@pytest.mark.slow
def test_stop_ends_one_rpc_server_and_reports_its_exit(agents):
    a = agents()
    a.hello("run-stop")
    pid = a.start_rpc("rpc1")["pid"]
    a.wait("ready", "rpc1")
    a.send(op="stop", name="rpc1", grace=5)
    assert a.wait("exit", "rpc1")["returncode"] is not None
    assert _gone(pid, 2) and a.proc.poll() is None  # the agent keeps running


@pytest.mark.slow
def test_no_ping_for_the_heartbeat_stops_everything(agents):
    a = agents("--heartbeat", "2")
    a.hello("run-hb")
    pid = a.start_rpc()["pid"]
    a.wait("ready", "rpc0")
    t0 = time.monotonic()
    assert "no ping" in a.wait("error", "", timeout=10)["message"]  # stdin stays open, nothing arrives
    assert _gone(pid, 5) and a.proc.wait(10) == 0
    assert time.monotonic() - t0 < 8


@pytest.mark.slow
def test_refused_argv_starts_nothing(agents, tmp_path):
    a = agents()
    a.hello("run-refuse")
    before = {p.pid for p in psutil.Process(a.proc.pid).children(recursive=True)}
    a.send(op="start", spec={"name": "rpc0", "argv": ["/bin/sh", "-c", "touch " + str(tmp_path / "owned")],
                             "host": "127.0.0.1", "port": 1})
    assert "not this host's rpc-server" in a.wait("error", "rpc0")["message"]
    a.send(op="start", spec={"name": "rpc1", "argv": ["ggml-rpc-server", "-H", "0.0.0.0", "-p", "5999"]})
    assert "binding 0.0.0.0 is not allowed" in a.wait("error", "rpc1")["message"]
    a.send(op="ports", n=1, bind="0.0.0.0")
    assert "not allowed" in a.wait("error", "")["message"]
    a.send(op="ping")
    a.wait("pong")
    assert not any(m["ev"] == "started" for m in a.seen)
    assert {p.pid for p in psutil.Process(a.proc.pid).children(recursive=True)} == before
    assert not (tmp_path / "owned").exists()


@pytest.mark.slow
def test_a_busy_port_there_is_refused_not_reported_ready(agents):
    import socket

    a = agents()
    a.hello("run-busy")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        a.send(op="ports", n=1, bind="127.0.0.1", want=[busy])
        assert f"port {busy} on 127.0.0.1 is already in use" in a.wait("error", "")["message"]
        a.send(op="ports", n=1, bind="127.0.0.1", want=[free_port()])
        assert len(a.wait("ports")["ports"]) == 1
        # a start there: the bind would fail and the ready probe would reach the holder instead
        a.send(op="start", spec={"name": "rpc0", "argv": ["ggml-rpc-server", "-p", str(busy)]})
        assert "already in use" in a.wait("error", "rpc0")["message"]
    assert not any(m["ev"] in ("started", "ready") for m in a.seen)


@pytest.mark.slow
def test_ops_before_hello_and_another_protocol_are_refused(agents):
    a = agents()
    a.send(op="ports", n=1)
    assert "before hello" in a.wait("error")["message"]
    a.send(op="hello", run="r", proto=99)
    assert "protocol 99" in a.wait("error")["message"]
    a.send(op="hello", run="r", proto=1, backend="quantum")
    assert "backend 'quantum' is unknown" in a.wait("error")["message"]
    assert a.hello("r")["llama"]["backend"] == "cpu"  # ARCSPLIT_BACKEND=cpu in the suite


@pytest.mark.slow
def test_a_new_agent_sweeps_what_a_killed_agent_left(agents, tmp_path, llama_bins):
    a = agents()
    a.hello("run-old")
    pid = a.start_rpc()["pid"]
    a.wait("ready", "rpc0")
    state_file = tmp_path / "state" / "nodes" / "run-old" / "state.json"
    state = json.loads(state_file.read_text())
    assert [p["pid"] for p in state["processes"]] == [pid]
    os.kill(a.proc.pid, signal.SIGKILL)
    assert _gone(pid, 5), "the parent-death signal did not take the rpc-server with the agent"

    # A leftover the parent-death signal cannot reach (a process that outlived its agent some other way): a real
    # rpc-server started here, put in the dead agent's real state file in place of the one that died.
    argv = [str(llama_bins.rpc_server), "-H", "127.0.0.1", "-p", str(state["processes"][0]["port"]), "-t", "1"]
    orphan = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        state["processes"][0].update(pid=orphan.pid, pgid=orphan.pid, argv=argv,
                                     create_time=psutil.Process(orphan.pid).create_time(),
                                     since_boot=since_boot(orphan.pid))
        state_file.write_text(json.dumps(state))
        b = agents()
        b.hello("run-new")
        assert orphan.wait(10) is not None
        assert f"pids [{orphan.pid}]" in next(m["line"] for m in b.seen if m["ev"] == "line")
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


@pytest.mark.slow
def test_preferred_ports_are_kept_where_free_and_replaced_where_taken(agents):
    """The supervisor starts its ssh links on guessed ports before the agent answers: a free guess is kept (the
    link is already right), a taken one is replaced by a free port (that link restarts)."""
    import socket

    a = agents()
    a.hello("run-prefer")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy, free = holder.getsockname()[1], free_port()
        a.send(op="ports", n=2, bind="127.0.0.1", prefer=[free, busy])
        got = a.wait("ports")["ports"]
    assert got[0] == free and got[1] not in (busy, free) and 0 < got[1] < 65536


def test_a_seed_file_this_host_lacks_is_dropped_with_the_reason(tmp_path):
    from arcsplit.node.agent import drop_missing_seeds

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ("rpc", "-p", "1", "-c", "--seed-cache", str(gguf), "--seed-cache", str(tmp_path / "gone.gguf"))
    kept, notes = drop_missing_seeds(argv, can_seed=True)
    assert kept == ("rpc", "-p", "1", "-c", "--seed-cache", str(gguf))
    assert len(notes) == 1 and "gone.gguf" in notes[0] and "model_dir" in notes[0]
    kept, notes = drop_missing_seeds(argv, can_seed=False)
    assert kept == ("rpc", "-p", "1", "-c") and len(notes) == 2 and "patch 0006" in notes[0]


def test_a_hosts_model_dir_names_where_it_keeps_the_same_file():
    from arcsplit.rig import Host

    assert Host(name="b", ssh="b").seed_path("/models/x.gguf") == "/models/x.gguf"
    assert Host(name="b", ssh="b", model_dir="/srv/m").seed_path("/home/me/x.gguf") == "/srv/m/x.gguf"
    with pytest.raises(BadInput, match="model_dir"):
        Host(name="b", ssh="b", model_dir="models")


@pytest.mark.slow
def test_the_agent_supervises_what_its_first_phase_started(agents, tmp_path):
    """After the handover the rpc-server started before anyio is a Child of the agent: its output reaches the log,
    a SIGKILL is reported as its exit, and a new one starts under the same name."""
    a = agents()
    a.hello("run-adopt")
    first = a.start_rpc()
    a.wait("ready", "rpc0")
    a.send(op="ping")
    a.wait("pong")
    a.wait("stats")  # the agent itself is running: the handover is done
    os.kill(first["pid"], signal.SIGKILL)
    assert a.wait("exit", "rpc0")["returncode"] == -signal.SIGKILL
    log = (tmp_path / "state" / "nodes" / "run-adopt" / "rpc0.log").read_text()
    assert "start " in log and "exited" in log
    second = a.start_rpc()
    a.wait("ready", "rpc0")
    assert second["pid"] != first["pid"]
    a.send(op="stop", name="rpc0", grace=5)
    a.wait("exit", "rpc0")
    assert _gone(second["pid"], 5)
