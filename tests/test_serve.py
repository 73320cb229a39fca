"""`arcsplit serve` and the supervisor with the real llama-server / ggml-rpc-server CPU build and the demo Gemma.

CPU "cards" are rpc-servers (`-t 1` each). Groups are shared per module where a test does not break them;
the kill tests come last in the file because they restart the shared rpc group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import anyio
import httpx
import psutil
import pytest
from anyio.from_thread import start_blocking_portal

from arcsplit.cli import build_parser
from arcsplit.cli.serve_run import build_config
from arcsplit.errors import RunError
from arcsplit.proc.ports import free_port
from arcsplit.run.remote import launcher_for
from arcsplit.run.supervisor import RestartPolicy, Supervisor

from _procs import dead, wait_until

pytestmark = pytest.mark.slow
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module", autouse=True)
def isolated_dirs(tmp_path_factory: pytest.TempPathFactory, llama_bins) -> Iterator[Path]:
    """Run dirs, state files and observed verdicts go to a temp dir, not the user's."""
    root = tmp_path_factory.mktemp("arcsplit-serve")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ARCSPLIT_STATE_DIR", str(root / "state"))
        mp.setenv("ARCSPLIT_CACHE_DIR", str(root / "cache"))
        mp.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
        yield root


def serve_args(model: Path, *extra: str, gpus: str = "0,1", mode: str = "auto") -> list[str]:
    return ["serve", str(model), "--backend", "cpu", "--gpus", gpus, "--ctx", "1024", "--threads", "1",
            "--mode", mode, *extra]


def config_for(model: Path, gpus: str = "0,1", mode: str = "auto", extra: tuple[str, ...] = ()):
    args = build_parser().parse_args(serve_args(model, "--port", str(free_port()), gpus=gpus, mode=mode,
                                                *(["--", *extra] if extra else [])))
    config, decision, _, _ = build_config(args)
    return config


@contextlib.contextmanager
def running(config, **kw) -> Iterator[Supervisor]:
    """The supervisor on its own event-loop thread, as the Python API will run it."""
    kw.setdefault("policy", RestartPolicy(base_delay=0.2, max_delay=1.0, max_failures=3))
    with start_blocking_portal() as portal:
        kw.setdefault("launcher", launcher_for(config))
        sup = Supervisor(config, **kw)
        with portal.wrap_async_context_manager(sup) as s:
            s.portal = portal  # type: ignore[attr-defined]
            yield s


def greedy_tokens(url: str, n: int = 24) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=120)
    r.raise_for_status()
    tokens = r.json()["tokens"]
    assert len(tokens) == n
    return tokens


@pytest.fixture(scope="module")
def rpc_group(demo_model) -> Iterator[Supervisor]:
    with running(config_for(demo_model)) as sup:
        yield sup


@pytest.fixture(scope="module")
def single_tokens(demo_model) -> list[int]:
    """Reference output: one llama-server holding every layer itself (same -fa on, same ubatch). Weight
    repacking is off because rpc-servers keep weights in plain buffers: repacked Q4_K kernels round differently."""
    config = config_for(demo_model, gpus="0", extra=("--no-repack",))
    assert config.mode == "single" and "--rpc" not in config.plan.llama_server_args()
    with running(config) as sup:
        return greedy_tokens(sup.url)


def test_rpc_group_is_ready_on_loopback_with_state_and_logs(rpc_group):
    st = rpc_group.status()
    assert st["state"] == "ready" and st["mode"] == "rpc"
    rpcs = [p for p in st["processes"].values() if p["role"] == "rpc"]
    assert len(rpcs) == 2
    for p in rpcs:
        listening = [c.laddr for c in psutil.Process(p["pid"]).net_connections("tcp") if c.status == "LISTEN"]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", p["port"])]
    state = json.loads((Path(st["run_dir"]) / "state.json").read_text())
    assert sorted(x["pid"] for x in state["processes"]) == sorted(p["pid"] for p in st["processes"].values())
    assert state["supervisor"]["pid"] == os.getpid()
    assert "Starting RPC server" in (Path(st["run_dir"]) / "rpc0.log").read_text()  # line-buffered, not stuck
    assert any("model loaded" in line for line in rpc_group.logs("server", 500))


def test_state_file_follows_the_group_state(rpc_group):
    """`ps` and `report` read state.json: it says what the group is doing now, not what it did at the start."""
    st = rpc_group.status()
    assert st["state"] == "ready"
    state = json.loads((Path(st["run_dir"]) / "state.json").read_text())
    assert state["group"] == "ready"


def test_buffers_are_attributed_to_cards_beside_the_plan(rpc_group):
    buffers = rpc_group.status()["buffers"]
    plan_cards = rpc_group.config.plan.cards
    for card, cp in zip(buffers["cards"], plan_cards):
        if cp.n_layers or cp.has_output:
            actual = card["actual"].get("model", 0)
            assert actual > 0, card
            assert abs(actual - cp.weights) <= 0.05 * cp.weights, (card, cp)
    assert not any(k.startswith("RPC") for k in buffers["host"])


