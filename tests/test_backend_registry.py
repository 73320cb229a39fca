"""Adding a backend is one registry entry: a ROCm-like backend registered here (``backends.register``, removed after
each test) is picked up by detection, the runtime check, the route, the CLI's choices, telemetry on this machine and
the node agent's card reports on another host, without any other file naming it. AMD cards cannot run here, so its
sampler is a fake one (``FakeAmdSampler``: fixed readings by card index); every other part is the real code."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import anyio
import pytest

from arcsplit import backends
from arcsplit.cli import build_parser
from arcsplit.errors import ArcsplitError
from arcsplit.llama import detect
from arcsplit.llama.facts import CardFact
from arcsplit.llama.mode import choose_mode
from arcsplit.llama.runtime import probe_modes
from arcsplit.modes import Mode
from arcsplit.node.agent import Agent
from arcsplit.node.ops import hello_args
from arcsplit.rig import Host
from arcsplit.route import Route
from arcsplit.proc.spec import ProcessSpec
from arcsplit.proc.wire import PROTO, Hello
from arcsplit.run.remote import NodeSession, RemoteMember
from arcsplit.samples import CardSample
from arcsplit.telemetry import Telemetry

GiB = 1 << 30


class FakeAmdSampler:
    """A CardSampler for cards that do not exist here: card i uses i GiB of 16, at 10*i % busy."""

    kind: ClassVar[str] = "amd"
    made: ClassVar[int] = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.closed = False

    @classmethod
    def create(cls, sys_root: Path, proc_root: Path, nvml: bool) -> "FakeAmdSampler":
        return cls()

    @property
    def available(self) -> bool:
        return True

    def sample(self, indices: Sequence[int] | None, pids: Iterable[int]) -> dict[str, CardSample]:
        return {str(i): CardSample(source="fake-amd", used=i * GiB, total=16 * GiB, util=i / 10)
                for i in (range(3) if indices is None else indices)}

    @staticmethod
    def match(card: Mapping[str, Any], pos: int, rows: Mapping[str, CardSample]) -> CardSample | None:
        return rows.get(str(card.get("index", pos)))

    def close(self) -> None:
        self.closed = True


ROCM = backends.Backend(
    name="rocm", label="ROCm", prefix="ROCm", visibility_var="HIP_VISIBLE_DEVICES",
    cmake_flags=("-DGGML_HIP=ON",), toolchain=(("cmake", "apt-get install cmake"), ("hipcc", "install ROCm")),
    vendors=("amd",), sampler=f"{__name__}:FakeAmdSampler", library="libggml-hip.so",
    probe_modes=(Mode.MULTI, Mode.HYBRID), probe_by_default=True)


@pytest.fixture
def rocm() -> Iterator[backends.Backend]:
    backends.register(ROCM)
    try:
        yield ROCM
    finally:
        backends.unregister(ROCM.name)
    assert "rocm" not in backends.names()


def test_detection_picks_the_registered_backend_for_its_cards(rocm, tmp_path):
    amd = CardFact("card1", "1002:744c", "0000:03:00.0", "amdgpu", "amd", None)
    choice = detect.decide(detect.DetectFacts(cards=(amd,), usable=("rocm",)))
    assert choice.backend == "rocm" and "a ROCm build" in choice.reason
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libggml-hip.so").touch()
    assert detect.build_backends(tmp_path / "bin") == ("rocm",)  # a build dir's library names it
    with pytest.raises(ArcsplitError, match="no Vulkan or ROCm build"):  # its label, not a KeyError traceback
        detect.decide(detect.DetectFacts(cards=(amd,), usable=()))


def test_runtime_route_and_mode_follow_its_entry(rocm):
    assert probe_modes("rocm", 2) == (Mode.MULTI, Mode.HYBRID) and probe_modes("rocm", 1) == ()
    assert choose_mode("rocm", 2).mode is Mode.MULTI
    route = Route.build("hybrid", "rocm", [0, 2])
    assert route.devices == ["ROCm0", "RPC0"]
    assert dict(route.server.env) == {"HIP_VISIBLE_DEVICES": "0"} and dict(route.rpc[0].env) == {"HIP_VISIBLE_DEVICES": "2"}
    with pytest.raises(Exception, match="multi\\+workaround mode exists only for sycl"):
        Route.build("multi+workaround", "rocm", [0, 1])


def test_the_cli_offers_it_and_forgets_it(rocm):
    for argv in (["devices", "--backend", "rocm"], ["doctor", "--backend", "rocm"], ["llama", "build", "--backend", "rocm"],
                 ["plan", "m.gguf", "--backend", "rocm"]):
        assert build_parser().parse_args(argv).backend == "rocm"
    backends.unregister("rocm")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["devices", "--backend", "rocm"])


def _status(cards: list[dict[str, Any]], proc: dict[str, Any]) -> dict[str, Any]:
    return {"state": "new", "processes": {"server": {**proc, "role": "server", "restarts": 0}},
            "plan": {"cards": cards}, "route": {"cards": [{"position": i, "holder": "server"} for i in range(len(cards))]}}


def _cards(status: dict[str, Any]) -> list[dict[str, Any]]:
    async def one() -> list[dict[str, Any]]:
        tel = Telemetry(nvml=False)
        try:
            return (await tel.sample(status))["cards"]
        finally:
            await tel.aclose()

    return anyio.run(one)


def test_telemetry_reads_its_cards_with_its_sampler(rocm):
    cards = [{"device": "ROCm0", "backend": "rocm", "index": 2}, {"device": "ROCm1", "backend": "rocm", "index": 1}]
    rows = _cards(_status(cards, {"state": "ready", "pid": os.getpid(), "host": ""}))
    assert [(r["source"], r["used"], r["util"]) for r in rows] == [("fake-amd", 2 * GiB, 0.2), ("fake-amd", GiB, 0.1)]


class _Child:
    alive = True
    pid = os.getpid()


def test_the_node_agent_reports_its_cards_and_the_main_host_reads_them(rocm, tmp_path):
    assert hello_args(Hello.of({"op": "hello", "proto": PROTO, "run": "r1", "backend": "rocm"})) == ("r1", "rocm")
    agent = Agent(lambda _m: None, heartbeat=10.0, allow_bind=(), inventory=lambda _b: {}, nvml=False)
    agent.backend = "rocm"  # as the hello sets it
    agent.children["rpc1"] = _Child()  # type: ignore[assignment]
    line = json.dumps(agent.stats())
    assert sorted(json.loads(line)["gpus"]["amd"]) == ["0", "1", "2"]  # every card of its kind there

    async def snapshot() -> dict[str, Any]:
        session = NodeSession(Host("b", "me@b"), ["true"])
        member = RemoteMember(session, ProcessSpec(name="rpc1", role="rpc", argv=("rpc-server",), env=(),
                                                   host="127.0.0.1", port=50052, cards=(0,), node="b"),
                              log_path=None, on_line=lambda *_: None, on_exit=lambda _m: None, ring=deque())
        member.pid = 4242
        session._on_line(session._child, line)
        return member.snapshot().to_dict()

    snap = anyio.run(snapshot)
    status = {"state": "new", "processes": {"rpc1": {**snap, "role": "rpc", "restarts": 0}},
              "plan": {"cards": [{"device": "RPC0", "backend": "rocm", "index": 1, "host": "b"}]},
              "route": {"cards": [{"position": 0, "holder": "rpc1"}]}}
    (row,) = _cards(status)
    assert (row["holder"], row["source"], row["used"]) == ("rpc1", "fake-amd", GiB)
