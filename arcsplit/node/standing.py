"""The standing agent: ``arcsplit node --listen`` keeps running on a host (a systemd unit) and serves each connection
to its private Unix socket as one session; ``arcsplit node --attach`` is what ssh runs there to reach it.

Each accepted connection gets its own ``arcsplit node --stdio`` process with the connection as its stdin and stdout,
so a session is exactly the stdio agent: the same protocol, heartbeat, run dir and leftover sweep, its own
rpc-servers. One session cannot see or stop another's processes, and a session that ends (EOF, silence, a crash)
stops only its own. The socket is the only door: 0600 in a folder only the user can write.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from .._dirs import runtime_dir
from ..errors import BadInput

UNIT_FIX = "start it there: `arcsplit node --listen`, or its unit (`arcsplit unit --node`)"
_MAX_PATH = 107  # sockaddr_un.sun_path less the NUL
STOP_GRACE = 15.0  # a session's own shutdown gives each rpc-server 2 s
Sessions = dict[int, tuple["subprocess.Popen[bytes]", socket.socket]]  # by session pid: its process, its connection


def default_socket() -> Path:
    """Where ``--listen`` and ``--attach`` meet when no PATH is given: the user's private runtime folder."""
    return runtime_dir() / "node.sock"


def socket_path(given: str | None) -> Path:
    """The socket path to use; BadInput if its folder is missing, not the user's, or writable by others (anyone who
    can write there could put their own socket in its place and receive the supervisor's commands)."""
    path = Path(given).expanduser().absolute() if given else default_socket()
    folder = path.parent
    try:
        st = folder.stat()
    except OSError:
        raise BadInput(f"socket folder {folder} does not exist", "create it (chmod 700) or leave PATH out") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadInput(f"socket folder {folder} is not a folder", "give a path in a folder only you can write")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise BadInput(f"socket folder {folder} can be written by other users, who could replace the socket",
                       "use a folder only you can write (chmod 700), or leave PATH out")
    if len(os.fsencode(path)) > _MAX_PATH:
        raise BadInput(f"socket path {path} is longer than {_MAX_PATH} bytes", "give a shorter PATH")
    return path


def _bind(path: Path) -> socket.socket:
    """A listening socket at ``path``, 0600 from the start; a stale socket file of a dead agent is replaced."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise BadInput(f"{path} exists and is not a socket", "remove it or give another PATH")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: a dead agent's
        else:
            raise BadInput(f"a node agent already listens on {path}", "stop it, or give another PATH")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    path.chmod(0o600)
    sock.listen(16)
    return sock


def _say(text: str) -> None:
    print(f"arcsplit node: {text}", file=sys.stderr, flush=True)


def listen(path: Path, session_argv: Sequence[str]) -> int:
    """Serve connections until SIGTERM/SIGINT; each one runs ``session_argv`` (the ``--stdio`` agent) on it.

    The agent keeps each connection open until its session exits, so on SIGTERM it can shut the connections down:
    each session reads EOF and stops its rpc-servers the ordinary way."""
    server = _bind(path)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    old_fd = signal.set_wakeup_fd(wake_w.fileno())
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    sessions: Sessions = {}
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    _say(f"listening on {path}")
    try:
        while not stopping.is_set():
            for key, _ in sel.select(timeout=0.2):
                if key.fileobj is wake_r:
                    wake_r.recv(64)
                elif not stopping.is_set():
                    conn, _ = server.accept()
                    _start(conn, session_argv, sessions)
            _reap(sessions)
    finally:
        server.close()
        path.unlink(missing_ok=True)
        _stop_all(sessions)
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sel.close()
        wake_r.close()
        wake_w.close()
        _say("stopped")
    return 0


def _start(conn: socket.socket, argv: Sequence[str], sessions: Sessions) -> None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    peer = int.from_bytes(creds[:4], sys.byteorder)
    try:
        proc = subprocess.Popen(list(argv), stdin=conn.fileno(), stdout=conn.fileno(), close_fds=True)
    except OSError as exc:
        _say(f"cannot start a session: {exc.strerror}")
        conn.close()
        return
    sessions[proc.pid] = (proc, conn)
    _say(f"session {proc.pid} started for pid {peer}")


def _reap(sessions: Sessions) -> None:
    for pid, (proc, conn) in list(sessions.items()):
        if proc.poll() is not None:
            conn.close()  # the attach end sees EOF only once this copy is closed too
            del sessions[pid]
            _say(f"session {pid} ended ({proc.returncode})")


def _stop_all(sessions: Sessions) -> None:
    for proc, conn in sessions.values():
        try:
            conn.shutdown(socket.SHUT_RDWR)  # the session reads EOF and stops its rpc-servers
        except OSError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    for proc, _ in sessions.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()  # its rpc-servers die with it (parent-death signal)
            proc.wait()
    _reap(sessions)


def attach(path: Path) -> int:
    """Bridge stdin/stdout to the standing agent at ``path`` until either side closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise BadInput(f"no node agent listens on {path}", UNIT_FIX) from None
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot reach the node agent at {path}: {exc.strerror}",
                       "run this as the user that runs `arcsplit node --listen`") from None

    def upstream() -> None:  # stdin -> agent; stdin's EOF is the session's end
        try:
            while chunk := os.read(0, 65536):
                sock.sendall(chunk)
        except OSError:
            pass
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=upstream, name="stdin", daemon=True).start()
    try:
        while chunk := sock.recv(65536):
            view = memoryview(chunk)
            while view:
                view = view[os.write(1, view):]
    except OSError:
        pass  # stdout gone (ssh ended): closing the socket ends the session
    finally:
        sock.close()
    return 0
