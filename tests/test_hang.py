"""Hangs, for real: a member of a served demo model frozen with the cgroup freezer (tests/_freeze.py) while every
process stays alive and /health stays 200, as a card hung in its driver leaves them. The progress watchdog must
notice (idle and busy), name the member, restart the group, and serve the same greedy tokens again; a request in
flight must end with an error soon after, not at the client's timeout. And the other side: a long prompt on the
slowest route here, with the watchdog at its defaults, must never be taken for a hang.

The watchdog's timings are shortened through its policy (HangPolicy) so each test takes seconds, except where the
defaults are the point. Each hang test reports its detection and recovery times (``-s`` shows them;
bench/chaos.py runs them several times for RESULTS.md)."""

from __future__ import annotations

import os
from dataclasses import replace
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import anyio
import httpx
import pytest

from _freeze import frozen, unavailable
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from loadgen import Served  # noqa: E402
from _procs import dead, wait_until
from test_serve import config_for, greedy_tokens, isolated_dirs, running, serve_args  # noqa: F401 (dirs fixture)

from arcsplit.cli import build_parser
from arcsplit.cli.serve_run import build_config
from arcsplit.decide.prepare import ServeRequest, preview
from arcsplit.proc.ports import free_port
from arcsplit.rig import load_layout
from arcsplit.run.supervisor import RestartPolicy, Supervisor, Timeouts
from arcsplit.run.watchdog import HangPolicy

pytestmark = pytest.mark.slow

# Short enough for the suite, long enough for this shared 2-core machine (a decode step here takes up to ~0.3 s)
FAST = HangPolicy(after=6.0, probe_every=4.0, busy_every=0.5, idle_every=1.0, read_timeout=2.0, work_window=3.0,
                  cap=120.0)
POLICY = RestartPolicy(base_delay=0.2, max_delay=1.0, max_failures=4)
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(autouse=True)
def _freezer() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)


