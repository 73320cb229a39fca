"""The standing node agent (`arcsplit node --listen`) and `--attach`, the command ssh runs to reach it: real
processes, the real ggml-rpc-server, llama-server and demo model; no ssh (the supervisor's transport seam runs the
attach command locally, as tests/test_remote_group.py does for `--stdio`)."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from arcsplit.cli import main
from arcsplit.errors import BadInput
from arcsplit.hosts import node_argv
from arcsplit.node.standing import socket_path
from arcsplit.rig import Host, dump_layout, load_layout

from _node_client import NodeClient, gone as _gone
from _procs import wait_until

LAYOUT = """
name = "standing"
[[hosts]]
name = "b"
ssh = "me@b"
{agent}
[[cards]]
backend = "cpu"
memory_mib = 2048
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 2048
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    run = tmp_path / "run"  # a short path: a Unix socket's is at most 107 bytes
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(run))
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))


def _layout(tmp_path: Path, agent: str) -> Path:
    path = tmp_path / "layout.toml"
    path.write_text(LAYOUT.format(agent=agent))
    return path


# -- fast: the layout key, the ssh command, the path checks, the unit ------------------------------------------

def test_a_standing_host_is_reached_with_attach_and_the_default_stays_stdio(tmp_path):
    rig = load_layout(_layout(tmp_path, 'agent = "standing"'))
    (host,) = rig.hosts
    assert host.agent == "standing"
    assert node_argv(host)[-2:] == ["me@b", "arcsplit node --attach"]
    assert load_layout(_layout(tmp_path, "")).hosts[0].agent == "stdio"
    assert node_argv(Host(name="b", ssh="me@b"))[-1] == "arcsplit node --stdio"
    assert 'agent = "standing"' in dump_layout(rig)  # written back, and read back the same
    (tmp_path / "again.toml").write_text(dump_layout(rig))
    assert load_layout(tmp_path / "again.toml").hosts == rig.hosts


def test_a_standing_host_does_not_send_its_own_bind_rule():
    host = Host(name="b", ssh="me@b", link="direct", address="10.0.0.2", agent="standing")
    assert node_argv(host)[-1] == "arcsplit node --attach"  # the standing agent's own --allow-bind rules there


@pytest.mark.parametrize("value", ['"daemon"', "true"])
def test_a_bad_agent_value_is_one_line(tmp_path, value):
    with pytest.raises(BadInput) as err:
        load_layout(_layout(tmp_path, f"agent = {value}"))
    assert "agent" in str(err.value) and "\n" not in str(err.value)


def test_the_default_socket_is_in_the_private_runtime_folder(tmp_path):
    path = socket_path(None)
    assert path == tmp_path / "run" / "node.sock"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_socket_in_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    with pytest.raises(BadInput, match="can be written by other users.*chmod 700"):
        socket_path(str(shared / "node.sock"))
    with pytest.raises(BadInput, match="does not exist"):
        socket_path(str(tmp_path / "nowhere" / "node.sock"))


def test_attach_without_an_agent_names_the_fix(tmp_path, capsys):
    assert main(["node", "--attach"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no node agent listens on" in err
    assert "arcsplit node --listen" in err and "arcsplit unit --node" in err


def test_the_unit_keeps_the_standing_agent_running(capsys):
    assert main(["unit", "--node"]) == 0
    assert next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("ExecStart=")).endswith(" node --listen")
    assert main(["unit", "node", "--listen", "--backend", "cpu"]) == 0
    unit = capsys.readouterr().out
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(" node --listen --backend cpu")
    for line in ("Type=simple", "Restart=on-failure", "KillMode=mixed", "SyslogIdentifier=arcsplit-node"):
        assert line in unit.splitlines()
    assert "Type=notify" not in unit and "WatchdogSec" not in unit  # the agent does not speak sd_notify


def test_the_node_unit_refuses_another_mode(capsys):
    assert main(["unit", "node", "--stdio"]) == 2
    err = capsys.readouterr().err
    assert "arcsplit node --listen" in err and err.count("\n") == 1


# -- slow: the standing agent for real ------------------------------------------------------------------------

class Listener:
    """`arcsplit node --listen` as a process (its stderr kept for the session lines)."""

    def __init__(self, bin_dir: Path, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "node", "--listen", *extra, "--llama-dir",
                                      str(bin_dir), "--heartbeat", "5"], stderr=subprocess.PIPE, text=True)
        self.path = socket_path(extra[0] if extra else None)
        wait_until(lambda: self.path.exists() or self.proc.poll() is not None, 30, "the socket")
        assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


class Attached(NodeClient):
    """`arcsplit node --attach` as a process, the way ssh runs it, and the events it passes back."""

    def __init__(self) -> None:
        super().__init__([sys.executable, "-m", "arcsplit", "node", "--attach"])

    def start_rpc(self, run: str, name: str = "rpc0") -> dict[str, Any]:
        self.send(op="hello", run=run, proto=1)
        self.wait("hello")
        self.send(op="ports", n=1, bind="127.0.0.1")
        port = self.wait("ports")["ports"][0]
        self.send(op="start", spec={"name": name, "argv": ["ggml-rpc-server", "-H", "127.0.0.1", "-p", str(port),
                                                           "-t", "1"], "cards": [0], "devices": ["RPC0"]})
        started = self.wait("started")
        self.wait("ready")
        return started

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(30)


