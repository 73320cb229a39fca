"""The node wire protocol: JSON lines between a supervisor (run/remote.py) and a node agent (node/).

One owner for both ends: the ops a client sends (typed records that encode to the JSON on the wire), the one
:func:`dispatch` that routes a decoded op to the agent's handler (node/quick.py before anyio is imported,
node/agent.py after: each is a :class:`Handler`), and the events the agent answers with. Its own module, standard
library only, so both ends import it without importing each other, and the agent on every other host reads it
before it can say hello. docs/multihost.md describes each message.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .spec import LOOPBACK

PROTO = 1  # bumped when a message changes meaning; hello refuses another value
OPS = ("hello", "ports", "start", "stop", "ping")

Msg = dict[str, Any]


class Ev(StrEnum):
    """The events the agent answers with (a message's "ev"): named here once, for the agent that writes them
    and the supervisor (run/remote.py) that reads them back. A member is its string on the wire."""

    HELLO = "hello"
    PORTS = "ports"
    STARTED = "started"
    LINE = "line"
    READY = "ready"
    EXIT = "exit"
    ERROR = "error"
    PONG = "pong"
    STATS = "stats"


def encode(msg: Mapping[str, Any]) -> bytes:
    """One message as its line on the wire."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(raw: bytes) -> dict[str, Any]:
    """One line from the wire; ValueError when it is not a JSON object."""
    msg = json.loads(raw)
    if not isinstance(msg, dict):
        raise ValueError("not an object")
    return msg


def _integer(msg: Mapping[str, Any], key: str, default: int) -> int:
    """An integer field; ValueError naming the op and the field otherwise (not Python's "invalid literal")."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"protocol error: {msg.get('op')}: {key} = {json.dumps(value)} is not an integer")
    return value


def _ports(msg: Mapping[str, Any], key: str) -> list[int] | None:
    """A list of port numbers, or None when absent; ValueError naming the op and the field otherwise."""
    value = msg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        raise ValueError(f"protocol error: {msg.get('op')}: {key} = {json.dumps(value)} is not a list of ports")
    return value


def _seconds(msg: Mapping[str, Any], key: str, default: float) -> float:
    """A duration field: a finite number 0-3600 (NaN fails the range); ValueError naming the field otherwise."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"protocol error: {msg.get('op')}: {key} = {json.dumps(value)} is not seconds 0-3600")
    return float(value)


# -- client -> node: the ops ---------------------------------------------------------------------------------------

class _Op:
    """A frozen record of its ``__slots__`` (equal by type and fields), written out rather than a dataclass: the
    node agent builds these classes on every start, before its first answer, and dataclasses' generated code costs
    ~0.4 ms a class there."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, *values: Any) -> None:
        for slot, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, slot) for slot in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, *map(repr, self._fields())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in zip(self.__slots__, self._fields()))})"


class Ping(_Op):
    """Any message counts as a ping; this one is answered with ``pong``."""

    __slots__ = ()

    def msg(self) -> Msg:
        return {"op": "ping"}


class Hello(_Op):
    """Open a run on the node: sweep, run dir, inventory. ``backend``: the group's (that build's rpc-server)."""

    __slots__ = ("run", "backend", "proto")
    run: str
    backend: str | None
    proto: Any

    def __init__(self, run: str, backend: str | None = None, proto: Any = PROTO) -> None:
        super().__init__(run, backend, proto)

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Hello:
        return cls(run=str(msg.get("run", "")), backend=msg.get("backend"), proto=msg.get("proto"))

    def msg(self) -> Msg:
        msg: Msg = {"op": "hello", "run": self.run, "proto": self.proto}
        return {**msg, "backend": self.backend} if self.backend else msg


class Ports(_Op):
    """``n`` ports free on the node for ``bind``: ``want`` exactly these, else ``prefer`` these where free."""

    __slots__ = ("n", "bind", "want", "prefer")
    n: int
    bind: str
    want: Sequence[Any] | None
    prefer: Sequence[Any]

    def __init__(self, n: int, bind: str = LOOPBACK, want: Sequence[Any] | None = None,
                 prefer: Sequence[Any] = ()) -> None:
        super().__init__(n, bind, want, prefer)

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Ports:
        return cls(n=_integer(msg, "n", 1), bind=str(msg.get("bind", LOOPBACK)), want=_ports(msg, "want"),
                   prefer=msg.get("prefer") or ())

    def msg(self) -> Msg:
        out: Msg = {"op": "ports", "n": self.n, "bind": self.bind}
        if self.want:
            out["want"] = list(self.want)
        elif self.prefer:
            out["prefer"] = list(self.prefer)
        return out


class Start(_Op):
    """Run one rpc-server: ``spec`` as the client wrote it (node/ops.py checks every field); None: not an object."""

    __slots__ = ("spec",)
    spec: Mapping[str, Any] | None

    def __init__(self, spec: Mapping[str, Any] | None) -> None:
        super().__init__(spec)

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Start:
        spec = msg.get("spec")
        return cls(spec if isinstance(spec, dict) else None)

    @property
    def name(self) -> str:
        return str((self.spec or {}).get("name", ""))

    def msg(self) -> Msg:
        return {"op": "start", "spec": dict(self.spec or {})}


class Stop(_Op):
    """Stop one rpc-server (SIGTERM, SIGKILL after ``grace`` s)."""

    __slots__ = ("name", "grace")
    name: str
    grace: float

    def __init__(self, name: str, grace: float = 10.0) -> None:
        super().__init__(name, grace)

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Stop:
        return cls(name=str(msg.get("name", "")), grace=_seconds(msg, "grace", 10.0))

    def msg(self) -> Msg:
        return {"op": "stop", "name": self.name, "grace": self.grace}


if TYPE_CHECKING:  # start-up: typing's Protocol costs ~1 ms to build, on the node agent's path; only mypy needs it
    from typing import Protocol, TypeVar

    T = TypeVar("T", covariant=True)

    class Handler(Protocol[T]):
        """One phase of the agent: what it does with each op (its return: node/quick.py's "handled", node/agent.py's
        awaitable)."""

        @property
        def greeted(self) -> bool:
            """A hello was answered: the other ops may come."""
            ...

        def ping(self, op: Ping) -> T: ...
        def hello(self, op: Hello) -> T: ...
        def ports(self, op: Ports) -> T: ...
        def start(self, op: Start) -> T: ...
        def stop(self, op: Stop) -> T: ...
        def refuse(self, op: object, why: str, fix: str) -> T: ...


def dispatch(msg: Mapping[str, Any], handler: Handler[T]) -> T:
    """The one place an op name is read: ``msg`` to the handler's method with its typed record (ValueError or
    TypeError from a field that is not what the op needs)."""
    op = msg.get("op")
    if op == "ping":
        return handler.ping(Ping())
    if op == "hello":
        return handler.hello(Hello.of(msg))
    if not handler.greeted:
        return handler.refuse(op, f"{op!r} before hello", "send hello first")
    if op == "ports":
        return handler.ports(Ports.of(msg))
    if op == "start":
        return handler.start(Start.of(msg))
    if op == "stop":
        return handler.stop(Stop.of(msg))
    return handler.refuse(op, f"unknown op {op!r}", f"ops: {', '.join(OPS)}")


def subject(msg: Mapping[str, Any]) -> str:
    """The process an op is about ("" for the session): the name an error answering it carries."""
    if msg.get("op") == "start":
        return Start.of(msg).name
    if msg.get("op") == "stop":
        return str(msg.get("name", ""))
    return ""


# -- node -> client: the events ------------------------------------------------------------------------------------

def hello(inventory: Mapping[str, Any] | None, started_s: float | None) -> Msg:
    """The answer to hello: this host's inventory (llama build, cards), the agent's pid and start time."""
    return {"ev": Ev.HELLO, "proto": PROTO, **(inventory or {}), "pid": os.getpid(), "started_s": started_s}


def ports(got: Sequence[int]) -> Msg:
    return {"ev": Ev.PORTS, "ports": list(got)}


def started(name: str, pid: int | None, create_time: float | None) -> Msg:
    return {"ev": Ev.STARTED, "name": name, "pid": pid, "create_time": create_time}


def line(name: str, text: str) -> Msg:
    """A line of output: of process ``name``, or the agent's own (``name`` "")."""
    return {"ev": Ev.LINE, "name": name, "line": text}


def ready(name: str) -> Msg:
    return {"ev": Ev.READY, "name": name}


def exited(name: str, returncode: int | None) -> Msg:
    return {"ev": Ev.EXIT, "name": name, "returncode": returncode}


def error(name: str, message: str) -> Msg:
    return {"ev": Ev.ERROR, "name": name, "message": message}


def pong() -> Msg:
    return {"ev": Ev.PONG}


def stats(cpu: Mapping[str, float], rss: Mapping[str, int], threads: Mapping[str, int], stopped: Sequence[str],
          gpus: Mapping[str, Any] | None = None) -> Msg:
    """The agent's periodic sample of its processes (by name) and, where it read any, their cards."""
    msg: Msg = {"ev": Ev.STATS, "cpu": dict(cpu), "rss": dict(rss), "threads": dict(threads), "stopped": list(stopped)}
    return {**msg, "gpus": gpus} if gpus else msg
