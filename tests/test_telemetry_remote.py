"""Telemetry of processes and cards on other hosts: from their node agents' reports in the status (``usage``,
``gpus``), since this machine cannot sample them (the netns test in test_multihost.py checks a real report against
the real process; the cards' reports are checked here against a Rig tree, test_telemetry_intel.py's fake sysfs)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_telemetry_intel import MiB, Rig, xe_fdinfo

from arcsplit.node.agent import Agent
from arcsplit.rig import Host
from arcsplit.proc.spec import ProcessSpec
from arcsplit.run.remote import NodeSession, RemoteMember
from arcsplit.telemetry import STALE_AFTER, Telemetry
from arcsplit.telemetry.cpu import RemoteSampler
from arcsplit.telemetry.intel import IntelSampler


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


# -- the cards of another host: its agent samples them with the local samplers, the main host matches them ----------

A, B = "0000:03:00.0", "0000:08:00.0"  # host b's two Intel cards, in PCI order


class _Child:
    """What Agent.stats reads of a Child: alive, pid (this test process, so psutil can read it)."""

    alive = True
    pid = os.getpid()


def _agent(rig: Rig, backend: str | None, sent: list[dict[str, Any]]) -> Agent:
    agent = Agent(sent.append, heartbeat=10.0, allow_bind=(), inventory=lambda _b: {}, sys_root=rig.sys,
                  proc_root=rig.proc, nvml=False)
    agent.backend = backend  # as the hello sets it
    agent.children["rpc1"] = _Child()  # type: ignore[assignment]
    return agent


def _rig_b(tmp_path: Path) -> tuple[Rig, Path]:
    """Host b: two xe cards; its rpc-server (pid = this process) holds 3 GiB on A, another process 1 GiB on B."""
    rig = Rig(tmp_path / "b")
    rig.card(1, B)
    rig.card(0, A)
    rig.fd(os.getpid(), 5, "/dev/dri/renderD128", xe_fdinfo(A, 1, 3 * 1024 * 1024, 0, 0, 1_000_000))
    rig.fd(77, 5, "/dev/dri/renderD129", xe_fdinfo(B, 1, 1024 * 1024, 0, 0, 1_000_000))
    return rig, rig.proc / str(os.getpid()) / "fdinfo" / "5"


def test_agent_stats_carry_its_hosts_cards_with_its_childrens_memory(tmp_path):
    rig, fdinfo = _rig_b(tmp_path)
    agent = _agent(rig, "sycl", [])
    first = json.loads(json.dumps(agent.stats()))  # what goes over the wire
    assert first["cpu"]["rpc1"] > 0 and sorted(first["gpus"]) == ["intel"]
    intel = first["gpus"]["intel"]
    assert sorted(intel) == [A, B]  # every Intel card there: the main host picks by pci or PCI order
    assert intel[A]["used"] == 3 * 1024 * MiB and intel[A]["util"] is None  # a rate needs two reports
    assert intel[B]["used"] == 0  # another process's memory is not the group's
    assert intel[A]["total"] == 16 * 1024 * MiB and intel[A]["source"] == "xe"
    fdinfo.write_text(xe_fdinfo(A, 1, 3 * 1024 * 1024, 1_000_000, 0, 5_000_000))  # rcs busy 1e6 of 4e6 cycles
    assert agent.stats()["gpus"]["intel"][A]["util"] == pytest.approx(0.25)


def test_agent_stats_have_no_gpus_without_a_sampler_children_or_a_working_read(tmp_path, monkeypatch):
    rig, _ = _rig_b(tmp_path)
    assert "gpus" not in _agent(rig, "cpu", []).stats()  # a CPU group's cards are its processes
    assert "gpus" not in _agent(rig, None, []).stats()  # an older client's hello names no backend
    assert "gpus" not in _agent(rig, "cuda", []).stats()  # NVML off (no package, no driver): nothing, no error
    idle = _agent(rig, "sycl", [])
    idle.children.clear()
    assert "gpus" not in idle.stats()

    def broken(self: IntelSampler, indices: object, pids: object) -> None:
        raise PermissionError("sysfs went away")

    monkeypatch.setattr(IntelSampler, "sample", broken)
    stats = _agent(rig, "sycl", []).stats()
    assert "gpus" not in stats and "rpc1" in stats["cpu"]  # the report goes on without the cards


def _plan_status(proc: dict[str, Any], cards: list[dict[str, Any]]) -> dict[str, Any]:
    route = [{"position": i, "holder": "rpc1"} for i in range(len(cards))]
    return {"state": "ready", "processes": {"rpc1": {**proc, "role": "rpc", "restarts": 0}},
            "plan": {"cards": cards}, "route": {"cards": route}}


def _sample(status: dict[str, Any], rig: Rig | None = None) -> list[dict[str, Any]]:
    async def one() -> list[dict[str, Any]]:
        tel = Telemetry(sys_root=rig.sys, proc_root=rig.proc, nvml=False) if rig else Telemetry(nvml=False)
        try:
            return (await tel.sample(status))["cards"]
        finally:
            await tel.aclose()

    return anyio.run(one)


def test_a_remote_card_row_is_its_agents_report(tmp_path):
    """Agent stats -> NodeSession._on_line -> the member's snapshot -> Telemetry: b's rows, not this machine's."""
    rig, fdinfo = _rig_b(tmp_path)
    agent = _agent(rig, "sycl", [])
    agent.stats()
    fdinfo.write_text(xe_fdinfo(A, 1, 3 * 1024 * 1024, 1_000_000, 0, 5_000_000))
    line = json.dumps(agent.stats())
    here = Rig(tmp_path / "here")  # this machine's own Intel card, which the remote cards must not be read from
    here.card(0, "0000:c1:00.0")

    async def snapshot() -> dict[str, Any]:
        session = NodeSession(Host("b", "me@b"), ["true"])
        member = RemoteMember(session, ProcessSpec(name="rpc1", role="rpc", argv=("rpc-server",), env=(),
                                                   host="127.0.0.1", port=50052, cards=(0, 1), node="b"),
                              log_path=None, on_line=lambda *_: None, on_exit=lambda _m: None, ring=deque())
        member.pid = 4242
        session._on_line(session._child, line)
        assert session.gpus is not None and session.gpus.at == pytest.approx(time.time(), abs=5)
        return dict(member.snapshot())

    snap = anyio.run(snapshot)
    assert snap["usage"]["cpu_s"] > 0 and sorted(snap["gpus"]["intel"]) == [A, B]
    cards = [{"device": "RPC0", "backend": "sycl", "index": 1, "pci": A, "host": "b", "free": 1},  # by pci
             {"device": "RPC1", "backend": "sycl", "index": 1, "pci": None, "host": "b", "free": 1}]  # 2nd by PCI
    rows = _sample(_plan_status(snap, cards), here)
    assert [(r["holder"], r["source"], r["used"], r["util"]) for r in rows] == [
        ("rpc1", "xe", 3 * 1024 * MiB, pytest.approx(0.25)), ("rpc1", "xe", 0, None)]
    assert [r["pdev"] for r in rows] == [A, B]


def test_an_old_or_missing_gpu_report_is_no_reading():
    cuda = {"source": "nvml", "used": 5 << 30, "total": 24 << 30, "util": 0.9, "temp": 70.0, "power": 250.0}
    card = [{"device": "RPC0", "backend": "cuda", "index": 1, "pci": None, "host": "b", "free": 1}]
    proc = {"state": "ready", "pid": 4242, "host": "b"}
    fresh = {**proc, "gpus": {"intel": {}, "cuda": {"1": cuda}, "at": time.time() - 1}}
    assert _sample(_plan_status(fresh, card))[0] == {"pos": 0, "device": "RPC0", "backend": "cuda",
                                                     "holder": "rpc1", **cuda}  # by the card's CUDA index there
    old = {**proc, "gpus": {"intel": {}, "cuda": {"1": cuda}, "at": time.time() - STALE_AFTER - 1}}
    for status in (old, proc):  # five missed reports, or none: not the last numbers as if they were now
        (row,) = _sample(_plan_status(status, card))
        assert row["source"] is None and "used" not in row, row
