"""The node agent's first phase (arcsplit/node/quick.py): an rpc-server started and ready before anyio is imported,
then supervised by the agent like any other (proc/popen.py's PopenProcess adopted by a Child)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

from arcsplit.proc.child import Child
from arcsplit.proc.popen import PopenProcess
from arcsplit.proc.spec import ProcessSpec
from arcsplit.proc.spawn import popen

from _node_client import gone as _gone
from _procs import stop_after_first_line


def _spec(*argv: str) -> ProcessSpec:
    return ProcessSpec(name="p", role="rpc", argv=argv, env=(("ARCSPLIT_T", "x"),), host="127.0.0.1", port=1,
                       cards=())


# -- a process started without an event loop, adopted by a Child -------------------------------------------

def test_an_adopted_process_gives_its_lines_its_environment_and_its_exit_code(tmp_path):
    proc = popen(_spec("sh", "-c", 'echo one; echo "$ARCSPLIT_T"; printf last; exit 3'))
    child = Child(_spec("sh"), log_path=tmp_path / "p.log")
    child.adopt(PopenProcess(proc))

    async def main() -> None:
        with anyio.fail_after(10):
            await child.run()

    anyio.run(main)
    assert list(child.lines) == ["one", "x", "last"]
    assert child.returncode == 3 and child.pid == proc.pid
    assert "one" in (tmp_path / "p.log").read_text()


def test_an_adopted_process_takes_requests_on_stdin_and_ends_at_eof(tmp_path):
    """serve's early ssh sessions (run/early.py) are spawned before anyio's import and adopted the same way: the
    agent's requests go down their stdin, and closing it (EOF) is how a session is ended."""
    spec = ProcessSpec(name="p", role="node", argv=("sh", "-c", 'while read -r l; do echo "got $l"; done; exit 5'),
                       env=(), host="", port=0, cards=(), keep_stdin=True)
    proc = popen(spec)
    child = Child(spec)
    child.adopt(PopenProcess(proc))

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(child.run)
                big = b"x" * 200_000  # more than a pipe holds: the write waits until the reader drains it
                assert await child.send(b"ping\n" + big + b"\n")
                while len(child.lines) < 2:
                    await anyio.sleep(0.01)
                await child.close_input()
                await child.done.wait()
                assert not await child.send(b"late\n")  # a closed session takes nothing

    anyio.run(main)
    assert list(child.lines)[0] == "got ping" and list(child.lines)[1] == "got " + "x" * 200_000
    assert child.returncode == 5


def test_several_tasks_may_wait_for_an_adopted_process_at_once():
    """A Child's run() and its stop() both wait for the exit, as they may with anyio's own processes; the pidfd
    takes one waiter only, so the others wait for it. One waiter cancelled hands the watch on."""
    proc = popen(_spec("sh", "-c", "exec sleep 0.5"))
    p = PopenProcess(proc)
    got: list[int] = []

    async def main() -> None:
        async def one() -> None:
            got.append(await p.wait())

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                with anyio.move_on_after(0.1):  # the first watcher gives up early
                    await p.wait()
                for _ in range(3):
                    tg.start_soon(one)

    anyio.run(main)
    assert got == [0, 0, 0]


def test_an_adopted_process_is_stopped_like_a_spawned_one(tmp_path):
    proc = popen(_spec("sh", "-c", "echo up; exec sleep 30"))
    child = Child(_spec("sh"))
    child.adopt(PopenProcess(proc))
    stop_after_first_line(child)
    assert child.returncode == -signal.SIGTERM
    assert _gone(proc.pid, 5)


# -- the first phase for real: hello, ports, start, ready with anyio not imported ------------------------------

QUICK = textwrap.dedent("""
    import argparse, json, signal, sys, threading
    from arcsplit.cli.node import inventory
    from arcsplit.node import quick

    gate = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: gate.set())  # the test lets the heavy imports finish
    args = argparse.Namespace(backend="cpu", llama_dir=sys.argv[1], build=None)

    def emit(ev):
        if ev["ev"] == "ready":
            ev["heavy"] = sorted(m for m in ("anyio", "asyncio", "arcsplit.node.agent") if m in sys.modules)
        print(json.dumps(ev), flush=True)

    h = quick.first_ops(0, emit, allow_bind=(), inventory=lambda b: inventory(args, b), load=lambda: gate.wait(30))
    print(json.dumps({"ev": "handover", "started": [s.spec.name for s in h.started],
                      "ready": [s.ready for s in h.started], "lines": [l.decode() for l in h.lines]}), flush=True)
    for s in h.started:
        s.popen.kill()
        s.popen.wait()
""")


