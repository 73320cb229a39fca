"""Issue 43: the defects a fault run across two hosts found, each through the real code path (real processes; a
network namespace with its own sshd where a second host is needed, tests/_netns.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from arcsplit.errors import HostError
from arcsplit.rig import Host
from arcsplit.run.remote import NodeSession

sys.path.insert(0, str(Path(__file__).parent))


# ---- 1: a transport that dies at once ends every pending request with its reason ---------------------------------

def test_a_transport_that_exits_ends_every_waiting_request_at_once() -> None:
    """The agent's transport exits (its `arcsplit` missing there) while a request holds the session and a second
    waits its turn: both end with the exit's reason, neither waits out its timeout (the second used to install its
    reply event after the exit had set the first one, and waited the whole 60 s of a hello)."""
    dying = [sys.executable, "-c", "import sys, time; time.sleep(0.5); "
             "sys.stderr.write('sh: 1: /opt/nowhere/arcsplit: not found\\n'); sys.exit(127)"]

    async def main() -> list[str]:
        session = NodeSession(Host("b", "me@b"), dying)
        reasons: list[str] = []

        async def ask(op: str) -> None:
            try:
                await session.request({"op": op}, op, 30.0)
            except HostError as exc:
                reasons.append(str(exc))

        async with anyio.create_task_group() as tg:
            await session.spawn(tg)
            with anyio.fail_after(20):  # well under the requests' own 30 s: the fixed code answers in ~0.5 s
                async with anyio.create_task_group() as asks:
                    asks.start_soon(ask, "hello")
                    asks.start_soon(ask, "ports")
            await session.close(2.0)
        return reasons

    reasons = anyio.run(main)
    assert len(reasons) == 2
    for why in reasons:
        assert "node agent on b exited" in why and "not found" in why, why
