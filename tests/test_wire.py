"""The node wire protocol's one module (arcsplit/proc/wire.py): what the supervisor sends is what the agent's
dispatcher hands its handler, the JSON lines are the ones docs/multihost.md shows, and an op out of order or
unknown reaches the handler's refusal (the agent's error, node/quick.py's hand-over)."""

from __future__ import annotations

from typing import Any

import pytest

from arcsplit.proc import wire


class Recorder:
    """A wire.Handler that returns what it was called with."""

    def __init__(self, greeted: bool) -> None:
        self.greeted = greeted

    def ping(self, op: wire.Ping) -> Any:
        return op

    hello = ports = start = stop = ping

    def refuse(self, op: object, why: str, fix: str) -> Any:
        return ("refused", why, fix)


OPS = [wire.Ping(), wire.Hello("run-1", "cuda"), wire.Hello("run-2"), wire.Ports(2, "127.0.0.1", None, [50052]),
       wire.Ports(1, "10.0.0.2", [50060]), wire.Start({"name": "rpc0", "argv": ["ggml-rpc-server", "-p", "1"]}),
       wire.Stop("rpc0", 2.0)]


@pytest.mark.parametrize("op", OPS, ids=lambda o: type(o).__name__)
def test_an_op_crosses_the_wire_as_the_same_record(op):
    got = wire.dispatch(wire.decode(wire.encode(op.msg())), Recorder(greeted=True))
    assert got == op


def test_the_json_on_the_wire_is_unchanged():
    assert wire.Hello("r", "sycl").msg() == {"op": "hello", "run": "r", "proto": wire.PROTO, "backend": "sycl"}
    assert wire.Hello("r").msg() == {"op": "hello", "run": "r", "proto": wire.PROTO}
    assert wire.Ports(2, "127.0.0.1", [1, 2], [3]).msg() == {"op": "ports", "n": 2, "bind": "127.0.0.1", "want": [1, 2]}
    assert wire.Stop("rpc1", 10.0).msg() == {"op": "stop", "name": "rpc1", "grace": 10.0}
    assert wire.encode(wire.Ping().msg()) == b'{"op":"ping"}\n'
    assert wire.error("rpc0", "no") == {"ev": "error", "name": "rpc0", "message": "no"}


def test_every_event_the_agent_writes_is_a_named_event_and_encodes_as_its_plain_name():
    events = [wire.hello(None, None), wire.ports([1]), wire.started("rpc0", 1, 0.0), wire.line("rpc0", "x"),
              wire.ready("rpc0"), wire.exited("rpc0", 0), wire.error("rpc0", "no"), wire.pong(),
              wire.stats({}, {}, {}, [])]
    assert [type(e["ev"]) for e in events] == [wire.Ev] * len(events)  # run/remote.py reads back these names
    assert {e["ev"] for e in events} == set(wire.Ev)
    assert wire.encode(wire.exited("rpc0", 3)) == b'{"ev":"exit","name":"rpc0","returncode":3}\n'


def test_only_ping_and_hello_come_before_hello():
    before = Recorder(greeted=False)
    assert wire.dispatch({"op": "ping"}, before) == wire.Ping()
    assert wire.dispatch({"op": "hello", "run": "r", "proto": 1}, before) == wire.Hello("r", None, 1)
    assert wire.dispatch({"op": "start", "spec": {}}, before) == ("refused", "'start' before hello", "send hello first")
    assert wire.dispatch({"op": "reboot"}, Recorder(greeted=True))[1] == "unknown op 'reboot'"


def test_a_bad_field_or_line_raises_for_the_agent_to_report():
    with pytest.raises(ValueError):
        wire.decode(b"[1, 2]")
    with pytest.raises(ValueError):
        wire.dispatch({"op": "ports", "n": "many"}, Recorder(greeted=True))
    assert wire.Start.of({"op": "start", "spec": "rpc0"}).spec is None  # not an object: the agent refuses it
    assert wire.subject({"op": "start", "spec": {"name": "rpc3"}}) == "rpc3" and wire.subject({"op": "ports"}) == ""


def test_an_op_is_a_frozen_record_equal_only_to_its_own_kind():
    op = wire.Ports(2, "127.0.0.1")
    with pytest.raises(AttributeError):
        op.n = 3  # type: ignore[misc]
    assert op == wire.Ports(2) and op != wire.Ports(3) and wire.Stop("a", 1.0) != wire.Hello("a", 1.0)
    assert repr(wire.Stop("rpc0")) == "Stop(name='rpc0', grace=10.0)" and len({wire.Ping(), wire.Ping()}) == 1
