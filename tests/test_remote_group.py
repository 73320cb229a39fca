"""A group with a card on another "host", without ssh: the supervisor reaches the host's node agent through the
transport seam (`python -m arcsplit node --stdio` as a local process instead of `ssh b arcsplit node --stdio`) and
runs the link member with a local forward instead of `ssh -N -L`. Everything else is real: the agent, its
ggml-rpc-server, llama-server and the demo model. tests/test_multihost*.py do the same over a real sshd.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import httpx
import psutil
import pytest
from anyio.from_thread import start_blocking_portal

from arcsplit.errors import BadInput, HostError
from arcsplit.hosts import check_inventory
from arcsplit.llama.locate import server_build_info
from arcsplit.rig import Host, load_layout
from arcsplit.proc.ports import free_port
from arcsplit.decide.prepare import ServeRequest, preview
from arcsplit.run.remote import NodeLauncher, Transport, launcher_for
from arcsplit.decide.specs import ProcessSpec
from arcsplit.run.supervisor import RestartPolicy, Supervisor

from _procs import dead, wait_until

pytestmark = pytest.mark.slow
PROMPT = "The three primary colors are"
FORWARD = str(Path(__file__).with_name("_tcp_forward.py"))

TWO_HOSTS = """
name = "two hosts on one machine"
[[hosts]]
name = "b"
ssh = "b.invalid"
[[cards]]
backend = "cpu"
memory_mib = 2048
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 2048
"""
ONE_HOST = """
name = "the same split on one machine"
[[cards]]
backend = "cpu"
memory_mib = 2048
[[cards]]
backend = "cpu"
memory_mib = 2048
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch, llama_bins):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))


def config(tmp_path: Path, model: Path, layout: str):
    path = tmp_path / f"layout-{abs(hash(layout))}.toml"
    path.write_text(layout)
    req = ServeRequest(model=str(model), backend="cpu", mode="hybrid", ctx=1024, threads=1, port=free_port())
    return preview(req, rig=load_layout(path)).config


def local_forward(spec: ProcessSpec) -> list[str]:
    """The link's `-L 127.0.0.1:L:BIND:R` as a local forward (the agent's rpc-server is on this machine)."""
    local_host, local_port, bind, port = spec.argv[spec.argv.index("-L") + 1].split(":")
    return [sys.executable, FORWARD, f"{local_host}:{local_port}", f"{bind}:{port}"]


def launcher(llama_bins, hosts, node: Any = None, check: Any = "same build") -> NodeLauncher:
    if check == "same build":
        here = {"commit": server_build_info(llama_bins).commit}

        def check(host: Host, hello: Mapping[str, Any]) -> None:
            check_inventory(here, hello["llama"], host)

    agent = node or (lambda h: [sys.executable, "-m", "arcsplit", "node", "--stdio", "--llama-dir",
                                str(llama_bins.bin_dir)])
    return NodeLauncher(hosts, transport=Transport(node=agent, link=local_forward, shared=None), check=check)


@contextlib.contextmanager
def running(cfg, **kw) -> Iterator[Supervisor]:
    kw.setdefault("policy", RestartPolicy(base_delay=0.2, max_delay=1.0, max_failures=3))
    with start_blocking_portal() as portal:
        kw.setdefault("launcher", launcher_for(cfg))
        sup = Supervisor(cfg, **kw)
        with portal.wrap_async_context_manager(sup) as s:
            yield s


def greedy(url: str, n: int = 16) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=120)
    r.raise_for_status()
    return r.json()["tokens"]


def agents() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "node" in p.cmdline() and "--stdio" in p.cmdline()]


def rpc_servers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and Path(p.info["cmdline"][0]).name == "ggml-rpc-server"
            and p.pid != psutil.Process().pid and _ours(p)]


def _ours(p: psutil.Process) -> bool:
    try:
        return any(a.pid == psutil.Process().pid for a in p.parents())
    except psutil.Error:
        return False


