"""Addresses as addresses, not strings: whether a bind would expose a port on every interface, and which
addresses a name stands for. One owner for the layout's ``address`` and the node's ``--allow-bind`` (issue 43: a
check by string let ``0`` and ``::ffff:0.0.0.0`` through, and both listen everywhere). Standard library only: the
node agent imports it on the critical path of a start over SSH."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from .errors import BadInput

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
LOOPBACK = "127.0.0.1"  # where arcsplit binds and dials unless the user names an address
SERVER_PORT = 8080  # llama-server's HTTP port unless the user names one (llama-server's own default too)


def bracket(address: str) -> str:
    """An address as a URL or an ssh forward writes it: an IPv6 one in brackets."""
    return f"[{address}]" if ":" in address else address


def family(host: str) -> socket.AddressFamily:
    """The socket family for a numeric address (an IPv6 one has a colon)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel says is free now; the caller binds it soon after (a lost race shows up as an early exit)."""
    with socket.socket(family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(host: str) -> str:
    """Where to connect for a server bound to ``host`` (a wildcard bind answers on loopback)."""
    return LOOPBACK if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


def local_url(host: str, port: int) -> str:
    """The http:// base a client on this machine uses for a server bound to ``host``:``port``."""
    return f"http://{bracket(connect_host(host))}:{port}"


def parse_ip(text: str) -> IP:
    """An IP literal, an IPv4-mapped IPv6 one (``::ffff:a.b.c.d``) as the IPv4 address it is; ValueError if none."""
    ip = ipaddress.ip_address(text.strip().strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def bind_addresses(text: str, what: str) -> tuple[str, ...]:
    """What ``text`` (an IP or a host name, resolved once, now) may bind: its addresses, canonical. BadInput when
    one of them is the wildcard (every interface) or it names no address."""
    try:
        ips: list[IP] = [parse_ip(text)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP) if text.strip() else []
        except (OSError, UnicodeError):
            infos = []
        ips = [parse_ip(str(info[4][0]).partition("%")[0]) for info in infos]
        if not ips:
            raise BadInput(f"{what} {text!r} is no IP address and no name this host resolves",
                           "name one LAN/VPN address of this host, e.g. 10.0.0.2") from None
    if any(ip.is_unspecified for ip in ips):
        raise BadInput(f"{what} {text!r} would listen on every interface (llama.cpp RPC has no authentication)",
                       "name one LAN/VPN address of this host")
    return tuple(dict.fromkeys(str(ip) for ip in ips))


def same_address(a: str, b: str) -> bool:
    """Whether two address strings are one address (``::ffff:10.0.0.2`` is ``10.0.0.2``); a non-address is none."""
    try:
        return parse_ip(a) == parse_ip(b)
    except ValueError:
        return False


def ssh_port(destination: str, where: str) -> int | None:
    """The port of an ``ssh://[user@]host[:port]`` destination (None: none given, or not that form); BadInput
    when it is out of range, which ssh would answer with its usage text."""
    if not destination.startswith("ssh://"):
        return None
    try:
        port = urlsplit(destination).port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        raise BadInput(f"{where}: ssh = {destination!r} has no valid port", "give a port from 1 to 65535, e.g. "
                       "ssh://user@host:2222")
    return port


def ssh_identities(destination: str) -> tuple[str | None, str]:
    """An ssh destination's user (None: ssh's default) and host: ``user@host``, ``ssh://user@host:port`` or a
    Host alias (its own name), for a report that must leave out both."""
    if destination.startswith("ssh://"):
        parts = urlsplit(destination)
        return parts.username, parts.hostname or destination
    user, at, host = destination.rpartition("@")
    return (user or None) if at else None, host


def bus_address(tcp: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (serve --bus) -> (HOST, PORT); PORT and PORT+1 must both be ports. BadInput otherwise."""
    if not tcp.startswith("tcp://") or ":" not in tcp[6:]:
        raise BadInput(f"bus address {tcp!r} is not tcp://HOST:PORT", "write it like tcp://127.0.0.1:5555")
    host, _, port = tcp[6:].rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise BadInput(f"bus address {tcp!r} has no numeric port", "write it like tcp://127.0.0.1:5555") from None
    if not 1 <= p <= 65534:  # PORT and PORT+1
        raise BadInput(f"bus address {tcp!r}: port {p} is out of range",
                       "give a port from 1 to 65534 (the bus uses PORT and PORT+1)")
    return host, p