class InFlight:
    """One streaming completion in a thread: when it started, its last token, how it ended."""

    def __init__(self, url: str, n: int = 2000) -> None:
        self.url, self.n = url, n
        self.started = threading.Event()
        self.last_token = 0.0
        self.end = 0.0
        self.outcome = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": STORY, "n_predict": self.n, "stream": True, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        try:
            with httpx.stream("POST", f"{self.url}/completion", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.last_token = time.time()
                        self.started.set()
            self.outcome = "finished"
        except httpx.HTTPError as exc:
            self.outcome = f"error: {type(exc).__name__}"
        finally:
            self.end = time.time()
            self.started.set()


def hang_of(sup: Supervisor, freeze: Callable[[], ContextManager[Any]], reference: list[int], *,
            busy: bool) -> dict[str, Any]:
    """Freeze (``freeze()``) a member of the running group, idle or with a request in flight; wait for the verdict,
    the restart and a correct answer; thaw. Returns the times and what was said."""
    before = sup.status()
    gen = before["generation"]
    request = InFlight(sup.url) if busy else None
    if request is not None:
        assert request.started.wait(60), "the request never started"
        time.sleep(0.5)
    with freeze():
        t0 = time.time()
        failure = wait_until(lambda: (f := sup.status()["last_failure"]) and f["time"] > t0 and f, 60,
                             "the watchdog's verdict")
        t_detect = failure["time"]
        bound = sup.status()["watchdog"]["bound"]  # as the verdict saw it (the request in flight may have taught it)
        if request is not None:
            request.thread.join(60)
    wait_until(lambda: (s := sup.status())["generation"] > gen and s["state"] == "ready", 90, "the restart")
    assert greedy_tokens(sup.url) == reference
    t_served = time.time()
    out = {"failure": failure, "detect_s": t_detect - t0, "recover_s": t_served - t0, "before": before,
           "bound": max(bound, before["watchdog"]["bound"])}
    if request is not None:
        out.update(outcome=request.outcome, error_after_s=request.end - t0, last_token_s=request.last_token - t0)
    print(f"\nhang ({'busy' if busy else 'idle'}): {failure['message']}\n  detected {out['detect_s']:.1f} s, "
          f"serving again {out['recover_s']:.1f} s after the freeze"
          + (f", request in flight: {out['outcome']} after {out['error_after_s']:.1f} s" if busy else ""))
    return out


@pytest.fixture(scope="module")
def rpc_hung(demo_model) -> Iterator[Supervisor]:
    with running(config_for(demo_model, mode="rpc"), timeouts=Timeouts(hang=FAST), policy=POLICY) as sup:
        yield sup


def within(got: dict[str, Any], policy: HangPolicy = FAST, idle: bool = False) -> float:
    """The longest a verdict may take once progress stops: the bound then (the floor, or longer where the route
    showed longer pauses), a read's pace and a read's timeout; idle, the idle check's interval first."""
    first = policy.probe_every + policy.idle_every if idle else 0.0
    return first + got["bound"] + policy.busy_every + policy.read_timeout + 1.0


def test_a_frozen_rpc_server_is_named_restarted_and_the_request_in_flight_errors(rpc_hung):
    reference = greedy_tokens(rpc_hung.url)
    pid = rpc_hung.status()["processes"]["rpc1"]["pid"]
    got = hang_of(rpc_hung, lambda: frozen(pid), reference, busy=True)
    f = got["failure"]
    card = rpc_hung.config.plan.cards[1].card.device  # the card rpc1 holds, by its own name
    assert f["cause"] == "hang" and f["who"] == "rpc1" and f["card"] == card and f["host"] is None
    assert f["message"].startswith(f"rpc1 (card {card}) stopped computing: no progress for ")
    assert "llama-server waits on its answer" in f["message"] and "frozen by the cgroup" in f["message"]
    assert got["detect_s"] <= within(got), got
    # the request in flight got its error with the restart, not at its timeout (120 s)
    assert got["outcome"].startswith("error"), got
    assert got["error_after_s"] <= within(got) + Timeouts().failed_grace + 3, got
    assert dead(pid)
    st = rpc_hung.status()
    assert st["causes"].get("hang", 0) >= 1 and st["last_failure"]["who"] == "rpc1"


def test_a_frozen_rpc_server_of_an_idle_group_is_found_by_the_idle_check(rpc_hung):
    reference = greedy_tokens(rpc_hung.url)
    time.sleep(FAST.idle_every)  # the request above proved the route; the next check comes an interval later
    pid = rpc_hung.status()["processes"]["rpc0"]["pid"]
    got = hang_of(rpc_hung, lambda: frozen(pid), reference, busy=False)
    f = got["failure"]
    assert f["who"] == "rpc0" and "idle check" in f["message"], f
    assert got["detect_s"] <= within(got, idle=True), got


def test_llama_servers_frozen_main_thread_on_one_card(demo_model):
    """llama-server alone (--gpus 0), only its main thread frozen: its HTTP threads answer /health, its task loop
    stops, as in a driver call that does not return."""
    with running(config_for(demo_model, gpus="0"), timeouts=Timeouts(hang=FAST), policy=POLICY) as sup:
        assert sup.config.mode == "single"
        reference = greedy_tokens(sup.url)
        pid = sup.status()["processes"]["server"]["pid"]
        busy = hang_of(sup, lambda: frozen(pid, thread=pid), reference, busy=True)
        assert dead(pid)
        time.sleep(FAST.idle_every)
        pid2 = sup.status()["processes"]["server"]["pid"]
        idle = hang_of(sup, lambda: frozen(pid2, thread=pid2), reference, busy=False)
        card = sup.config.plan.cards[0].card.device
    for got in (busy, idle):
        f = got["failure"]
        assert f["who"] == "server" and f["card"] == card, f
        assert f["message"].startswith(f"llama-server (card {card}) stopped computing"), f
        assert "its main thread frozen by the cgroup" in f["message"], f
    assert busy["detect_s"] <= within(busy) and busy["outcome"].startswith("error"), busy
    assert busy["error_after_s"] <= within(busy) + Timeouts().failed_grace + 3, busy
    assert "while idle (llama-server's task loop does not answer /slots)" in idle["failure"]["message"], idle
    assert idle["detect_s"] <= within(idle, idle=True), idle


def test_a_member_stopped_on_purpose_is_left_alone(rpc_hung):
    """SIGSTOP (^Z, a debugger) is not a hang: the group waits for SIGCONT, as it always did."""
    before = rpc_hung.status()
    pid = before["processes"]["rpc0"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(FAST.probe_every + FAST.idle_every + within({"bound": before["watchdog"]["bound"]}) + 2)
        st = rpc_hung.status()
        assert st["generation"] == before["generation"] and st["processes"]["rpc0"]["paused"], st["last_failure"]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert greedy_tokens(rpc_hung.url)


def test_a_long_prompt_on_the_slowest_route_is_no_hang(demo_model):
    """All-RPC with one thread per card, a prompt of ~5100 tokens in batches as big as it (``-b 6144``; llama-server
    still cuts it where it keeps a checkpoint of Gemma 3's sliding window): the counters stand still for 13-30 s
    here, while the rpc-servers' main threads compute. The watchdog at its defaults but for the shortest bound the
    flag allows (5 s, so the pause surely outlasts it on a fast or a busy machine alike) must let it finish (the
    members' work holds the verdict off), and learn the pause."""
    args = build_parser().parse_args(serve_args(demo_model, "--port", str(free_port()), "--ctx", "6144",
                                                "--parallel", "1", "--", "-b", "6144", mode="rpc"))
    config = build_config(args)[0]
    prompt = " ".join(f"Line {i}: the ferry left the harbour at dawn." for i in range(370))
    short = replace(HangPolicy(), after=5.0)  # --hang-after's minimum; the rest the watchdog's defaults
    with running(config, timeouts=Timeouts(hang=short), policy=POLICY) as sup:
        before = sup.status()
        n = len(httpx.post(f"{sup.url}/tokenize", json={"content": prompt}).json()["tokens"])
        assert 4500 < n < 6144, n
        t0 = time.time()
        r = httpx.post(f"{sup.url}/completion", json={"prompt": prompt, "n_predict": 4, "cache_prompt": False},
                       timeout=600)
        took = time.time() - t0
        after = sup.status()
    assert r.status_code == 200, r.text[:300]
    assert after["generation"] == before["generation"] and not after["causes"], after["last_failure"]
    timings = r.json()["timings"]
    print(f"\nno false alarm: {n} prompt tokens, {took:.1f} s ({timings['prompt_per_second']:.0f} t/s), "
          f"watchdog {after['watchdog']}")
    # the point: the batch kept the counters still for longer than the bound, and that was no hang
    assert after["watchdog"]["longest_pause"] > short.after, \
        f"this machine decoded the batch in under {short.after:g} s: give the test a longer prompt"


def test_a_frozen_rpc_server_on_another_host(demo_model, net, tmp_path):
    """Host b (a network namespace with sshd, tests/_netns.py): its rpc-server frozen; the watchdog here names it by
    the connection llama-server waits on and its agent's report, and the group recovers through the agent."""
    layout = net.layout(tmp_path / "two.toml", [("", 300), ("b", 1024)])
    req = ServeRequest(model=str(demo_model), backend="cpu", mode="rpc", ctx=1024, threads=1, port=free_port())
    config = preview(req, rig=load_layout(layout)).config
    with running(config, timeouts=Timeouts(hang=FAST), policy=POLICY) as sup:
        reference = greedy_tokens(sup.url)
        st = sup.status()
        assert st["processes"]["rpc1"]["host"] == "b"
        pid = st["processes"]["rpc1"]["pid"]  # b's namespace shares this machine's pid space
        got = hang_of(sup, lambda: frozen(pid), reference, busy=True)
    f = got["failure"]
    assert f["who"] == "rpc1" and f["host"] == "b", f
    assert f["message"].startswith(f"rpc1 (card {f['card']}, host b) stopped computing"), f
    assert "llama-server waits on its answer" in f["message"] and "its host reports" in f["message"], f
    assert got["detect_s"] <= within(got) and got["outcome"].startswith("error"), got
    assert dead(pid)


def test_a_member_that_cannot_die_is_said_and_the_group_waits_for_its_port(demo_model):
    """The cgroup v1 freezer holds a task even against SIGKILL, as a driver call that never returns does: llama-server
    (its main thread frozen) keeps its port. The restart says so in one line with what to do, fails while the port
    is held, and serves again once the task is let go (thawed: the card's driver reset, in the field)."""
    why = unavailable("v1")
    if why:
        pytest.skip(why)
    patient = RestartPolicy(base_delay=0.5, max_delay=2.0, max_failures=20)
    with running(config_for(demo_model, gpus="0"), timeouts=Timeouts(hang=FAST), policy=patient) as sup:
        reference = greedy_tokens(sup.url)
        rx = sup.subscribe(10_000)
        gen = sup.status()["generation"]
        pid = sup.status()["processes"]["server"]["pid"]
        with frozen(pid, thread=pid, kind="v1"):
            t0 = time.time()
            wait_until(lambda: (f := sup.status()["last_failure"]) and f["time"] > t0, 60, "the verdict")
            lines = wait_until(lambda: [ln for ln in said(sup, rx) if "did not exit after SIGKILL" in ln], 90,
                               "the line about llama-server that did not exit")
            assert not dead(pid)
            time.sleep(3)  # a start or two fail meanwhile: the port is taken
        wait_until(lambda: dead(pid), 30, "llama-server to go once thawed")
        wait_until(lambda: (s := sup.status())["generation"] > gen and s["state"] == "ready", 120, "the restart")
        assert greedy_tokens(sup.url) == reference
    # SIGKILL took every thread but the frozen one
    assert lines[0].startswith(f"arcsplit: llama-server (pid {pid}) did not exit after SIGKILL: frozen by the cgroup "
                               "v1 freezer"), lines
    assert "cannot start again on port" in lines[0] and "reset the card's driver" in lines[0], lines


_said: list[str] = []


def said(sup: Supervisor, rx: Any) -> list[str]:
    """The supervisor's own log lines ("arcsplit: ...") published so far."""
    while True:
        try:
            ev = sup.portal.call(rx.receive_nowait)  # type: ignore[attr-defined]
        except anyio.WouldBlock:
            return list(_said)
        if ev.kind == "log" and str(ev.data["line"]).startswith("arcsplit: "):
            _said.append(str(ev.data["line"]))


def test_what_a_user_of_the_cli_sees(demo_model, llama_bins, monkeypatch):
    """`arcsplit serve --hang-after 6`: its own line on stderr, then `arcsplit ps` and the metrics endpoint name the
    cause and the member; nothing left after the stop."""
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
    mport = free_port()
    served = Served(demo_model, ctx=1024, parallel=1, extra_serve=("--mode", "rpc", "--threads", "1", "--hang-after",
                                                                   "6", "--metrics-port", str(mport)))
    served.start()
    try:
        served.wait_ready(120)
        rpc1 = served.children()["rpc1"].pid
        request = InFlight(served.url)
        assert request.started.wait(60)
        with frozen(rpc1):
            wait_until(lambda: "stopped computing" in served.output(), 60, "serve's line")
            request.thread.join(60)
        wait_until(lambda: "serving" in served.output().split("stopped computing")[-1], 90, "serving again")
        ps = subprocess.run([sys.executable, "-m", "arcsplit", "ps"], env=served.env(), capture_output=True,
                            text=True, timeout=60)
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).text
    finally:
        served.stop()
    try:
        line = next(ln for ln in served.output().splitlines() if "stopped computing" in ln)
        assert line.startswith("arcsplit: rpc1 (card CPU1) stopped computing: no progress for ") and \
            line.endswith("; restarting"), line
        assert "  last failure: hang: rpc1 (card CPU1), " in ps.stdout and "this run: hang 1" in ps.stdout, ps.stdout
        assert 'arcsplit_failures_total{cause="hang"} 1.0' in metrics
        assert 'cause="hang"' in metrics and 'member="rpc1"' in metrics
        assert request.outcome.startswith("error"), request.outcome
        assert served.leftovers() == {"processes": [], "ports": [], "temp_files": [], "state_files": []}
    finally:
        served.cleanup()
