"""A layout's other hosts, opened before the serving stack is imported (the API side of ``serve``'s warm start).

An ssh login and the node agent's start take ~0.6 s; ``arcsplit serve`` spends about as long importing the serving
stack and planning. This module imports only run/remote (not the supervisor, the bus or the planner), so the CLI
can start the sessions first and plan while they open; the supervisor's first generation greets them.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import anyio

from .rig import Host
from .run.remote import NodeLauncher, same_build


@asynccontextmanager
async def warm_hosts(hosts: Sequence[Host]) -> AsyncIterator[NodeLauncher]:
    """A NodeLauncher whose sessions to ``hosts`` are starting; every one ended on exit, greeted or not. Before
    a group runs on it, name this machine's llama-server with :func:`check_builds`."""
    launcher = NodeLauncher(hosts)
    try:
        async with anyio.create_task_group() as tg:
            await launcher.warm(tg, [h.name for h in hosts])
            try:
                yield launcher
            finally:
                tg.cancel_scope.cancel()
    finally:
        await launcher.close()


def check_builds(launcher: NodeLauncher, server_bin: str) -> None:
    """Each host's hello is checked against this machine's llama.cpp (hosts.check_inventory)."""
    launcher.check = same_build(server_bin)
