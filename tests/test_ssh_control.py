"""Links riding the node agent's ssh (forwards = "shared"): the supervisor's ControlMaster socket, and a SharedLink
over a real sshd in a network namespace: added in one ``ssh -O forward`` without a login, removed on stop while
the session serves on, gone with the session, and a forward that cannot be added is a failed member at once."""

from __future__ import annotations

import socket
import stat
import tempfile
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import anyio
import psutil
import pytest

from arcsplit.hosts import forward_argv
from arcsplit.rig import load_layout
from arcsplit.proc.ports import free_port
from arcsplit.run.early import CONTROL_NAME, control_socket
from arcsplit.run.remote import NodeLauncher, SharedLink
from arcsplit.decide.specs import ProcessSpec

from _netns import NetHarness, unavailable


def test_control_sockets_are_private_fresh_and_the_dead_ones_swept(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="rt", dir=tmp_path.parent))  # short, as $XDG_RUNTIME_DIR/arcsplit is
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(runtime))
    dead, live, other = runtime / "ssh-0000aaaa", runtime / "ssh-1111bbbb", runtime / "ssh-2222cccc.x"
    socks = []
    for where in (dead, live, other):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(where))
        socks.append(s)
    socks[1].listen()  # a master of another run still answers: kept
    socks[0].close()  # a master that was killed left its socket: nothing answers
    socks[2].close()  # not a name of ours (ssh's temporary one while a master starts): left alone
    try:
        path = control_socket()
        assert path is not None and path.parent == runtime and CONTROL_NAME.fullmatch(path.name)
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700 and not path.exists()
        assert not dead.exists() and live.exists() and other.exists()
        assert control_socket() != path
    finally:
        socks[1].close()
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / ("long" * 20)))
    assert control_socket() is None  # too long for a socket: the links log in on their own


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetHarness]:
    why = unavailable()
    if why:
        pytest.skip(why)
    with NetHarness(tmp_path_factory.mktemp("net"), ("b",)) as harness:
        yield harness


def _listener(port: int) -> int | None:
    """The pid listening on 127.0.0.1:``port`` here, or None."""
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


@pytest.mark.slow
def test_a_link_rides_the_agents_ssh_and_ends_with_it(net: NetHarness, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", tempfile.mkdtemp(prefix="rt", dir=tmp_path.parent))
    layout = net.layout(tmp_path / "l.toml", [("", 300), ("b", 300)])
    (host,) = load_layout(layout).hosts
    exits: list[Any] = []

    def link(name: str, local: int) -> ProcessSpec:
        return ProcessSpec(name=name, role="link", argv=tuple(forward_argv(host, local, free_port())), env=(),
                           host="127.0.0.1", port=local, cards=(), node="b")

    async def main() -> None:
        launcher = NodeLauncher([host])
        async with anyio.create_task_group() as tg:
            await launcher.open(tg, "ctl-test", ["b"])
            session = launcher.sessions["b"]
            assert session.control is not None and session._child.pid

            def member(spec: ProcessSpec) -> SharedLink:
                m = launcher.member(spec, log_path=None, on_line=lambda *_: None, on_exit=exits.append,
                                    ring=deque(maxlen=50))
                assert isinstance(m, SharedLink) and m.spec.argv[-5:-3] == ("-O", "forward")
                return m

            first = member(link("rpc0-link", free_port()))
            await tg.start(first.run)
            assert first.alive and _listener(first.spec.port) == session._child.pid  # the agent's ssh holds it
            await first.stop(2.0)
            assert first.returncode == 0 and _listener(first.spec.port) is None and session.dead is None

            with socket.socket() as busy:  # a port taken here: the forward is refused, the member exits at once
                busy.bind(("127.0.0.1", 0))
                busy.listen()
                refused = member(link("rpc1-link", busy.getsockname()[1]))
                await tg.start(refused.run)
                assert refused.done.is_set() and refused.returncode and refused.returncode != 0
                assert any("forwarding" in line for line in refused.lines), list(refused.lines)

            again = member(link("rpc2-link", free_port()))
            await tg.start(again.run)
            assert again.alive
            (agent,) = [p for p in net.processes("b") if "node" in p.cmdline() and "--stdio" in p.cmdline()]
            agent.kill()  # the session ends: so does every forward it carried
            with anyio.fail_after(15):
                await again.done.wait()
            assert again.returncode == 255 and "node agent on b exited" in again.lines[-1]
            assert _listener(again.spec.port) is None
            await launcher.close()
            tg.cancel_scope.cancel()
        assert session.control is not None and not session.control.exists()

    anyio.run(main)
    assert [m.spec.name for m in exits] == ["rpc0-link", "rpc1-link", "rpc2-link"]