def test_two_hosts_serve_the_tokens_of_one_host_and_leave_nothing(tmp_path, demo_model, llama_bins):
    with running(config(tmp_path, demo_model, ONE_HOST)) as sup:
        expected = greedy(sup.url)
    cfg = config(tmp_path, demo_model, TWO_HOSTS)
    with running(cfg, launcher=launcher(llama_bins, cfg.hosts)) as sup:
        assert greedy(sup.url) == expected
        procs = sup.status()["processes"]
        assert {n: (p["role"], p["host"]) for n, p in procs.items()} == {
            "rpc0": ("rpc", "b"), "rpc0-link": ("link", "b"), "server": ("server", "")}
        rpc = psutil.Process(procs["rpc0"]["pid"])  # the pid the agent reported is its rpc-server
        assert Path(rpc.cmdline()[0]).name == "ggml-rpc-server" and "127.0.0.1" in rpc.cmdline()
        assert any("node" in a.cmdline() for a in rpc.parents())
        assert Path(procs["rpc0"]["argv"][0]).resolve() == llama_bins.rpc_server.resolve()  # the path its hello named
        server_argv = procs["server"]["argv"]
        assert server_argv[server_argv.index("--rpc") + 1] == f"127.0.0.1:{procs['rpc0-link']['port']}"
        assert procs["rpc0"]["port"] != procs["rpc0-link"]["port"]
    assert not agents() and not rpc_servers()


def test_the_agent_killed_restarts_the_group(tmp_path, demo_model, llama_bins):
    cfg = config(tmp_path, demo_model, TWO_HOSTS)
    with running(cfg, launcher=launcher(llama_bins, cfg.hosts)) as sup:
        first = sup.status()["processes"]["rpc0"]["pid"]
        (agent,) = agents()
        agent.kill()
        wait_until(lambda: sup.status()["generation"] >= 2 and sup.status()["state"] == "ready", 90, "serving again")
        assert dead(first)
        assert "node agent on b exited" in " ".join(sup.logs("rpc0", 50))
        assert len(greedy(sup.url, 4)) == 4
    assert not agents() and not rpc_servers()


def test_an_error_in_the_block_stops_llama_server_before_the_other_hosts_rpc_server(tmp_path, demo_model, llama_bins):
    """An exception in the caller's block cancels the task that runs the group. llama-server here still exits first
    and on its own: before, the cancel reached the host's session at once, its agent stopped the rpc-server there on
    the session's EOF, and llama-server aborted freeing its buffers over RPC. Nothing is left there either."""
    cfg = config(tmp_path, demo_model, TWO_HOSTS)
    with pytest.raises((KeyError, ExceptionGroup)):  # the Supervisor's own task group wraps it (aserve unwraps)
        with running(cfg, launcher=launcher(llama_bins, cfg.hosts)) as sup:
            run_dir = Path(sup.status()["run_dir"])
            raise KeyError("mine")
    server_log = (run_dir / "server.log").read_text()
    assert server_log.rstrip().endswith("=== exited exit 0"), server_log[-2000:]
    assert "crashed" not in server_log
    assert not agents() and not rpc_servers()


def test_an_unreachable_host_is_one_line_with_ssh_s_reason(tmp_path, demo_model, llama_bins):
    refused = [sys.executable, "-c", "import sys; sys.stderr.write('ssh: connect to host b.invalid port 22: "
               "Connection refused\\n'); sys.exit(255)"]
    cfg = config(tmp_path, demo_model, TWO_HOSTS)
    with pytest.raises(HostError) as err:
        with running(cfg, launcher=launcher(llama_bins, cfg.hosts, node=lambda h: refused),
                     policy=RestartPolicy(base_delay=0.1, max_delay=0.1, max_failures=1)):
            pass
    assert str(err.value).startswith("node agent on b exited: ssh: connect to host b.invalid port 22: Connection "
                                     "refused; check that `ssh b.invalid arcsplit --version` works")
    assert "\n" not in str(err.value) and not agents() and not rpc_servers()


def test_another_build_there_is_refused_before_anything_starts(tmp_path, demo_model, llama_bins):
    def other(host: Host, hello: Mapping[str, Any]) -> None:
        check_inventory({"commit": "0123abc"}, hello["llama"], host)

    cfg = config(tmp_path, demo_model, TWO_HOSTS)
    with pytest.raises(BadInput, match="host b runs another llama.cpp build: llama.cpp commit .* here"):
        with running(cfg, launcher=launcher(llama_bins, cfg.hosts, check=other)):
            pass
    assert not agents() and not rpc_servers()


