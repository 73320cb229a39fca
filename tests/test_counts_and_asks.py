"""What a person reads about failures and requests: counts as whole numbers (the decay stays the supervisor's), and
a stop or restart asked over the bus said on the serving terminal, with who asked."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from arcsplit.cli.serve_run import backoff_line
from arcsplit.run.bus import BusServer, Client, asked_line
from arcsplit.run.supervisor import RestartPolicy
from arcsplit.tui.state import DashState
from arcsplit.tui.widgets import render_plan

from _bus_wire import _Target
from _fake_launcher import FakeLauncher
from test_supervisor_fake import supervisor, wait_for


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))


def test_status_counts_failures_as_a_whole_number_after_decay():
    """A fault after some time ready counts 1.25 inside (half of the earlier one left, plus one): status() says 1."""
    fake = FakeLauncher()
    policy = RestartPolicy(base_delay=0.01, max_delay=0.04, max_failures=5, half_life=0.1)

    async def main() -> None:
        async with supervisor(fake, policy=policy) as sup:
            fake.kill("rpc1")
            await wait_for(lambda: sup.status()["generation"] == 2 and sup.status()["state"] == "ready")
            await anyio.sleep(0.2)  # two half-lives ready: the first failure counts 0.25 now
            fake.kill("rpc1")
            await wait_for(lambda: sup.status()["generation"] == 3 and sup.status()["state"] == "ready")
            failures = sup.status()["failures"]
            assert failures == 1 and isinstance(failures, int), failures
            assert 1.0 < sup._failures <= 1.26  # the decay, kept inside (>= 0.2 s ready: the first counts <= 0.25)

    anyio.run(main)


def test_the_backoff_line_and_the_dashboard_show_whole_counts():
    line = backoff_line({"state": "backoff", "delay": 1.0, "failures": 1.0, "error": "rpc0 exited"}, 5)
    assert line == "group failed (rpc0 exited); restarting in 1 s (1 failure counted; it gives up past 5)"
    assert "2 failures counted" in backoff_line({"delay": 1.414, "failures": 1.5, "error": "x"}, 5)
    state = DashState()
    state.status = {"state": "ready", "failures": 1.0}
    assert "failures 1" in render_plan(state) and "1.0" not in render_plan(state)


def test_asked_line_names_the_asker_in_one_printable_line():
    assert asked_line("stop", {"by": "`arcsplit stop`", "pid": 42}) == \
        "stop asked by `arcsplit stop` (pid 42): stopping llama-server, then the rpc-servers"
    assert asked_line("restart", {}) == "restart asked by a bus client: restarting the group in order"
    assert "\n" not in asked_line("stop", {"by": "x\n\x1b[2Jy" * 40, "pid": "no"})


def test_a_stop_or_restart_over_the_bus_is_said_with_who_asked(tmp_path: Path):
    said: list[str] = []
    target = _Target()
    asked: list[str] = []
    target.restart = lambda: asked.append("restart")  # type: ignore[method-assign]
    with start_blocking_portal() as portal:
        server = BusServer(target, tmp_path, "asks-test", say=said.append)
        future, info = portal.start_task(server.run)
        with Client(info, timeout=10) as client:
            client.restart(by="`arcsplit restart`")
            client.stop(by="the dashboard")
        future.result(timeout=10)
    assert asked == ["restart"]
    assert [line.split(" (pid ")[0] for line in said] == ["restart asked by `arcsplit restart`",
                                                          "stop asked by the dashboard"]
    assert all(f"(pid {os.getpid()})" in line for line in said)
