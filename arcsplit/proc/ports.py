"""Ports: pick free loopback ports, check the ones a user names, and probe an rpc-server once."""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import time

from ..errors import BadInput, PortBusy, RunError
from ..netaddr import family as _family
from ..netaddr import free_port as free_port  # its owner is netaddr (llama/ picks ports too); callers import it here


def check_host(host: str, flag: str) -> None:
    """Raise BadInput when nothing can listen on ``host`` here (not an address of this machine, or no such name)."""
    try:
        free_port(host)
    except (OSError, UnicodeError) as exc:
        raise BadInput(f"{flag} {host!r} is not an address this machine can listen on "
                       f"({getattr(exc, 'strerror', None) or exc})",
                       "use 127.0.0.1 (the default) or an address of one of this machine's interfaces") from None


def is_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        # Same option llama-server's HTTP server uses, so a port in TIME_WAIT counts as free for it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_free(host: str, port: int, what: str, flag: str) -> None:
    """Raise PortBusy naming the flag to change when a port the user asked for is taken."""
    if not is_free(host, port):
        raise PortBusy(f"port {port} on {host or '0.0.0.0'} ({what}) is already in use",
                       f"stop what uses it or pass another {flag}")


async def probe_once(host: str, port: int, timeout: float = 1.0) -> bool:
    """One connect-and-close. An rpc-server serves one client at a time: never call this after llama-server connects."""
    import anyio  # start-up: the node agent picks ports before it imports anyio (node/quick.py)

    try:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp(host, port)
    except (OSError, TimeoutError):
        return False
    await stream.aclose()
    return True


def accepts_now(host: str, port: int, timeout: float = 0.2) -> bool:
    """:func:`probe_once` without an event loop, for a loopback or LAN address that answers at once: one
    connect-and-close (safe before llama.cpp connects; never after: an rpc-server serves one client)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_listening(proc: subprocess.Popen, host: str, port: int, timeout: float) -> None:
    """Until a just-started rpc-server accepts on ``port`` (one connect-and-close each time: before its client
    connects); RunError if it exits first or does not listen within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunError(f"rpc-server on {host}:{port} exited with {proc.returncode} before listening",
                           "see its log in the run directory")
        if accepts_now(host, port, timeout=0.5):
            return
        time.sleep(0.05)
    raise RunError(f"rpc-server on {host}:{port} did not listen within {timeout:.0f} s")


def owns_port(pid: int | None, port: int, host: str | None = None) -> bool:
    """Whether process ``pid`` itself listens on TCP ``port``. A connect-and-close is answered by whoever listens:
    another local user can read a starting rpc-server's ``-p PORT`` from /proc and bind it first (issue 43), so
    readiness also asks that the listener is ours. ``pid`` None (no process of its own: a forward on a shared ssh,
    which said it bound the port): True."""
    if pid is None:
        return True
    families = ((socket.AF_INET, socket.AF_INET6) if not host else (_family(host),))
    listening = _listening_inodes(port, families)
    if listening is None:
        return _owns_port_psutil(pid, port, host)
    if not listening:
        return False  # nobody listens yet: the common answer while an rpc-server starts, asked every few ms
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False  # gone, or not ours to read
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in listening:
            return True
    return False


# Linux sock_diag (netlink): the sockets a kernel table holds, without /proc/net/tcp, whose read walks every bucket of
# the connection hash (4 ms on a machine with none open; the table grows with the machine's memory). Asked for the
# LISTEN state only, the kernel walks its table of listeners.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10


def _listening_inodes(port: int, families: tuple[int, ...]) -> set[int] | None:
    """The inodes of this network namespace's TCP sockets listening on ``port`` (any address), or None where
    netlink's sock_diag cannot be asked (then the caller asks psutil). The caller shares its children's namespace:
    the supervisor and each host's agent start the processes they ask about."""
    found: set[int] = set()
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)  # a dump always ends; should one not, psutil answers instead
            for seq, fam in enumerate(families, start=1):
                # inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid (48 bytes)
                req = struct.pack("=BBBBI", fam, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + bytes(48)
                nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, seq, 0) + req)
                if not _read_dump(nl, port, found):
                    return None
    except OSError:
        return None
    return found


def _read_dump(nl: socket.socket, port: int, found: set[int]) -> bool:
    """Read one dump's inet_diag_msg records into ``found`` (those on ``port``); False on a netlink error."""
    while True:
        data = nl.recv(65536)
        off = 0
        while off + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, off)
            if kind == _NLMSG_DONE:
                return True
            if kind == _NLMSG_ERROR or length < 16 + 72:
                return False
            # inet_diag_msg after the 16-byte header: idiag_sport (big-endian) at 4, idiag_inode at 68
            if struct.unpack_from(">H", data, off + 20)[0] == port:
                found.add(struct.unpack_from("=I", data, off + 84)[0])
            off += (length + 3) & ~3


def _owns_port_psutil(pid: int, port: int, host: str | None) -> bool:
    """owns_port through psutil (/proc/PID/net/tcp*), where netlink is not there to ask."""
    import psutil  # start-up: the node agent's first phase imports this module before psutil (node/quick.py)

    try:
        # the listener's family only, when the host is known (numeric, as it was bound): one /proc table to parse
        kind = "tcp" if not host else "tcp6" if _family(host) == socket.AF_INET6 else "tcp4"
        conns = psutil.Process(pid).net_connections(kind=kind)
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)