def test_openai_client_chat_completion(rpc_group):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{rpc_group.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_v1_models_names_the_model_not_its_path(rpc_group, demo_model):
    """An OpenAI client lists the model and sends its name back: the GGUF's general.name, not a path under home."""
    from arcsplit.model import load_profile, served_name

    ids = [m["id"] for m in httpx.get(f"{rpc_group.url}/v1/models", timeout=10).json()["data"]]
    assert ids == [served_name(load_profile(demo_model))]
    assert "/" not in ids[0] and str(demo_model) not in ids[0]


def test_greedy_tokens_identical_to_single_device(rpc_group, single_tokens):
    assert greedy_tokens(rpc_group.url) == single_tokens


LONG_PROMPT = " ".join(f"Line {i}: the ferry left the harbour at dawn and the gulls followed it." for i in range(48))


def test_prompt_over_several_ubatches_matches_single_device(rpc_group, demo_model):
    """A prompt of several ubatches crosses the RPC route's queued uploads (arcsplit's llama.cpp patch) many
    times before the first token: the output must still equal one process holding every layer at the same -ub."""
    argv = rpc_group.status()["processes"]["server"]["argv"]
    ub = argv[argv.index("-ub") + 1]
    n_prompt = len(httpx.post(f"{rpc_group.url}/tokenize", json={"content": LONG_PROMPT}).json()["tokens"])
    assert n_prompt > 2 * int(ub), (n_prompt, ub)

    def tokens(url: str) -> list[int]:
        r = httpx.post(f"{url}/completion", json={"prompt": LONG_PROMPT, "n_predict": 8, "temperature": 0,
                                                  "top_k": 1, "cache_prompt": False, "return_tokens": True},
                       timeout=300)
        r.raise_for_status()
        return r.json()["tokens"]

    got = tokens(rpc_group.url)
    with running(config_for(demo_model, gpus="0", extra=("--no-repack", "-ub", ub))) as single:
        assert tokens(single.url) == got


def test_hybrid_keeps_first_card_in_llama_server_and_matches(demo_model, single_tokens):
    config = config_for(demo_model, mode="hybrid")
    with running(config) as sup:
        procs = sup.status()["processes"]
        assert sorted(procs) == ["rpc0", "server"]
        argv = procs["server"]["argv"]
        assert argv[argv.index("--device") + 1] == "RPC0"
        assert greedy_tokens(sup.url) == single_tokens


def test_crash_loop_gives_up_with_the_reason_and_leaves_nothing(demo_model):
    # a start that fails the same way every time at load (an argument it refuses is final, not a crash loop)
    config = config_for(demo_model, extra=("--lora", "/nonexistent-adapter.gguf"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # the shared group's, if running
    with start_blocking_portal() as portal:
        sup = Supervisor(config, policy=RestartPolicy(base_delay=0.05, max_delay=0.1, max_failures=2),
                         launcher=launcher_for(config))
        with pytest.raises(RunError) as info:
            with portal.wrap_async_context_manager(sup):
                pass
    assert "gave up after 3 failures" in str(info.value) and "model loading error" in str(info.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_restart_request_publishes_events_and_serves_again(rpc_group):
    rx = rpc_group.subscribe(10_000)
    gen = rpc_group.status()["generation"]
    rpc_group.portal.call(rpc_group.restart)
    wait_until(lambda: (s := rpc_group.status())["generation"] == gen + 1 and s["state"] == "ready",
               60, "the restart")
    events = []
    while True:
        try:
            events.append(rpc_group.portal.call(rx.receive_nowait))
        except anyio.WouldBlock:  # drained
            break
    groups = [e.data["state"] for e in events if e.kind == "group"]
    assert groups[-3:] == ["stopping", "starting", "ready"], groups
    assert any(e.kind == "log" and e.name == "server" for e in events)
    assert any(e.kind == "progress" for e in events)
    assert rpc_group.status()["failures"] == 0  # asked for, not a failure


def test_a_stopped_rpc_server_is_shown_paused_and_not_restarted(rpc_group, single_tokens):
    """SIGSTOP leaves an rpc-server alive and llama-server's /health green, so nothing else would show it:
    the process is reported paused (status and a log event), the group is left alone, and after SIGCONT the
    same processes serve the same tokens."""
    rx = rpc_group.subscribe(10_000)
    before = rpc_group.status()
    pid = before["processes"]["rpc0"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: rpc_group.status()["processes"]["rpc0"]["paused"], timeout=20, what="rpc0 shown paused")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: not rpc_group.status()["processes"]["rpc0"]["paused"], timeout=20, what="rpc0 resumed")
    after = rpc_group.status()
    assert after["generation"] == before["generation"] and after["processes"]["rpc0"]["pid"] == pid
    events = []
    while True:
        try:
            events.append(rpc_group.portal.call(rx.receive_nowait))
        except anyio.WouldBlock:
            break
    lines = [e.data["line"] for e in events if e.kind == "log" and e.name == "rpc0"]
    assert any("is stopped (SIGSTOP" in ln for ln in lines) and any("resumed" in ln for ln in lines), lines
    assert [e.data["paused"] for e in events if e.kind == "state" and e.name == "rpc0"][-2:] == [True, False]
    assert greedy_tokens(rpc_group.url) == single_tokens


def _stream_until_killed(url: str, started: threading.Event, result: dict) -> None:
    try:
        with httpx.stream("POST", f"{url}/completion", json={"prompt": PROMPT, "n_predict": 400, "stream": True,
                                                             "temperature": 0}, timeout=60) as r:
            for _ in r.iter_lines():
                started.set()
        result["outcome"] = "finished"
    except httpx.HTTPError as exc:
        result["outcome"] = f"broken: {type(exc).__name__}"
    finally:
        started.set()


@pytest.mark.parametrize("victim", ["rpc1", "server"])
def test_kill9_mid_request_group_comes_back_and_serves(rpc_group, single_tokens, victim):
    before = rpc_group.status()
    gen = before["generation"]
    pid = before["processes"][victim]["pid"]
    started, result = threading.Event(), {}
    t = threading.Thread(target=_stream_until_killed, args=(rpc_group.url, started, result))
    t.start()
    assert started.wait(30)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    st = wait_until(lambda: (s := rpc_group.status())["generation"] > gen and s["state"] == "ready" and s,
                    60, "the group to restart")
    assert st["processes"][victim]["restarts"] >= 1
    assert dead(pid)
    assert greedy_tokens(rpc_group.url) == single_tokens


def test_sigterm_of_llama_server_is_noticed_even_if_it_does_not_exit(rpc_group, single_tokens):
    """SIGTERM makes llama-server stop serving, yet (in the router child mode arcsplit uses for load progress)
    it then waits on stdin instead of exiting: the /health watchdog must restart the group anyway."""
    before = rpc_group.status()
    gen = before["generation"]
    os.kill(before["processes"]["server"]["pid"], signal.SIGTERM)
    st = wait_until(lambda: (s := rpc_group.status())["generation"] > gen and s["state"] == "ready" and s,
                    60, "the group to restart after SIGTERM of llama-server")
    assert st["processes"]["server"]["pid"] != before["processes"]["server"]["pid"]
    assert greedy_tokens(rpc_group.url) == single_tokens


# -- the command line, as a user runs it ---------------------------------------------------------------------

def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arcsplit", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def llama_processes(port: int) -> list[psutil.Process]:
    """llama-servers serving this port: what one CLI run would have left behind."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and Path(cmd[0]).name == "llama-server" and str(port) in cmd:
            out.append(p)
    return out


def test_cli_busy_port_is_one_line_and_starts_nothing(demo_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli(serve_args(demo_model, "--port", str(port)))
    assert_one_line_error(r, f"port {port}", "--port")
    assert not llama_processes(port)


def test_cli_missing_binary(demo_model, tmp_path):
    r = run_cli(serve_args(demo_model, "--port", str(free_port())), env={"ARCSPLIT_LLAMA_DIR": str(tmp_path)})
    assert_one_line_error(r, "llama-server")


def test_cli_model_too_big(demo_model):
    port = free_port()
    r = run_cli(serve_args(demo_model, "--port", str(port), "--cpu-memory", "40"))
    assert_one_line_error(r, "needs about")
    assert not llama_processes(port)


def test_cli_value_llama_server_refuses_is_final_and_said_once(demo_model):
    """An argument llama.cpp's parser refuses only when it reads it (a word where a number goes): llama-server
    starts once and exits; the same arguments would fail every restart, so there is none: one line, exit 2."""
    port = free_port()
    r = run_cli(serve_args(demo_model, "--port", str(port), "--", "--timeout", "soon"))
    assert r.returncode == 2, (r.returncode, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert "refused its arguments" in last and "--timeout" in last and "--help" in last, last
    assert r.stderr.count("--timeout") == 1 and "restart" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not llama_processes(port)


def start_cli(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arcsplit", *serve_args(model, "--port", str(port))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "arcsplit: serving http://... (mode rpc, 2 card(s))"
    assert "serving" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, f"http://127.0.0.1:{port}"


def test_cli_sigterm_stops_everything_and_exits_0(demo_model):
    proc, url = start_cli(demo_model)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 3
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_cli_kill9_of_supervisor_leaves_no_child(demo_model):
    proc, _ = start_cli(demo_model)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert {Path(c.cmdline()[0]).name for c in children} == {"llama-server", "ggml-rpc-server"}
    proc.kill()
    proc.wait(10)
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [c.cmdline() for c in alive]
