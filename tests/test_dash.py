"""The dashboard driven by Textual's pilot against a real running instance (demo model, CPU build, real bus)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env, running_instance  # noqa: E402

from arcsplit.run.bus import attach  # noqa: E402
from arcsplit.run.events import Event, LogData  # noqa: E402
from arcsplit.tui.app import DashApp  # noqa: E402
from arcsplit.tui.feed import Feed  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inst(tmp_path_factory, llama_bins, demo_model):
    with isolated_env(tmp_path_factory.mktemp("dash"), llama_bins.bin_dir):
        with running_instance(demo_model, telemetry_interval=0.3) as i:
            yield i


async def until(pilot: Any, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def drive(script: Callable[[DashApp, Any], Any], size: tuple[int, int] = (80, 24)) -> None:
    async def main() -> None:
        feed = Feed(attach())
        try:
            app = DashApp(feed)
            async with app.run_test(size=size) as pilot:
                await until(pilot, lambda: app.state.connected and app.state.status.get("state") == "ready")
                await script(app, pilot)
        finally:
            feed.close()

    asyncio.run(main())


def test_overview_shows_the_live_group(inst):
    status = attach().status()

    async def script(app: DashApp, pilot: Any) -> None:
        await until(pilot, lambda: bool(app.state.telemetry.get("processes")))
        await pilot.pause(0.2)
        table = app.query_one("#procs")
        rows = {table.get_row(k)[0]: table.get_row(k) for k in table.rows}
        assert set(rows) == set(status["processes"])
        for name, p in status["processes"].items():
            assert rows[name][3] == str(p["pid"]) and rows[name][4] == "ready" and rows[name][9] == str(p["port"])
        cards = str(app.query_one("#cards").render())
        assert "RPC0" in cards and "RPC1" in cards and "plan" in cards
        assert inst.url in str(app.query_one("#header").render())

    drive(script)


def test_server_panel_counts_a_real_request(inst):
    async def script(app: DashApp, pilot: Any) -> None:
        await until(pilot, lambda: bool(app.state.telemetry.get("server")))
        before = app.state.telemetry["server"]["tokens_predicted_total"]
        await asyncio.to_thread(httpx.post, f"{inst.url}/completion",
                                json={"prompt": "Hello", "n_predict": 12, "temperature": 0}, timeout=60)
        await until(pilot, lambda: app.state.telemetry["server"]["tokens_predicted_total"] >= before + 12)
        await pilot.pause(0.1)
        text = str(app.query_one("#server").render())
        assert f"generated {app.state.telemetry['server']['tokens_predicted_total']}" in text
        assert any(v > 0 for v in app.state.gen_tps)  # the sparkline has the request in it

    drive(script)


def test_logs_panel_follows_filters_and_searches(inst):
    async def script(app: DashApp, pilot: Any) -> None:
        await pilot.press("3")
        log = app.query_one("#log")
        await until(pilot, lambda: log.line_count > 0)
        assert any(line.lstrip().startswith("server │") for line in log.lines)
        marker = f"dash-marker-{time.monotonic_ns()}"
        inst.publish("rpc1", LogData(f"{marker} from the bus"))
        await until(pilot, lambda: any(marker in line for line in log.lines))
        # one process only
        while app.log_proc != "rpc1":
            await pilot.press("p")
        await pilot.pause(0.1)
        assert log.lines and all("│" not in line for line in log.lines)  # no process column
        assert any(marker in line for line in log.lines)
        # filter (&): only matching lines
        await pilot.press("ampersand")
        await pilot.press(*marker)
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert log.lines and all(marker in line for line in log.lines)
        # search (/) on all processes: jumps to a match and stops following
        await pilot.press("ampersand", "enter")  # clear the filter
        while app.log_proc is not None:
            await pilot.press("p")
        await pilot.press("slash", *"slot", "enter")
        await pilot.pause(0.1)
        assert "slot" in log.lines[app.search_at].lower() and not app.follow

    drive(script)


def test_two_dashboards_watch_one_instance(inst):
    async def main() -> None:
        feeds = [Feed(attach()), Feed(attach())]
        apps = [DashApp(f) for f in feeds]
        try:
            async with apps[0].run_test(size=(80, 24)) as p0, apps[1].run_test(size=(100, 30)) as p1:
                marker = f"both-{time.monotonic_ns()}"
                await until(p0, lambda: all(a.state.connected for a in apps))
                inst.publish("rpc0", LogData(marker))  # a server line without its clock would continue a hidden one
                await until(p1, lambda: all(any(marker in line for _, line in a.state.logs) for a in apps))
        finally:
            for f in feeds:
                f.close()

    asyncio.run(main())


def test_help_and_a_declined_stop_change_nothing(inst):
    async def script(app: DashApp, pilot: Any) -> None:
        await pilot.press("question_mark")
        await pilot.pause(1.0)  # telemetry keeps coming while a dialog covers the panels
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape", "s")
        await pilot.pause(0.1)
        assert type(app.screen).__name__ == "ConfirmScreen"
        await pilot.press("n")
        await pilot.pause(0.5)
        assert attach().status()["state"] == "ready"

    drive(script)


def test_restart_key_restarts_the_group(inst):
    pids = {n: p["pid"] for n, p in attach().status()["processes"].items()}

    async def script(app: DashApp, pilot: Any) -> None:
        await pilot.press("r", "y")
        await until(pilot, lambda: app.state.status.get("state") != "ready", timeout=30)
        await until(pilot, lambda: app.state.status.get("state") == "ready", timeout=60)
        table = app.query_one("#procs")
        await until(pilot, lambda: all(table.get_row(k)[6] == "1" for k in table.rows), timeout=10)
        for k in table.rows:
            row = table.get_row(k)
            assert row[3] != str(pids[row[0]]) and row[4] == "ready"  # new processes, shown as such

    drive(script)
    after = attach().status()
    assert after["state"] == "ready"
    assert all(after["processes"][n]["pid"] != pid for n, pid in pids.items())


def test_stays_responsive_while_logs_flood(inst):
    """A UI tick (fold messages in + redraw) stays far under 50 ms at thousands of log lines a second.
    The number itself is measured by bench/dash_frame.py; this only guards a generous bound."""
    async def script(app: DashApp, pilot: Any) -> None:
        await pilot.press("3")
        app.tick_times.clear()
        stop = time.monotonic() + 3.0
        fut = inst.portal.start_task_soon(flood, inst, 3.0, 4000)
        lags = []
        while time.monotonic() < stop:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)
        sent = fut.result(timeout=10)
        # nothing lost on the way (a few may be past the HWM): every line reaches the screen's state, however
        # long a slow shared machine takes to fold the backlog in (the bound on lateness is the ticks', below)
        await until(pilot, lambda: app.state.log_total >= sent * 0.9, timeout=10)
        ticks = sorted(app.tick_times)
        p99 = ticks[int(len(ticks) * 0.99) - 1]
        print(f"\nflood {sent} lines/3 s: tick p50 {statistics.median(ticks) * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms; loop lag max {max(lags) * 1000:.1f} ms")
        assert sent > 3000  # the flooder's own pace (4000/s asked) falls on a slow shared machine; still >1000/s
        # the loop's lateness: its 99th percentile bounds what a user sees; one late sample alone is the
        # scheduler of a shared 2-core machine (CI saw 406 ms once with p99 ticks at 4 ms), so the max only
        # guards against a stall
        lag99 = sorted(lags)[int(len(lags) * 0.99) - 1]
        assert p99 < 0.1 and lag99 < 0.25 and max(lags) < 1.0

    drive(script)


async def flood(inst: Any, seconds: float, per_second: int) -> int:
    """Publish log lines from the supervisor's loop, as a chatty llama-server would."""
    import anyio

    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(per_second // 100):
            inst.sup.events.publish(Event.of("server", LogData(f"flood line {sent} slot 0 decoding token")))
            sent += 1
        await anyio.sleep(0.01)
    return sent