@pytest.fixture
def listener(llama_bins):
    made: list[Listener] = []

    def make(*extra: str) -> Listener:
        made.append(Listener(llama_bins.bin_dir, *extra))
        return made[-1]

    yield make
    for one in made:
        if one.proc.poll() is None:
            one.proc.kill()
            one.proc.wait(10)


@pytest.mark.slow
def test_the_socket_is_private_and_one_agent_holds_it(listener, tmp_path):
    agent = listener()
    assert stat.S_ISSOCK(agent.path.lstat().st_mode)
    assert stat.S_IMODE(agent.path.lstat().st_mode) == 0o600
    assert stat.S_IMODE(agent.path.parent.stat().st_mode) == 0o700
    second = subprocess.run([sys.executable, "-m", "arcsplit", "node", "--listen"], capture_output=True, text=True,
                            timeout=60)
    assert second.returncode == 2 and "already listens" in second.stderr and second.stderr.count("\n") == 1
    assert agent.stop() == 0 and not agent.path.exists()


@pytest.mark.slow
def test_closing_a_session_stops_its_rpc_servers_only_and_the_agent_keeps_running(listener):
    agent = listener()
    a, b = Attached(), Attached()
    try:
        pid_a = a.start_rpc("run-a")["pid"]
        pid_b = b.start_rpc("run-b")["pid"]  # the same name "rpc0" in both sessions: each has its own
        assert pid_a != pid_b
        b.send(op="stop", name="rpc1")  # a name only another session could have had: not visible here
        assert "no process 'rpc1'" in b.wait("error")["message"]
        assert a.close() == 0  # stdin's EOF: the session ends, attach exits
        assert _gone(pid_a)
        assert psutil.Process(pid_b).is_running() and agent.proc.poll() is None
        b.send(op="ping")
        assert b.wait("pong")
        again = Attached()  # the agent takes new sessions after one ended
        again.send(op="ping")
        assert again.wait("pong")
        assert again.close() == 0
        b.proc.kill()  # the ssh side dying without a word: its session ends as well
        b.proc.wait(10)
        assert _gone(pid_b)
        assert agent.proc.poll() is None
    finally:
        for s in (a, b):
            if s.proc.poll() is None:
                s.proc.kill()
    assert agent.stop() == 0
    assert agent.proc.stderr is not None and agent.proc.stderr.read().count("session") >= 6  # 3 started, 3 ended


@pytest.mark.slow
def test_sigterm_stops_every_session_and_its_rpc_servers(listener):
    agent = listener()
    s = Attached()
    try:
        pid = s.start_rpc("run-t")["pid"]
        assert agent.stop() == 0
        assert _gone(pid) and s.proc.wait(15) == 0  # the attach end saw the connection close
        assert not agent.path.exists()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


@pytest.mark.slow
def test_a_group_serves_through_a_standing_agent(listener, tmp_path, demo_model, llama_bins, monkeypatch):
    from test_remote_group import ONE_HOST, TWO_HOSTS, config, greedy, launcher, running

    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
    with running(config(tmp_path, demo_model, ONE_HOST)) as sup:
        expected = greedy(sup.url)
    agent = listener()
    attach = [sys.executable, "-m", "arcsplit", "node", "--attach"]
    cfg = config(tmp_path, demo_model, TWO_HOSTS.replace('ssh = "b.invalid"', 'ssh = "b.invalid"\nagent = "standing"'))
    assert cfg.hosts[0].agent == "standing"
    with running(cfg, launcher=launcher(llama_bins, cfg.hosts, node=lambda h: attach)) as sup:
        assert greedy(sup.url) == expected
        rpc = psutil.Process(sup.status()["processes"]["rpc0"]["pid"])
        assert agent.proc.pid in {p.pid for p in rpc.parents()}  # run by a session of the standing agent
    assert _gone(rpc.pid)  # the run's end closed its session
    assert agent.proc.poll() is None
    assert agent.stop() == 0


@pytest.mark.slow
def test_a_standing_agent_serves_over_a_real_sshd(demo_model, net, tmp_path, llama_bins, monkeypatch):
    """Host b a network namespace with sshd (tests/_netns.py): the agent kept running there, ssh runs --attach."""
    from test_multihost import greedy, remote, serving, two_hosts

    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
    b = net.host("b")
    agent = subprocess.Popen(net.ns_argv("b", [str(b.arcsplit), "node", "--listen"]), stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_until(lambda: (b.dir / "rt" / "node.sock").exists() or agent.poll() is not None, 30, "b's agent")
        layout = two_hosts(net, tmp_path)
        layout.write_text(layout.read_text().replace('link = "ssh"', 'link = "ssh"\nagent = "standing"'))
        with serving(tmp_path, demo_model, layout) as served:
            assert len(greedy(served.url)) == 16
            (rpc,) = remote(net)["rpc"]
            assert agent.pid in {p.pid for p in rpc.parents()}  # a session of the standing agent runs it
        assert _gone(rpc.pid)  # the run's end closed its session over ssh
        assert agent.poll() is None
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    assert not any(remote(net).values())
