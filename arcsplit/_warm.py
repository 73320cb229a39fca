"""A layout's other hosts, opened before the serving stack is imported (the API side of ``serve``'s warm start).

An ssh login and the node agent's start take ~0.5 s; ``arcsplit serve`` spends about as long importing the serving
stack and planning. ``cli.main`` asks :func:`layout_hosts` first and, for a layout with other hosts, starts their
sessions (:func:`run_early`, importing only the layout reader and the ssh command lines; anyio comes after the
spawn, while ssh logs in) before it imports anything else; the CLI then imports, parses and plans in a worker
thread while the sessions open, and the supervisor's first generation greets them. run/remote is imported only
by :func:`warm_hosts`.
"""

from __future__ import annotations

import contextlib
import os
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Mapping, Sequence

from .errors import ArcsplitError
from .rig import Host, Rig, load_layout
from .run.early import Early, end, start_sessions

if TYPE_CHECKING:
    from .run.remote import NodeLauncher


@asynccontextmanager
async def warm_hosts(hosts: Sequence[Host], early: Mapping[str, Early] | None = None) -> AsyncIterator[NodeLauncher]:
    """A NodeLauncher whose sessions to ``hosts`` are starting (``early``: those already running, run/early.py);
    every one ended on exit, greeted or not. Before a group runs on it, name this machine's llama-server with
    :func:`check_builds`."""
    import anyio  # start-up: (this whole module) after the ssh sessions are spawned, while they log in

    from .run.remote import NodeLauncher  # start-up: the serving stack, after the sessions are spawned

    launcher = NodeLauncher(hosts)
    async with anyio.create_task_group() as tg:
        try:
            await launcher.warm(tg, [h.name for h in hosts], early)
            yield launcher
        finally:
            await launcher.close()  # the sessions outlast a cancel (remote.NodeSession): closing ends them
            tg.cancel_scope.cancel()


def check_builds(launcher: NodeLauncher, server_bin: str) -> None:
    """Each host's hello is checked against this machine's llama.cpp (hosts.check_inventory)."""
    from .run.remote import same_build  # start-up: as in warm_hosts

    launcher.check = same_build(server_bin)


def layout_hosts(argv: Sequence[str]) -> Rig | None:
    """The layout of ``arcsplit serve ... --layout FILE`` when it names other hosts and the run will serve (not
    --help, not the dashboard's own start); None otherwise, and for a layout that does not load (the CLI then
    reports it as usual)."""
    if argv[:1] != ["serve"] or any(a in ("-h", "--help", "--tui") for a in argv):
        return None
    path = None
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--layout" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--layout="):
            path = a.split("=", 1)[1]
    if path is None:
        return None
    try:
        rig = load_layout(path)
    except (ArcsplitError, OSError):
        return None
    return rig if rig.hosts else None


@dataclass
class EarlyStart:
    """serve's layout and its sessions started before its imports, and what serve will run on them (set by
    cli/serve_run.py, which takes the layout from here instead of reading the file again)."""

    rig: Rig
    sessions: dict[str, Early]
    then: Callable[[], Awaitable[int]] | None = None


def run_early(rig: Rig, dispatch: Callable[[EarlyStart], int]) -> int:
    """Start every host's session, then run ``dispatch`` (the CLI: imports, parsing, checks) in a worker thread
    while this thread's event loop holds the sessions; what serve leaves in ``then`` runs here afterwards, from
    the thread that forked the sessions (their parent-death signal follows it), as a child of this task so that a
    Ctrl-C cancels it in order. A session no launcher took is ended on the way out."""

    start = EarlyStart(rig, start_sessions(rig.hosts))  # before anyio's import: the logins begin meanwhile
    try:
        import anyio  # start-up: after start_sessions, so the logins begin meanwhile
        import anyio.to_thread
    except BaseException:  # a Ctrl-C during the import: the sessions go with it
        for e in start.sessions.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.process.pid, signal.SIGKILL)
        raise

    async def main() -> int:
        try:
            # abandoned on cancel: a Ctrl-C during the imports (asyncio's SIGINT handler cancels this task) ends the
            # run now, as it would during the imports of a plain start
            rc = await anyio.to_thread.run_sync(dispatch, start, abandon_on_cancel=True)
            return rc if start.then is None else await start.then()
        finally:
            for e in start.sessions.values():
                if not e.taken:
                    await end(e)

    return anyio.run(main)
