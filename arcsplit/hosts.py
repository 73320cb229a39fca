"""The ssh command lines that reach a layout's other hosts, and the check that both ends run one llama.cpp. Pure.

Every ssh arcsplit runs goes through ``ssh_base``: it never asks for a password or a passphrase (BatchMode), never
accepts a host key it does not already know (StrictHostKeyChecking=yes: an unknown or changed key fails instead of
being trusted on first use), notices a dead peer within about 6 s (ServerAlive 2 s x 3) and uses no ControlMaster of
the user's (ControlPath=none: a master started elsewhere would outlive this run, and its failure would not be ours).
No agent or X11 forwarding: nothing of this machine is lent to the other one.

The one master arcsplit uses is its own: with ``forwards = "shared"`` (the default) the node agent's ssh is started
as a ControlMaster on a socket in arcsplit's private runtime folder (``master_argv``) and each link is a forward added
to that connection (``control_argv``: ``ssh -O forward``), not a second login. The master lives exactly as long as
the agent's session (ControlPersist=no), so its forwards end with it.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping, Sequence

from .errors import BadInput
from .netaddr import LOOPBACK, bracket
from .rig import Host

SSH_OPTIONS = ("BatchMode=yes", "StrictHostKeyChecking=yes", "ServerAliveInterval=2", "ServerAliveCountMax=3",
               "ConnectTimeout=10", "ControlPath=none", "ForwardAgent=no", "ForwardX11=no")


# A link carries tensors: AES-GCM first (hardware AES on x86 and ARMv8 makes it several times cheaper per byte
# than ssh's default ChaCha20-Poly1305; measured on the CPU demo: ~0.3 s less to load over the link); '^' puts
# them at the head of the default list, so a server without them still connects.
LINK_CIPHERS = "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


# What `arcsplit plan` shows for the control socket: serve picks a fresh ssh-XXXXXXXX in arcsplit's runtime folder.
CONTROL_SHOWN = "$XDG_RUNTIME_DIR/arcsplit/ssh-XXXXXXXX"


def shares_connection(host: Host) -> bool:
    """Whether the links to ``host`` ride its node agent's ssh connection (link "ssh", forwards "shared")."""
    return host.link == "ssh" and host.forwards == "shared"


def ssh_base(host: Host, control: str | None = None) -> list[str]:
    """``ssh`` and the options every connection to ``host`` uses; the destination is not included. ``control``:
    arcsplit's own control socket instead of ControlPath=none (ssh expands ``%`` in it, so it is escaped)."""
    argv = ["ssh"]
    if host.ssh_config:
        argv += ["-F", host.ssh_config]
    for option in SSH_OPTIONS:
        if control is not None and option == "ControlPath=none":
            option = "ControlPath=" + control.replace("%", "%%")
        argv += ["-o", option]
    return argv + ["-T"]


def node_argv(host: Host, control: str | None = None) -> list[str]:
    """The node agent over ssh: ``arcsplit node --stdio`` there, JSON lines on its stdin/stdout; on a host that keeps
    one running (agent = "standing") ``arcsplit node --attach`` to it, whose own --allow-bind rules there. ssh hands
    the remote command to the remote user's shell as one string, so the words are quoted here; a direct link lets a
    per-run agent bind its rpc-servers to that one address. ``control``: this ssh is the ControlMaster on that socket
    whose connection the links ride (``control_argv``); their tensors then cross it, hence the links' ciphers."""
    base = ssh_base(host, control)
    if control is not None:
        base += ["-o", "ControlMaster=yes", "-o", "ControlPersist=no", "-o", LINK_CIPHERS]
    if host.agent == "standing":
        return base + [host.ssh, shlex.join([host.arcsplit, "node", "--attach"])]
    words = [host.arcsplit, "node", "--stdio"]
    if host.link == "direct" and host.address:
        words += ["--allow-bind", host.address]
    return base + [host.ssh, shlex.join(words)]


def forward_argv(host: Host, local_port: int, remote_port: int, remote_bind: str = LOOPBACK) -> list[str]:
    """An ``ssh -N -L`` forward from 127.0.0.1:``local_port`` here to ``remote_bind``:``remote_port`` on ``host``.
    ExitOnForwardFailure: a port that cannot be forwarded ends ssh (a failed member) instead of a forward-less
    connection that looks alive."""
    spec = f"{LOOPBACK}:{local_port}:{bracket(remote_bind)}:{remote_port}"
    return ssh_base(host) + ["-N", "-o", "ExitOnForwardFailure=yes", "-o", LINK_CIPHERS, "-L", spec, host.ssh]


def control_argv(host: Host, control: str, op: str, forward: Sequence[str]) -> list[str]:
    """``ssh -O forward`` (``op``) or ``-O cancel`` of the ``-L`` of ``forward`` (a ``forward_argv``) on the master
    at ``control``: it adds the forward to that connection, or fails (a port taken here: "Port forwarding failed"),
    and exits; ControlMaster=no: never a login of its own."""
    spec = forward[list(forward).index("-L") + 1]
    return ssh_base(host, control) + ["-o", "ControlMaster=no", "-O", op, "-L", spec, host.ssh]


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
