"""An rpc-server whose weights arrive corrupted: the real ggml-rpc-server behind a forwarder that flips bits.

    python tests/_corrupt_rpc.py REAL_RPC_SERVER [rpc-server args...]

Installed as ``ggml-rpc-server`` in a test's llama.cpp directory (beside a link to the real llama-server), it starts
the real rpc-server on a free loopback port and listens where it was asked to, passing every byte through, except
that in each RPC_CMD_SET_TENSOR payload (ggml-rpc.cpp: command byte, 8-byte size, payload; the payload is the
tensor's description and offset, then its data) larger than 64 KiB, one bit of every 512th data byte flips. The
group loads and answers; its weights are wrong. It needs the weights to cross the socket (serve with
rpc_seed=False and ARCSPLIT_RPC_SHM=0). ``--help`` is the real one's.

With ``CORRUPT_RPC_LIVE=1`` in its environment it starts clean instead (weights, seeded or sent, arrive whole) and
turns wrong mid-serve on SIGUSR1: from then on the data of every SET_TENSOR (what flows while the group computes:
the activations llama-server hands each rpc-server; ARCSPLIT_RPC_SHM=0 keeps them on the socket) has the sign of
every 4th float flipped. Finite and wrong: the group keeps answering, something else.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

SET_TENSOR = 6
SET_TENSOR_GATED = 19  # arcsplit's gated set (patch 0003): a SET_TENSOR's data sent after its graph
BIG = 64 * 1024
SKIP = 1024  # the tensor description and offset come first: leave them whole
HEAD = 296 + 1 + 8  # ggml-rpc.cpp serialize_set_tensor: rpc_tensor (packed, 296 bytes), cache flag, offset; then data
LIVE = os.environ.get("CORRUPT_RPC_LIVE") == "1"
TURNED = threading.Event()  # live mode: set by SIGUSR1


def flip(cmd: int, size: int, pos: int, part: bytearray, f32: bool) -> None:
    """Corrupt ``part`` (bytes ``pos``.. of a ``cmd`` payload of ``size`` bytes; ``f32``: its tensor's type is F32,
    the activations, where token ids, positions and the mask are integers or F16) as this forwarder's mode says."""
    if LIVE:
        if TURNED.is_set() and cmd in (SET_TENSOR, SET_TENSOR_GATED) and f32:
            first = max(HEAD, pos)
            for j in range(first + (3 - (first - HEAD)) % 16, pos + len(part), 16):  # byte 3 of every 4th float
                part[j - pos] ^= 0x80
        return
    if cmd == SET_TENSOR and size > BIG:
        for i in range((-pos) % 512, len(part), 512):
            if pos + i >= SKIP:
                part[i] ^= 0x24


def corrupt_stream(src: socket.socket, dst: socket.socket) -> None:
    """Client -> server: parse the framing, flip bits inside big SET_TENSOR data."""
    buf = b""

    def need(n: int) -> bytes:
        nonlocal buf
        while len(buf) < n:
            chunk = src.recv(1 << 20)
            if not chunk:
                raise EOFError
            buf += chunk
        out, buf = buf[:n], buf[n:]
        return out

    try:
        while True:
            head = need(9)
            cmd, size = head[0], struct.unpack("<Q", head[1:])[0]
            dst.sendall(head)
            left, pos, f32 = size, 0, False
            while left:
                part = bytearray(need(min(left, 1 << 20)))
                if pos == 0 and cmd in (SET_TENSOR, SET_TENSOR_GATED) and len(part) >= 12:
                    f32 = struct.unpack("<I", bytes(part[8:12]))[0] == 0  # rpc_tensor: id (8 bytes), type
                flip(cmd, size, pos, part, f32)
                dst.sendall(part)
                pos += len(part)
                left -= len(part)
    except (EOFError, OSError):
        pass
    finally:
        _close_both(src, dst)


def _close_both(*socks: socket.socket) -> None:
    """Either direction ending ends the connection both ways, so neither pump waits on a half-open socket."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(1 << 20):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        _close_both(src, dst)


def start_inner(real: str, rest: list[str]) -> subprocess.Popen[bytes]:
    """The real rpc-server on a free loopback port, listening before this returns; a port in use: another."""
    for _ in range(10):
        inner = random.randrange(20000, 32000)  # below the ephemeral range the group's own free ports come from
        child = subprocess.Popen([real, "-H", "127.0.0.1", "-p", str(inner), *rest])
        for _ in range(400):
            if child.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", inner), timeout=0.2).close()
                child.inner_port = inner  # type: ignore[attr-defined]
                return child
            except OSError:
                time.sleep(0.05)
        child.kill()
        child.wait()
    raise SystemExit("the real rpc-server did not start")


def live_build(tmp: "os.PathLike[str] | str", server: str, rpc_server: str) -> str:
    """A llama.cpp dir (made in ``tmp``) whose ggml-rpc-server is ``rpc_server`` behind this forwarder, clean until
    SIGUSR1 (CORRUPT_RPC_LIVE=1), beside a link to ``server``: what a test or bench serves with ``llama_dir``."""
    d = os.path.join(os.fspath(tmp), "live-corrupt-build")
    os.makedirs(d)
    os.symlink(server, os.path.join(d, "llama-server"))
    rpc = os.path.join(d, "ggml-rpc-server")
    with open(rpc, "w") as f:
        f.write(f"#!/bin/sh\nCORRUPT_RPC_LIVE=1 exec {sys.executable} {os.path.abspath(__file__)} {rpc_server} \"$@\"\n")
    os.chmod(rpc, 0o755)
    return d


def main(argv: list[str]) -> int:
    real, args = argv[0], argv[1:]
    if "--help" in args or "-h" in args:
        return subprocess.call([real, *args])
    host, port = "127.0.0.1", 50052
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in ("-H", "--host"):
            host = args[i + 1]
            i += 2
        elif args[i] in ("-p", "--port"):
            port = int(args[i + 1])
            i += 2
        else:
            rest.append(args[i])
            i += 1
    child = start_inner(real, rest)

    def stop(*_: object) -> None:
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, lambda *_: TURNED.set())
    listener = socket.create_server((host, port))
    threading.Thread(target=lambda: (child.wait(), listener.close()), daemon=True).start()
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return child.returncode or 0
        server = socket.create_connection(("127.0.0.1", child.inner_port))  # type: ignore[attr-defined]
        for sock in (client, server):  # small commands go at once, as llama.cpp's own sockets send them
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=corrupt_stream, args=(client, server), daemon=True).start()
        threading.Thread(target=pump, args=(server, client), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
