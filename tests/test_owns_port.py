"""proc/ports.owns_port: whether a process itself listens on a port (issue 43: another local user could bind a
starting rpc-server's port first, and a connect would be answered by that listener). Real sockets and processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from arcsplit.proc import ports


@pytest.fixture
def other_listener():
    """A child process listening on a loopback port of its own: (its pid, the port)."""
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    port = int(child.stdout.readline())
    yield child.pid, port
    child.kill()
    child.wait()


def test_a_process_owns_its_own_listener_and_not_another_ones(other_listener):
    other_pid, other_port = other_listener
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ports.owns_port(os.getpid(), port, "127.0.0.1")
        assert ports.owns_port(os.getpid(), port)  # host not known: either family
        assert not ports.owns_port(os.getpid(), port, "::1")  # its family only
        assert not ports.owns_port(other_pid, port, "127.0.0.1")  # someone else's listener
    assert ports.owns_port(other_pid, other_port, "127.0.0.1")
    assert not ports.owns_port(os.getpid(), other_port, "127.0.0.1")
    assert ports.owns_port(None, other_port)  # no process of its own: a forward that said it bound the port


def test_a_connected_socket_on_the_port_is_not_a_listener(other_listener):
    """Only a LISTEN socket counts: a client connected to the port (same local port number on its peer's side) does
    not make the client the owner."""
    _, port = other_listener
    with socket.create_connection(("127.0.0.1", port)):
        assert not ports.owns_port(os.getpid(), port, "127.0.0.1")


def test_nobody_listening_is_no(other_listener):
    free = ports.free_port("127.0.0.1")
    assert not ports.owns_port(os.getpid(), free, "127.0.0.1")
    assert not ports.owns_port(other_listener[0], free)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_an_ipv6_listener():
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
    except OSError:
        pytest.skip("no ::1 on this machine")
    with s:
        s.listen()
        port = s.getsockname()[1]
        assert ports.owns_port(os.getpid(), port, "::1")
        assert not ports.owns_port(os.getpid(), port, "127.0.0.1")


def test_without_netlink_psutil_answers_the_same(other_listener, monkeypatch):
    """Where sock_diag cannot be asked (a kernel or sandbox without it), the answer comes from psutil's /proc tables."""
    pid, port = other_listener
    monkeypatch.setattr(ports, "_listening_inodes", lambda port, families: None)
    assert ports.owns_port(pid, port, "127.0.0.1")
    assert not ports.owns_port(os.getpid(), port, "127.0.0.1")