def test_this_machines_rpc_servers_start_while_the_host_sessions_open(tmp_path, demo_model, llama_bins):
    """Mode rpc: the card here has an rpc-server of its own, which needs nothing from b's agent, so it starts while
    b's session opens (here an agent that takes 1.5 s to start, as a slow login would), not after its hello."""
    path = tmp_path / "two.toml"
    path.write_text(TWO_HOSTS)
    req = ServeRequest(model=str(demo_model), backend="cpu", mode="rpc", ctx=1024, threads=1, port=free_port())
    cfg = preview(req, rig=load_layout(path)).config
    slow = ["sh", "-c", f"sleep 1.5; exec {sys.executable} -m arcsplit node --stdio --llama-dir {llama_bins.bin_dir}"]
    with running(cfg, launcher=launcher(llama_bins, cfg.hosts, node=lambda h: slow)) as sup:
        procs = sup.status()["processes"]
        here, there = psutil.Process(procs["rpc0"]["pid"]), psutil.Process(procs["rpc1"]["pid"])
        assert procs["rpc0"]["host"] == "" and procs["rpc1"]["host"] == "b"
        assert there.create_time() - here.create_time() > 1.0  # started while the agent was still asleep
        assert len(greedy(sup.url, 4)) == 4
    assert not agents() and not rpc_servers()


def test_an_unreachable_host_stops_the_rpc_servers_started_here_meanwhile(tmp_path, demo_model, llama_bins):
    path = tmp_path / "two.toml"
    path.write_text(TWO_HOSTS)
    req = ServeRequest(model=str(demo_model), backend="cpu", mode="rpc", ctx=1024, threads=1, port=free_port())
    cfg = preview(req, rig=load_layout(path)).config
    refused = ["sh", "-c", "sleep 1; echo 'ssh: connect to host b.invalid port 22: Connection refused' >&2; exit 255"]
    with pytest.raises(HostError, match="Connection refused"):
        with running(cfg, launcher=launcher(llama_bins, cfg.hosts, node=lambda h: refused),
                     policy=RestartPolicy(base_delay=0.1, max_delay=0.1, max_failures=1)):
            pass
    assert not agents() and not rpc_servers()


ALL_ON_B = """
name = "every card on another host"
[[hosts]]
name = "b"
ssh = "b.invalid"
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 2048
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 2048
"""


def test_a_first_card_on_another_host_holds_the_token_embeddings(tmp_path, demo_model, llama_bins):
    """Patch 0015 where auto turns it on: an all-RPC group whose first card is on host b holds the token embeddings
    there (the plan, llama-server's ARCSPLIT_INPUT_ON_CARD=1 and its load say so), so a prompt crosses to b as token
    ids; the demo model ties its output to them, and its copy stays with the output layer on the last card. The
    greedy tokens are those of the same all-RPC split on one machine, where they stay on llama-server's CPU."""
    def rpc_config(layout: str):
        path = tmp_path / f"rpc-{abs(hash(layout))}.toml"
        path.write_text(layout)
        req = ServeRequest(model=str(demo_model), backend="cpu", mode="rpc", ctx=1024, threads=1, port=free_port())
        return preview(req, rig=load_layout(path)).config

    here = rpc_config(ONE_HOST)
    assert not here.plan.options.input_on_first
    with running(here) as sup:
        expected = greedy(sup.url)
    cfg = rpc_config(ALL_ON_B)
    assert cfg.plan.options.input_on_first and cfg.plan.host_bytes < here.plan.host_bytes
    with running(cfg, launcher=launcher(llama_bins, cfg.hosts)) as sup:
        procs = sup.status()["processes"]
        assert procs["rpc0"]["host"] == "b" and procs["rpc1"]["host"] == "b"
        assert greedy(sup.url) == expected
        run_dir = Path(sup.status()["run_dir"])
    assert "input layer on RPC0 (ARCSPLIT_INPUT_ON_CARD)" in (run_dir / "server.log").read_text(errors="replace")
    assert not agents() and not rpc_servers()
