"""`stop` over the bus, seen through to the end: a real `arcsplit serve` (CPU build, demo model) stopped by
`arcsplit stop` or by the dashboard's `s`. The bus must stay up through the ordered shutdown: subscribers see
"stopping" then "stopped", `ps` lists the run while any of its processes exists, the dashboard says "stopped"."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env  # noqa: E402

from arcsplit._api import BusInfo, attach, runs  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.tui.app import DashApp  # noqa: E402
from arcsplit.tui.feed import Feed  # noqa: E402
from arcsplit.tui.widgets import render_header  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def serving(tmp_path: Path, llama_bins, demo_model) -> Iterator[tuple[subprocess.Popen[str], BusInfo]]:
    """`arcsplit serve` in a process of its own, ready; killed (group and all) if a test leaves it running."""
    with isolated_env(tmp_path, llama_bins.bin_dir):
        proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu",
                                 "--gpus", "0,1", "--cpu-memory", "1024", "--ctx", "1024", "--threads", "1",
                                 "--port", str(free_port())],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
                                start_new_session=True)
        try:
            info = _wait_ready(proc)
            yield proc, info
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait(30)


def _wait_ready(proc: subprocess.Popen[str], timeout: float = 120.0) -> BusInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        listed = runs()
        if listed:
            try:
                with attach(listed[0].run_id, timeout=2.0) as client:
                    if client.status()["state"] == "ready":
                        return listed[0]
            except Exception:
                pass
        time.sleep(0.2)
    raise AssertionError("arcsplit serve did not get ready")


def _alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            pass
    return False


def test_stop_over_the_bus_reaches_subscribers_and_ps_until_the_processes_are_gone(serving):
    proc, info = serving
    with attach(info.run_id) as client:
        pids = [p["pid"] for p in client.status()["processes"].values()]
    assert len(pids) == 3 and _alive(pids)

    got: list[dict[str, Any]] = []

    def subscribe() -> None:
        with attach(info.run_id) as sub:
            for msg in sub.events(idle=20):  # ends by itself after "stopped"; 20 s of silence is a failure
                got.append(msg)

    listener = threading.Thread(target=subscribe, daemon=True)
    listener.start()
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got and got[0]["kind"] == "snapshot"

    stop = subprocess.Popen([sys.executable, "-m", "arcsplit", "stop", info.run_id, "--wait", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    unlisted_while_alive = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = _alive(pids)
        listed = any(r.run_id == info.run_id for r in runs())
        if alive and not listed:
            unlisted_while_alive += 1
        if not alive and not listed:
            break
        time.sleep(0.005)
    out, _ = stop.communicate(timeout=60)
    assert stop.returncode == 0 and f"stopped {info.run_id}" in out, out
    assert unlisted_while_alive == 0, "`ps` dropped the run while its processes were still shutting down"
    assert proc.wait(30) == 0
    said = proc.stdout.read() if proc.stdout else ""
    assert f"arcsplit: stop asked by `arcsplit stop` (pid {stop.pid})" in said, said[-2000:]  # who, on its terminal
    assert "arcsplit: loading the weights of " in said and "text_model" not in said, said[:2000]  # what loads
    assert "did not exit after SIGKILL" not in said, said[-2000:]  # a member that exited is not called stuck
    assert not _alive(pids)

    listener.join(10)
    assert not listener.is_alive(), "the event stream did not end after the group stopped"
    groups = [m["data"].get("state") for m in got if m["kind"] == "group"]
    assert groups[-2:] == ["stopping", "stopped"], groups
    assert got[-1]["kind"] == "group" and got[-1]["data"]["state"] == "stopped"
    assert [m["seq"] for m in got[1:]] == sorted(m["seq"] for m in got[1:])


def _feeding(app: DashApp) -> bool:
    """The dashboard's event stream is still open."""
    return any(w.group == "feed" and not w.is_finished for w in app.workers)


def test_the_dashboards_stop_ends_in_stopped_not_disconnected(serving):
    proc, info = serving

    async def main() -> None:
        feed = Feed(attach(info.run_id))
        try:
            app = DashApp(feed)
            async with app.run_test(size=(100, 30)) as pilot:
                deadline = time.monotonic() + 20
                while app.state.status.get("state") != "ready":
                    assert time.monotonic() < deadline, "the dashboard never saw the group ready"
                    await pilot.pause(0.05)
                await pilot.press("s", "y")
                deadline = time.monotonic() + 60
                while app.state.status.get("state") != "stopped" or _feeding(app):
                    assert time.monotonic() < deadline, f"state {app.state.status.get('state')}"
                    await pilot.pause(0.05)
                await pilot.pause(0.2)
                assert app.state.error is None, app.state.error
                header = render_header(app.state, info.run_id)
                assert "stopped" in header and "disconnected" not in header, header
        finally:
            feed.close()

    asyncio.run(main())
    assert proc.wait(30) == 0
    said = proc.stdout.read() if proc.stdout else ""
    assert f"arcsplit: stop asked by the dashboard (pid {os.getpid()})" in said, said[-2000:]


def test_a_stopped_run_stays_listed_and_its_logs_readable(serving, capsys):
    """After the run: `ps --all` lists it with how and when it ended, and `logs RUN` reads its log files."""
    from arcsplit.cli import main

    proc, info = serving
    with attach(info.run_id) as client:
        client.stop()
    assert proc.wait(60) == 0
    capsys.readouterr()
    assert main(["ps"]) == 0
    assert info.run_id not in capsys.readouterr().out
    assert main(["ps", "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["run"], r["state"], r["mode"]) for r in rows] == [(info.run_id, "stopped", "rpc")]
    assert rows[0]["ended"] and rows[0]["run_dir"] == info.run_dir
    assert main(["ps", "--all"]) == 0
    out = capsys.readouterr().out
    assert "no arcsplit instance is running" in out and info.run_id in out and "stopped" in out, out

    assert main(["logs", info.run_id[:-1], "-p", "server", "-n", "500"]) == 0  # a prefix, as for a running one
    got = capsys.readouterr()
    assert f"run {info.run_id} ended" in got.err and info.run_dir in got.err
    assert any("model loaded" in line for line in got.out.splitlines()), got.out[-2000:]
    assert main(["logs", "-n", "2000"]) == 0  # none running: the newest run
    out = capsys.readouterr().out
    assert "[rpc0] " in out and "[server] " in out
    assert main(["logs", "no-such-run"]) == 2
    assert "ps --all" in capsys.readouterr().err


def test_ctrl_c_stops_in_order_and_calls_no_member_stuck(serving):
    """Ctrl-C at the serve terminal (SIGINT to its process group: every member gets it too): the group stops, and a
    member whose exit was not yet observed when its stop returned is not called stuck in the kernel."""
    proc, info = serving
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0
    said = proc.stdout.read() if proc.stdout else ""
    assert "did not exit after SIGKILL" not in said, said[-2000:]
