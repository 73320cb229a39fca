"""``arcsplit dash [RUN]``: the dashboard of a running instance (the newest when RUN is not given).

Several dashboards may watch one instance; quitting one leaves the instance running.
"""

from __future__ import annotations

import argparse

from .._api import attach


def _dash(args: argparse.Namespace) -> int:
    from ..tui.app import run_dashboard  # textual: only when a dashboard is shown

    client = attach(args.run)  # fails here, before the screen is taken, with a one-line error
    return run_dashboard(lambda: client, verbose=args.verbose)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dash", help="watch a running instance in a terminal dashboard",
                       description="Cards, layer map, processes, server speed, logs and the plan of a running "
                                   "`arcsplit serve`, live. Keys: 1-4 panels, r restart, s stop, ? help, q quit.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix of it (default: the newest running instance)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="the Logs tab also shows what `arcsplit logs` hides without --verbose (llama-server's trace "
                        "and load-progress state lines, the rpc-servers' connect/close lines)")
    p.set_defaults(func=_dash)
