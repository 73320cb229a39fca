"""One process to run (a ProcessSpec): the value the specs build, the supervisor and the node agent start.

Its own module, with nothing but the standard library (and netaddr, which the agent reads anyway), because the node agent on every other host imports it
at each start, before it can say hello: decide/specs.py (which builds these from a plan) pulls in the route, the
rig and llama.cpp's flag tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..netaddr import LOOPBACK
from ..roles import Role


@dataclass(frozen=True)
class ProcessSpec:
    """One process to run: what to exec, with which environment, and what it serves."""

    name: str  # "rpc0", "rpc1", ..., "rpc0-link", ..., "server"
    role: Role  # Role.NODE: run/early.py's node agent of a host
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # set on top of the supervisor's environment (the node's, on another host)
    host: str  # the address it listens on, on the machine that runs it
    port: int
    cards: tuple[int, ...]  # positions in plan.cards this process holds
    devices: tuple[str, ...] = ()  # llama-server's name for each of those cards (RPC0, SYCL0, CPU, ...)
    ignore_sigpipe: bool = False
    keep_stdin: bool = False  # llama-server in the router's child protocol: told to exit on stdin
    env_unset: tuple[str, ...] = ()  # removed from the supervisor's environment (llama/childenv.py)
    features_off: tuple[str, ...] = ()  # what this binary lacks, so arcsplit left out (llama/features.py)
    node: str = ""  # the layout host that runs it ("" this machine); a link: the host it forwards to
    connect: str = ""  # what llama-server dials for this rpc-server when not ``endpoint`` (an ssh forward's end)
    term_again: float | None = None  # a stop's second SIGTERM this many seconds after the first (llama-server)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def dial(self) -> str:
        """The --rpc entry of an rpc-server: where llama-server reaches it from this machine."""
        return self.connect or self.endpoint

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def runs_remote(spec: ProcessSpec) -> bool:
    """Whether the process runs on another host (a link names its host but runs here)."""
    return bool(spec.node) and spec.role != Role.LINK
