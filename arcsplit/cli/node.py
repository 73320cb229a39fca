"""``arcsplit node``: the agent a supervisor on another host reaches over SSH (arcsplit/node/): ``--stdio`` started
per run, or ``--listen`` kept running (a systemd unit) with ``--attach`` as what ssh runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import backends, durations
from ..netaddr import bind_addresses
from .options import add_llama_dir


def inventory(args: argparse.Namespace, backend: str | None = None) -> dict[str, Any]:
    """What hello reports (cli/llama.py's host_inventory)."""
    from .llama import host_inventory  # the build and card code: imported once the agent has answered its first ops

    return host_inventory(args, backend)


def _session_argv(args: argparse.Namespace) -> list[str]:
    """``arcsplit node --stdio`` with this agent's options: what a standing agent runs for each connection."""
    argv = [sys.executable, "-m", "arcsplit", "node", "--stdio", "--heartbeat", str(args.heartbeat),
            "--backend", args.backend]
    for flag, value in (("--llama-dir", args.llama_dir), ("--build", args.build)):
        if value:
            argv += [flag, value]
    for address in args.allow_bind or ():
        argv += ["--allow-bind", address]
    return argv


def _node(args: argparse.Namespace) -> int:
    from ..node import standing

    # each address parsed (or the name resolved) once, here: the agent compares addresses, never strings
    args.allow_bind = list(dict.fromkeys(a for text in args.allow_bind or () for a in
                                         bind_addresses(text, "--allow-bind")))
    if args.attach is not None:
        return standing.attach(standing.socket_path(args.attach or None))
    if args.listen is not None:
        return standing.listen(standing.socket_path(args.listen or None), _session_argv(args))
    from ..node.quick import run_stdio  # answers the first ops before it imports anyio

    return run_stdio(heartbeat=args.heartbeat, allow_bind=tuple(args.allow_bind or ()),
                     inventory=lambda backend: inventory(args, backend))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="the agent that runs this host's rpc-servers for a supervisor elsewhere",
                       description="Run this host's rpc-servers for an `arcsplit serve` on another host, which "
                                   "starts this over SSH and speaks JSON lines on stdin/stdout "
                                   "(docs/multihost.md). Everything it started is stopped when stdin closes or "
                                   "no message arrives for --heartbeat seconds. A host that keeps an agent "
                                   "running uses --listen (`arcsplit unit --node`); ssh then runs --attach.")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--stdio", action="store_true", help="speak the protocol on stdin/stdout")
    how.add_argument("--listen", nargs="?", const="", metavar="PATH",
                     help="keep running; serve each connection to this Unix socket as one --stdio session "
                          "(default: node.sock in arcsplit's private runtime folder)")
    how.add_argument("--attach", nargs="?", const="", metavar="PATH",
                     help="connect stdin/stdout to the agent that --listen runs (what ssh runs on such a host)")
    p.add_argument("--heartbeat", type=durations.argtype("--heartbeat"), default=10.0, metavar="TIME",
                   help=f"stop everything after this long without a message from the client: {durations.HELP} "
                        "(default 10s)")
    p.add_argument("--allow-bind", action="append", metavar="ADDR",
                   help="an address rpc-servers may bind besides 127.0.0.1 (layout link = \"direct\"; repeatable; "
                        "never 0.0.0.0)")
    p.add_argument("--backend", choices=backends.choices(), default=backends.AUTO, help="which llama.cpp build's rpc-server to run (default auto)")
    add_llama_dir(p)
    p.set_defaults(func=_node)
