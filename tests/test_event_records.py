"""Every event kind's typed record, through the real bus (run/bus.py, ZeroMQ): the JSON a subscriber receives is the
JSON arcsplit sent before the records existed (tests/fixtures/bus_events_20c3fe2.json, captured at 20c3fe2 from
plain dicts by tests/fixtures/capture_bus_events_20c3fe2.py, with the same values)."""

from __future__ import annotations

import json
from pathlib import Path

from _bus_wire import through_bus

from arcsplit.proc.states import GroupState, MemberState
from arcsplit.run.events import (BuffersData, CardLoad, Event, GroupBackoff, GroupData, GroupReady, GroupStarting,
                                 HostData, LogData, Payload, PlanData, ProgressData, StateData, TelemetryData,
                                 TelemetryError, Usage, VerdictData)
from arcsplit.samples import CardRow, CardSample, DrmDetail, GpuReport

GOLDEN = Path(__file__).parent / "fixtures" / "bus_events_20c3fe2.json"
T = 1_700_000_000.25
DRM = DrmDetail(card="card1", pdev="0000:03:00.0", resident=512, freq=2000, freq_max=2400,
                temps={"pkg": 55.0, "vram": 60.0}, clients=1)
INTEL = CardSample(source="xe", used=1024, total=4096, util=0.5, temp=55.0, power=90.5, drm=DRM)
NV = CardSample(source="nvml", used=2048, total=8192, util=0.25, temp=40.0, power=120.0)
CPU = CardSample(source="psutil", used=3000, total=9000, util=0.75)
SNAP = StateData(state=MemberState.READY, pid=4242, port=50052, endpoint="127.0.0.1:50052", returncode=None,
                 uptime=1.5, argv=("rpc-server", "-p", "50052"), paused=False, host="")
BUFFERS = BuffersData(cards=({"device": "RPC0", "plan": {"model": 10, "KV": 2, "compute": 3}, "actual": {"model": 11}},),
                      host={"model": 5}, plan_host=6)


def _records() -> list[tuple[str, Payload]]:
    remote = StateData(**{**SNAP.__dict__, "state": MemberState.STARTING, "host": "b", "uptime": None,
                          "usage": Usage(cpu_s=12.5, rss=1000, threads=4, at=T),
                          "gpus": GpuReport({"intel": {"0000:03:00.0": INTEL}, "cuda": {"0": NV}}, T)})
    exited = StateData(**{**SNAP.__dict__, "state": MemberState.EXITED, "pid": None, "returncode": -9,
                          "uptime": None, "paused": True})
    telemetry = TelemetryData(time=T, cards=(
        CardRow(0, "CPU", "cpu", "rpc0", CPU), CardRow(1, "SYCL0", "sycl", "server", INTEL),
        CardRow(2, "CUDA0", "cuda", "server", NV), CardRow(3, "RPC1", "cuda", "rpc1")),
        processes={"rpc0": {"pid": 4242, "cpu": 12.0, "rss": 3000, "threads": 2},
                   "rpc1": {"pid": 77, "cpu": None, "rss": 5, "threads": 3, "host": "b"}},
        server={"up": True, "metrics": {"prompt_tokens_total": 3.0}, "slots": [{"id": 0}]})
    return [
        ("group", PlanData(plan={"cards": [{"device": "RPC0", "layers": 3}], "model": "m.gguf"}, mode="hybrid")),
        ("group", GroupStarting(generation=1)),
        ("rpc0", SNAP), ("rpc1", remote), ("rpc0", exited),
        ("b", HostData(ssh="user@b", opened_s=0.25, generation=1, started_s=None)),
        ("c", HostData(ssh="c", opened_s=1.5, generation=2, started_s=0.125)),
        ("server", LogData("llama_model_loader: loaded")),
        ("server", ProgressData(stage="model", value=0.5, cards=(CardLoad(0, 10, 20), CardLoad(None, 1, 2)))),
        ("group", GroupReady(url="http://127.0.0.1:8080", buffers=BUFFERS.to_dict(), notes=("a link on TCP",))),
        ("group", BUFFERS),
        ("group", VerdictData(failed_mode="multi", failure="multi_device_alloc", message="failed to allocate",
                              fallback="hybrid")),
        ("group", GroupBackoff(delay=0.5, failures=1, error="rpc0 exited")),
        ("group", telemetry),
        ("group", TelemetryError(time=T, error="OSError: boom")),
        ("group", GroupData(GroupState.STOPPING)),
        ("group", GroupData(GroupState.STOPPED)),
    ]


def test_every_event_record_sends_the_json_it_sent_as_a_dict(tmp_path):
    events = [Event(data.kind, name, data, T) for name, data in _records()]
    got = through_bus(events, tmp_path)
    want = json.loads(GOLDEN.read_text())
    assert [m["kind"] for m in got] == [m["kind"] for m in want]
    for sent, received, golden in zip(events, got, want):
        assert received == golden, sent.kind
        assert dict(sent.data) == golden["data"]  # the record reads like its wire object, for in-process callers
    assert {m["kind"] for m in got} >= {"state", "log", "plan", "buffers", "group", "progress", "verdict", "telemetry",
                                        "host"}


def test_a_record_reads_like_its_wire_object_for_the_api():
    ready = GroupReady(url="http://x", buffers={}, notes=())
    assert ready["state"] == "ready" and ready.get("url") == "http://x" and "delay" not in ready
    assert Event.of("group", ready).kind == "group" and Event.of("rpc0", SNAP).kind == "state"
    assert SNAP.get("argv") == ["rpc-server", "-p", "50052"] and "usage" not in SNAP


def test_a_sample_row_round_trips_through_its_wire_form():
    for sample in (INTEL, NV, CPU, CardSample(None)):
        assert CardSample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    report = GpuReport({"cuda": {"1": NV}, "amd": {"x": CPU}}, T)
    wire = json.loads(json.dumps(report.to_dict()))
    assert wire["intel"] == {} and wire["at"] == T  # both shipped kinds always present, as before
    assert GpuReport.from_dict(wire).rows["amd"] == {"x": CPU}
