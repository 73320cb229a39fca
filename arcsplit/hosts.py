"""The ssh command lines that reach a layout's other hosts, and the check that both ends run one llama.cpp. Pure.

Every ssh arcsplit runs goes through ``ssh_base``: it never asks for a password or a passphrase (BatchMode), never
accepts a host key it does not already know (StrictHostKeyChecking=yes: an unknown or changed key fails instead of
being trusted on first use), notices a dead peer within about 6 s (ServerAlive 2 s x 3) and gives each connection its
own TCP session (ControlPath=none: a shared master would outlive the member that started it, and its failure would
not be that member's). No agent or X11 forwarding: nothing of this machine is lent to the other one.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping

from .errors import BadInput
from .rig import Host

LOOPBACK = "127.0.0.1"
SSH_OPTIONS = ("BatchMode=yes", "StrictHostKeyChecking=yes", "ServerAliveInterval=2", "ServerAliveCountMax=3",
               "ConnectTimeout=10", "ControlPath=none", "ForwardAgent=no", "ForwardX11=no")


# A link carries tensors: AES-GCM first (hardware AES on x86 and ARMv8 makes it several times cheaper per byte
# than ssh's default ChaCha20-Poly1305; measured on the CPU demo: ~0.3 s less to load over the link); '^' puts
# them at the head of the default list, so a server without them still connects.
LINK_CIPHERS = "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


def ssh_base(host: Host) -> list[str]:
    """``ssh`` and the options every connection to ``host`` uses; the destination is not included."""
    argv = ["ssh"]
    if host.ssh_config:
        argv += ["-F", host.ssh_config]
    for option in SSH_OPTIONS:
        argv += ["-o", option]
    return argv + ["-T"]


def node_argv(host: Host) -> list[str]:
    """The node agent over ssh: ``arcsplit node --stdio`` there, JSON lines on its stdin/stdout; on a host that keeps
    one running (agent = "standing") ``arcsplit node --attach`` to it, whose own --allow-bind rules there. ssh hands
    the remote command to the remote user's shell as one string, so the words are quoted here; a direct link lets a
    per-run agent bind its rpc-servers to that one address."""
    if host.agent == "standing":
        return ssh_base(host) + [host.ssh, shlex.join([host.arcsplit, "node", "--attach"])]
    words = [host.arcsplit, "node", "--stdio"]
    if host.link == "direct" and host.address:
        words += ["--allow-bind", host.address]
    return ssh_base(host) + [host.ssh, shlex.join(words)]


def _bracket(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def forward_argv(host: Host, local_port: int, remote_port: int, remote_bind: str = LOOPBACK) -> list[str]:
    """An ``ssh -N -L`` forward from 127.0.0.1:``local_port`` here to ``remote_bind``:``remote_port`` on ``host``.
    ExitOnForwardFailure: a port that cannot be forwarded ends ssh (a failed member) instead of a forward-less
    connection that looks alive."""
    spec = f"{LOOPBACK}:{local_port}:{_bracket(remote_bind)}:{remote_port}"
    return ssh_base(host) + ["-N", "-o", "ExitOnForwardFailure=yes", "-o", LINK_CIPHERS, "-L", spec, host.ssh]


def check_inventory(local: Mapping[str, Any], remote: Mapping[str, Any], host: Host) -> None:
    """Refuse a remote llama.cpp that cannot serve with this one: another commit, or another RPC protocol version
    (ggml-rpc.h RPC_PROTO_*; llama-server aborts the first time an rpc-server of another major version answers).
    ``local``/``remote``: ``arcsplit llama which --json`` of each side (or the node's hello ``llama``). A value one
    side does not know is not held against it; the other one still is."""
    problems = []
    for key, label in (("commit", "llama.cpp commit"), ("rpc_proto", "RPC protocol")):
        mine, theirs = local.get(key), remote.get(key)
        if mine and theirs and str(mine) != str(theirs):
            problems.append(f"{label} {theirs} on {host.name} ({host.ssh}), {mine} here")
    if problems:
        raise BadInput(f"host {host.name} runs another llama.cpp build: {'; '.join(problems)}",
                       f"build the same version on both: install the same arcsplit on {host.name} and run "
                       f"`arcsplit llama build` there")
