"""``arcsplit unit serve MODEL ...``: a systemd unit file that runs that command as a ``Type=notify`` service;
``arcsplit unit --node``: one that keeps the standing node agent (``arcsplit node --listen``) running.

The command is checked as ``arcsplit serve`` checks it before it starts anything (its parser, then the model, the
cards or layout, the fit and llama-server's arguments, offline as ``plan`` does: no process, no port taken now),
and only then written as typed, with this arcsplit's
absolute path and the current directory as the unit's working directory, so relative paths keep their meaning.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from .._api import preview
from ..errors import BadInput
from ..rig import load_layout
from . import build_parser
from .serve import check_serve_flags
from .serve_run import request_from_args

_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def quote(arg: str) -> str:
    """One ExecStart= word (systemd.service(5) "Command lines"): % and $ doubled, anything else double-quoted."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.match(arg):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _exec_prefix() -> list[str]:
    script = Path(sys.executable).with_name("arcsplit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "arcsplit"]


def render_unit(command: list[str], cwd: str, env: dict[str, str]) -> str:
    """The unit text for ``arcsplit <command>`` (checked by the caller)."""
    args = build_parser().parse_args(command)
    exec_start = " ".join(quote(a) for a in _exec_prefix() + command)
    carried = "".join(f"Environment={quote(f'{k}={v}')}\n" for k, v in sorted(env.items())
                      if k.startswith("ARCSPLIT_"))
    model = Path(getattr(args, "model", None) or "the demo model").name
    return f"""\
# arcsplit as a systemd user service (for a system service: User=, and /etc/systemd/system/ instead).
#   arcsplit unit {shlex.join(command)} > ~/.config/systemd/user/arcsplit.service
#   systemctl --user daemon-reload && systemctl --user enable --now arcsplit
#   journalctl --user -u arcsplit -f      # arcsplit's lines; each process's own log: arcsplit logs -f
[Unit]
Description=arcsplit {command[0]} {model}
After=network.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
WorkingDirectory={quote(cwd)}
Environment=PYTHONUNBUFFERED=1
{carried}# READY=1 comes once /health answers 200; the first load of a large model over RPC takes minutes.
TimeoutStartSec=30min
# WATCHDOG=1 every half of this while the group is ready; long enough for arcsplit's own group restart.
WatchdogSec=5min
Restart=on-failure
RestartSec=10
# SIGTERM to arcsplit, which stops llama-server and then the rpc-servers; the rest is killed after the timeout.
KillMode=mixed
TimeoutStopSec=60
SyslogIdentifier=arcsplit

[Install]
WantedBy=default.target
"""


def render_node_unit(command: list[str], env: dict[str, str]) -> str:
    """The unit text for the standing node agent ``arcsplit <command>`` (``node --listen ...``, checked here)."""
    build_parser().parse_args(command)
    exec_start = " ".join(quote(a) for a in _exec_prefix() + command)
    carried = "".join(f"Environment={quote(f'{k}={v}')}\n" for k, v in sorted(env.items())
                      if k.startswith("ARCSPLIT_"))
    return f"""\
# The standing arcsplit node agent as a systemd user service: supervisors on other hosts reach it with
# `ssh THIS-HOST arcsplit node --attach` (layout: agent = "standing"; docs/multihost.md).
#   arcsplit unit --node > ~/.config/systemd/user/arcsplit-node.service
#   systemctl --user daemon-reload && systemctl --user enable --now arcsplit-node
#   loginctl enable-linger $USER     # keep it (and its socket under $XDG_RUNTIME_DIR) when you log out
#   journalctl --user -u arcsplit-node -f
[Unit]
Description=arcsplit node agent (rpc-servers for supervisors on other hosts)
After=network.target

[Service]
Type=simple
ExecStart={exec_start}
Environment=PYTHONUNBUFFERED=1
{carried}Restart=on-failure
RestartSec=5
# SIGTERM to the agent, which ends every session (each stops its rpc-servers); the rest is killed after the timeout.
KillMode=mixed
TimeoutStopSec=30
SyslogIdentifier=arcsplit-node

[Install]
WantedBy=default.target
"""


def _unit(args: argparse.Namespace) -> int:
    command = list(args.command)
    if args.node or command[:1] == ["node"]:
        if not command:
            command = ["node", "--listen"]
        if command[:1] != ["node"] or "--listen" not in command:
            raise BadInput("the node unit runs the standing agent, `arcsplit node --listen`",
                           "write `arcsplit unit --node`, or `arcsplit unit node --listen [its options]`")
        print(render_node_unit(command, dict(os.environ)), end="")
        return 0
    if command[:1] not in (["serve"], ["demo"]):
        raise BadInput("`arcsplit unit` needs the command the service runs",
                       "e.g. `arcsplit unit serve model.gguf --gpus 0,1 --backend sycl`, or `arcsplit unit --node`")
    if "--tui" in command:
        raise BadInput("--tui needs a terminal, which a service does not have",
                       "drop --tui; watch it with `arcsplit dash`")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in command):
        raise BadInput("the API key would be written into the unit file",
                       "put LLAMA_API_KEY=... in a file only you can read and add EnvironmentFile=FILE to the unit, "
                       "or pass `-- --api-key-file FILE`")
    check_command(command)
    print(render_unit(command, os.getcwd(), dict(os.environ)), end="")
    return 0


def check_command(command: list[str]) -> None:
    """What ``serve`` would refuse at its start, refused now, before a unit that can never start is written."""
    args = build_parser().parse_args(command)
    if command[0] != "serve":
        return  # demo: its own model and cards
    check_serve_flags(args)
    preview(request_from_args(args), load_layout(args.layout) if args.layout else None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("unit", help="print a systemd unit file that runs an arcsplit command as a service",
                       description="Print a systemd unit (Type=notify, watchdog) that runs the given arcsplit "
                                   "command, e.g. `arcsplit unit serve model.gguf --gpus 0,1`; with --node, "
                                   "one (Type=simple) for the standing node agent `arcsplit node --listen`.")
    p.add_argument("--node", action="store_true",
                   help="the unit for the standing node agent (`arcsplit node --listen`; with its options: "
                        "`arcsplit unit node --listen ...`)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the arcsplit command the service runs")
    p.set_defaults(func=_unit)