@pytest.mark.slow
def test_the_first_rpc_server_is_ready_before_the_agent_imports_anyio(tmp_path, llama_bins):
    """What makes a start over SSH quicker: the agent's first phase answers hello, ports and start and sees the
    rpc-server ready while the heavy imports (held here until then) have not run."""
    p = subprocess.Popen([sys.executable, "-c", QUICK, str(llama_bins.bin_dir)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path)})
    assert p.stdin is not None and p.stdout is not None

    def send(**msg: object) -> None:
        assert p.stdin is not None
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()

    def wait(ev: str) -> dict:
        assert p.stdout is not None
        for line in p.stdout:
            msg = json.loads(line)
            if msg["ev"] == ev:
                return msg
        raise AssertionError(f"no {ev}: exit {p.wait()}")

    try:
        send(op="ping")
        send(op="hello", run="run-q", proto=1, backend="cpu")
        assert Path(wait("hello")["llama"]["rpc_bin"]).resolve() == llama_bins.rpc_server.resolve()
        send(op="ports", n=1, bind="127.0.0.1")
        port = wait("ports")["ports"][0]
        send(op="start", spec={"name": "rpc0", "argv": ["ggml-rpc-server", "-H", "127.0.0.1", "-p", str(port),
                                                        "-t", "1"]})
        started = wait("started")
        assert started["name"] == "rpc0" and started["create_time"]
        state = json.loads((tmp_path / "nodes" / "run-q" / "state.json").read_text())
        assert [r["pid"] for r in state["processes"]] == [started["pid"]]  # the next agent can sweep it
        ready = wait("ready")
        assert ready["name"] == "rpc0" and ready["heavy"] == []
        send(op="stop", name="rpc0")  # not this phase's: left to the agent, in order
        time.sleep(0.5)  # read (the phase polls its input every few ms), then the imports may end
        p.send_signal(signal.SIGUSR1)
        handover = wait("handover")
        assert handover == {"ev": "handover", "started": ["rpc0"], "ready": [True],
                            "lines": ['{"op": "stop", "name": "rpc0"}']}
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("asked, reads", [("cpu", [None]), ("sycl", [None, "sycl"])])
def test_the_hellos_inventory_is_read_while_the_client_is_still_planning(tmp_path, monkeypatch, asked, reads):
    """An agent up before the client's hello (the usual case over SSH: serve plans meanwhile) reads this host's
    build and cards while idle, so the hello is answered without that wait; a hello for another backend than the
    one read gets its own."""
    from arcsplit.node import quick

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path))
    calls: list[str | None] = []

    def inventory(backend: str | None) -> dict:
        calls.append(backend)
        return {"llama": {"backend": backend or "cpu", "rpc_bin": "/x/ggml-rpc-server"}}

    r, w = os.pipe()
    events: list[dict] = []
    os.write(w, b'{"op":"ping"}\n')
    done = threading.Thread(target=lambda: quick.first_ops(r, events.append, allow_bind=(), inventory=inventory,
                                                           load=lambda: time.sleep(0.3)))
    done.start()
    try:
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:  # read during the idle wait after the ping
            time.sleep(0.005)
        assert calls == [None]
        os.write(w, json.dumps({"op": "hello", "run": "run-p", "proto": 1, "backend": asked}).encode() + b"\n")
    finally:
        os.close(w)
        done.join(10)
        os.close(r)
    hello = next(e for e in events if e.get("ev") == "hello")
    assert hello["llama"]["backend"] == asked and calls == reads


def test_the_heavy_imports_wait_while_hello_ports_and_start_are_on_their_way(tmp_path, monkeypatch):
    """The imports take a small host's core and the interpreter lock for ~0.25 s: begun 20 ms after the hello's
    inventory was read, they made a hello that came just after the agent was up (serve's planning ending then)
    wait on them, and ports and start after it. Now they wait for the first start, or IDLE_IMPORT s of quiet
    (a client planning a big model); while they run, the interpreter switches threads every SWITCH s."""
    from arcsplit.node import quick

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(quick, "IDLE_IMPORT", 0.4)
    began: list[tuple[float, float]] = []  # (when, the switch interval then)

    def load() -> None:
        began.append((time.monotonic(), sys.getswitchinterval()))

    r, w = os.pipe()
    events: list[dict] = []
    before = sys.getswitchinterval()
    done = threading.Thread(target=lambda: quick.first_ops(
        r, events.append, allow_bind=(), inventory=lambda b: {"llama": {"backend": "cpu", "rpc_bin": "/x/rpc"}},
        load=load))
    done.start()
    try:
        os.write(w, b'{"op":"ping"}\n')
        time.sleep(0.1)  # the agent is up, the inventory read while idle
        os.write(w, json.dumps({"op": "hello", "run": "run-i", "proto": 1, "backend": "cpu"}).encode() + b"\n")
        time.sleep(0.1)  # five times the old 20 ms: no import yet
        os.write(w, b'{"op":"ports","n":1,"bind":"127.0.0.1"}\n')
        time.sleep(0.1)
        assert not began, "the imports began between the hello and the start"
        quiet_from = time.monotonic()
        deadline = quiet_from + 5
        while not began and time.monotonic() < deadline:  # no start comes: after IDLE_IMPORT s they begin anyway
            time.sleep(0.01)
        assert began and began[0][0] - quiet_from >= 0.25 and began[0][1] == quick.SWITCH
    finally:
        os.close(w)
        done.join(10)
        os.close(r)
    assert [e["ev"] for e in events if e["ev"] in ("pong", "hello", "ports")] == ["pong", "hello", "ports"]
    assert sys.getswitchinterval() == before  # restored for the agent's event loop
