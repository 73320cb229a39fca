"""Telemetry of processes on other hosts: from their node agents' reports in the status (``usage``), since this
machine cannot sample them (the netns test in test_multihost.py checks a real report against the real process)."""

from __future__ import annotations

import anyio

from arcsplit.telemetry import Telemetry
from arcsplit.telemetry.cpu import RemoteSampler


def _proc(pid: int, cpu_s: float, at: float, rss: int = 50 << 20) -> dict[str, object]:
    return {"state": "ready", "pid": pid, "host": "b", "role": "rpc",
            "usage": {"cpu_s": cpu_s, "rss": rss, "threads": 3, "at": at}}


def test_cpu_use_is_the_change_in_cpu_seconds_between_two_reports():
    s = RemoteSampler()
    first = s.sample({"rpc1": _proc(4242, 10.0, 100.0)})["rpc1"]
    assert first == {"pid": 4242, "cpu": None, "rss": 50 << 20, "threads": 3, "host": "b"}  # one report: no rate yet
    assert s.sample({"rpc1": _proc(4242, 11.5, 102.0)})["rpc1"]["cpu"] == 75.0  # 1.5 s of CPU in 2 s
    assert s.sample({"rpc1": _proc(4242, 11.5, 102.0)})["rpc1"]["cpu"] == 75.0  # no new report: the last rate
    restarted = s.sample({"rpc1": _proc(5151, 0.2, 103.0)})["rpc1"]  # a new process: its own clock
    assert restarted["pid"] == 5151 and restarted["cpu"] is None


def test_a_process_without_a_report_is_left_out():
    s = RemoteSampler()
    assert s.sample({"server": {"state": "ready", "pid": 1, "host": ""}, "rpc1-link": {"host": "b"}}) == {}


def test_a_cpu_card_on_another_host_gets_its_rpc_servers_use():
    status = {"processes": {"rpc0": _proc(4242, 10.0, 100.0, rss=200 << 20)},
              "plan": {"cards": [{"device": "RPC0", "backend": "cpu", "index": 0, "free": 1 << 30}]},
              "route": {"cards": [{"position": 0, "holder": "rpc0"}]}}

    async def sample() -> dict[str, object]:
        tel = Telemetry(nvml=False)
        try:
            return await tel.sample(status)
        finally:
            await tel.aclose()

    out = anyio.run(sample)
    (card,) = out["cards"]  # type: ignore[misc]
    assert card["holder"] == "rpc0" and card["used"] == 200 << 20 and card["total"] == 1 << 30, card
    assert out["processes"]["rpc0"]["host"] == "b"  # type: ignore[index]
