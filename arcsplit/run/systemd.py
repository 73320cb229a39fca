"""``arcsplit serve`` as a systemd ``Type=notify`` service: READY=1 once the group first answers /health 200,
WATCHDOG=1 every half ``$WATCHDOG_USEC`` while it is ready, STATUS= on each group change, STOPPING=1 on the way
down. Nothing is sent without ``$NOTIFY_SOCKET``.

The protocol is one datagram per message on the AF_UNIX socket systemd names (sd_notify(3)); it is sent here
directly rather than through the ``sdnotify`` package, which is unmaintained since 2017 and is the same few lines.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping

import anyio
from anyio.abc import TaskStatus

from ..proc.states import GroupState


def notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send one sd_notify message; False when not run by systemd (no $NOTIFY_SOCKET)."""
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError:  # like sd_notify(3): a notification that cannot be sent never stops the service
        return False
    return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of systemd's WatchdogSec), None when no watchdog is meant for us."""
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2e6


async def run_notify(sup: Any, env: Mapping[str, str] = os.environ, *,
                     task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Tell systemd what the group does, until cancelled; started() once subscribed, before the group starts."""
    if not env.get("NOTIFY_SOCKET"):
        task_status.started()
        return
    interval = watchdog_interval(env)
    events = sup.subscribe(1000)
    task_status.started()
    state = {"ready": False}

    async def watchdog() -> None:
        assert interval is not None
        while True:
            if state["ready"]:  # a hung supervisor or a group that cannot come back stops the pings
                notify("WATCHDOG=1", env)
            await anyio.sleep(interval)

    async with anyio.create_task_group() as tg:
        if interval:
            tg.start_soon(watchdog)
        async for ev in events:
            if ev.kind != "group":
                continue
            current = ev.data.get("state")
            state["ready"] = current == GroupState.READY
            if current == GroupState.READY:
                notify(f"READY=1\nSTATUS=serving {sup.url} (mode {sup.config.mode})", env)
            elif current == GroupState.BACKOFF:
                notify(f"STATUS=restarting after: {ev.data.get('error')}", env)
            elif current == GroupState.STARTING:
                notify("STATUS=starting the group", env)
            elif current == GroupState.STOPPING:
                notify("STOPPING=1\nSTATUS=stopping", env)
