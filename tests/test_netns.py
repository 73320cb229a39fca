"""The several-hosts test bed itself (tests/_netns.py), for real: a network namespace joined by a veth pair, Debian's
sshd inside it, the real ggml-rpc-server CPU build. What issue 15's transport relies on: an rpc-server bound to
127.0.0.1 on a host is unreachable from the main host except through an ``ssh -N -L`` forward; BatchMode ssh with
StrictHostKeyChecking refuses a host key that does not match; nothing of the bed outlives it."""

from __future__ import annotations

import contextlib
import pwd
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _netns import NetHarness, namespaces, ns_pids, sweep_stale, unavailable  # noqa: E402
from _procs import dead, wait_until  # noqa: E402

from arcsplit.llama.locate import LlamaBinaries  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow

RPC_CMD_HELLO = 14  # ggml-rpc.cpp: static_assert(RPC_CMD_HELLO == 14), "must be always 14"
RPC_CONN_CAPS_SIZE = 24  # ggml-rpc/transport.h


def rpc_hello(host: str, port: int, timeout: float = 5.0) -> tuple[int, int, int]:
    """ggml RPC's HELLO: | cmd (1 byte) | size (8 bytes LE) | rpc_msg_hello_req |, answered by | size | major,
    minor, patch, pad, caps |. Proves an rpc-server itself answered, not just that something accepted a TCP
    connection (an ssh forward accepts locally before the remote end exists)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
        data = b""
        while len(data) < 8 + 4 + RPC_CONN_CAPS_SIZE:
            chunk = s.recv(64)
            if not chunk:
                raise ConnectionError(f"{host}:{port} closed the connection after {len(data)} bytes")
            data += chunk
    (size,) = struct.unpack("<Q", data[:8])
    assert size == 4 + RPC_CONN_CAPS_SIZE, size
    return data[8], data[9], data[10]


@contextlib.contextmanager
def popen(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(10)


def test_ssh_runs_commands_inside_the_remote_namespace(net: NetHarness) -> None:
    b = net.host("b")
    r = net.run("b", ["ip", "netns", "identify"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b.ns
    addrs = net.run("b", ["ip", "-o", "-4", "addr", "show"]).stdout
    assert f"inet {b.addr}/30" in addrs and b.main_addr not in addrs
    # the host's arcsplit is this checkout's, with its own state dir
    r = net.run("b", [str(b.arcsplit), "--version"])
    assert r.returncode == 0, r.stderr
    assert str(b.state_dir) in b.arcsplit.read_text()


def test_the_remote_login_shell_reads_a_stock_bashrc_and_this_machines_stays(net: NetHarness) -> None:
    """Every ssh command runs the login shell's rc: host b gets a fresh host's (Debian's skeleton), not this
    machine's (here ``pyenv init``, 0.3 s per command), and only inside its namespace."""
    rc = Path(pwd.getpwnam("root").pw_dir) / ".bashrc"
    if Path(pwd.getpwnam("root").pw_shell).name != "bash" or not rc.is_file():
        pytest.skip("root's login shell is not bash with a ~/.bashrc: nothing to replace")
    mine = rc.read_bytes()
    seen = net.run("b", ["cat", str(rc)])
    assert seen.returncode == 0, seen.stderr
    skel = Path("/etc/skel/.bashrc")
    assert seen.stdout.encode() == (skel.read_bytes() if skel.is_file() else b"")
    assert rc.read_bytes() == mine  # the bind mount is private to b's namespace
    # the shell sshd starts for a command is non-interactive: the stock rc returns at once, so nothing it sets is set
    assert net.run("b", ["sh", "-c", "echo ${PYENV_ROOT:-unset}"]).stdout.strip() == "unset"


def test_loopback_rpc_server_is_reachable_only_through_an_ssh_forward(net: NetHarness,
                                                                     llama_bins: LlamaBinaries) -> None:
    b = net.host("b")
    port = free_port()  # free here too, so a refusal on 127.0.0.1 below is not someone else's listener
    with popen(net.ns_argv("b", [str(llama_bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"])) as rpc:
        wait_until(lambda: ("127.0.0.1", port, "ggml-rpc-server") in net.listening("b")
                 or rpc.poll() is not None, 30, "the rpc-server to listen in the namespace")
        assert rpc.poll() is None, rpc.stdout.read() if rpc.stdout else ""
        assert [row for row in net.listening("b") if row[1] == port] == [("127.0.0.1", port, "ggml-rpc-server")]
        # From the main host: neither its own loopback nor the host's veth address reaches it.
        for addr in ("127.0.0.1", b.addr):
            with pytest.raises(ConnectionRefusedError):
                rpc_hello(addr, port)
        # Through `ssh -N -L` (what a link="ssh" member runs): a real RPC HELLO answers with the protocol version.
        local = free_port()
        fwd = ["ssh", "-F", str(net.ssh_config), "-N", "-o", "ExitOnForwardFailure=yes",
               "-L", f"127.0.0.1:{local}:127.0.0.1:{port}", "b"]
        with popen(fwd) as ssh:
            def answered() -> bool:
                assert ssh.poll() is None, ssh.stdout.read() if ssh.stdout else ""
                try:
                    return rpc_hello("127.0.0.1", local, timeout=2)[0] > 0
                except OSError:
                    return False
            wait_until(answered, 20, "an RPC HELLO through the forward")
            major, minor, patch = rpc_hello("127.0.0.1", local)
            assert major >= 1, (major, minor, patch)


def test_host_key_mismatch_fails_in_batch_mode_with_a_clear_message(net: NetHarness, tmp_path: Path) -> None:
    b = net.host("b")
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = tmp_path / "known_hosts_wrong"
    kind, key = (other.with_suffix(".pub")).read_text().split()[:2]
    wrong.write_text(f"[{b.addr}]:{b.ssh_port} {kind} {key}\n")
    t0 = time.monotonic()
    r = subprocess.run(net.ssh_argv("b", ["true"], known_hosts=wrong), capture_output=True, text=True, timeout=30,
                       stdin=subprocess.DEVNULL)
    assert time.monotonic() - t0 < 20  # BatchMode: no prompt waits for a human
    assert r.returncode == 255
    assert "Host key verification failed." in r.stderr
    # An unknown host (empty known_hosts) is refused the same way, never accepted on first use.
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    r = subprocess.run(net.ssh_argv("b", ["true"], known_hosts=empty), capture_output=True, text=True, timeout=30,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 255 and "Host key verification failed." in r.stderr
    assert empty.read_text() == ""
    # the right file still works: the failure was the key, not the bed
    assert net.run("b", ["true"]).returncode == 0


def test_close_leaves_no_namespace_veth_or_process(tmp_path: Path, llama_bins: LlamaBinaries) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    harness = NetHarness(tmp_path / "net", ("b", "c"), llama_bins.bin_dir).start()
    try:
        b = harness.host("b")
        assert {b.ns, harness.host("c").ns} <= set(namespaces())
        # something left running on the host, detached from ssh (setsid + nohup): close() must still kill it
        r = harness.run("b", ["sh", "-c", "setsid nohup sleep 600 >/dev/null 2>&1 < /dev/null & echo $!"])
        sleeper = int(r.stdout.split()[-1])
        assert sleeper in ns_pids(b.ns)
        sshd = [p.pid for p in harness.sshd.values()]
    finally:
        harness.close()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    for h in harness.hosts.values():
        assert h.ns not in namespaces()
        assert h.veth not in links and h.peer not in links
    for pid in [sleeper, *sshd]:
        assert dead(pid)


CHILD = """
import signal, sys, time
# a Ctrl-C'd session: Python leaves SIGINT ignored when its parent did (a test run started in the background)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from pathlib import Path
from _netns import NetHarness
net = NetHarness(Path({root!r}), ("b",)).start()
print(net.host("b").ns, net.host("b").veth, net.sshd["b"].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_test_session_leaves_nothing_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM/SIGINT: the session's own handlers clean up; SIGKILL: the next harness start sweeps it."""
    why = unavailable()
    if why:
        pytest.skip(why)
    code = CHILD.format(tests=str(Path(__file__).parent), root=str(tmp_path / "net"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ns, veth, sshd = child.stdout.readline().split()
        assert ns in namespaces()
        child.send_signal(sig)
        child.wait(30)
    finally:
        child.kill()
        child.wait(10)
    if sig == signal.SIGKILL:
        assert ns in namespaces()  # nothing could run in the killed process ...
        assert ns in sweep_stale()  # ... the next session's start removes it
    assert ns not in namespaces()
    assert veth not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert dead(int(sshd))
