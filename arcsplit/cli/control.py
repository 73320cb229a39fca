"""``arcsplit ps | stop | restart | logs [RUN]``: drive running instances over their bus."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .._api import RouteChoice, attach, failure_line, runs
from ..llama.logs import trace_filter
from ..roles import Role
from . import print_json


def _ps(args: argparse.Namespace) -> int:
    rows = []
    for info in runs():
        row = {"run": info.run_id, "pid": info.pid, "url": info.url, "model": info.model,
               "started": info.started, "state": None, "mode": None}
        try:
            with attach(info.run_id, timeout=2.0) as client:
                status = client.status()
            row["state"], row["mode"], row["choice"] = status.get("state"), status.get("mode"), status.get("choice")
            row["last_failure"], row["causes"] = status.get("last_failure"), status.get("causes") or {}
            held = {q.get("name"): q for q in (status.get("route") or {}).get("processes") or []}  # Route's
            row["processes"] = {name: {"state": p.get("state"), "pid": p.get("pid"), "restarts": p.get("restarts"),
                                        "paused": p.get("paused", False), "host": p.get("host", ""),
                                        "role": p.get("role"), "cards": r.get("cards", []),
                                        "devices": r.get("devices", [])}
                                for name, p in status.get("processes", {}).items() for r in [held.get(name) or {}]}
        except Exception as exc:  # one unresponsive instance must not hide the others
            row["state"] = f"not answering ({exc})"
        rows.append(row)
    if args.json:
        print_json({"runs": rows})
        return 0
    if not rows:
        print("no arcsplit instance is running")
        return 0
    print(f"{'run':<24} {'pid':>7} {'state':<10} {'mode':<8} {'up':>7}  url / model")
    for r in rows:
        up = time.time() - float(str(r["started"]))
        print(f"{r['run']:<24} {r['pid']:>7} {str(r['state']):<10} {str(r['mode']):<8} {up:>6.0f}s  "
              f"{r['url']}  {r['model']}")
        if r.get("choice"):  # how the route was chosen: tuned (its figures), asked, the default order
            print(f"  {RouteChoice.from_dict(r['choice']).line()}")  # type: ignore[arg-type]
        if r.get("last_failure"):  # why the group last restarted: its cause, the member and where it runs
            print(f"  last failure: {failure_line(r['last_failure'], r.get('causes'))}")  # type: ignore[arg-type]
        procs: dict[str, dict[str, Any]] = r.get("processes") or {}  # type: ignore[assignment]
        for name, p in procs.items():  # members on other hosts (pids there), and their links
            if p.get("host"):
                where = f"link to {p['host']}" if p.get("role") == Role.LINK else f"on {p['host']}"
                pid = p.get("pid") or "-"  # a link on its host's node ssh (forwards = "shared") has no process
                cards = ",".join(str(c) for c in p.get("cards") or [])  # one rpc-server may hold several (per-host)
                print(f"  {name:<12} {where:<16} {str(p.get('state')):<9} pid {pid}"
                      + (f"  cards {cards}" if cards else ""))
    return 0


def _stop(args: argparse.Namespace) -> int:
    with attach(args.run) as client:
        client.stop()
        run = client.info
    deadline = time.monotonic() + args.wait
    while run.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped {run.run_id}" if not run.alive() else f"asked {run.run_id} to stop; it is still shutting down")
    return 0


def _restart(args: argparse.Namespace) -> int:
    with attach(args.run) as client:
        client.restart()
        print(f"restarting {client.info.run_id}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    with attach(args.run) as client:
        for line in client.logs(args.process, args.lines, verbose=args.verbose):
            print(line)
        if args.follow:
            trace = trace_filter()  # llama-server's own lines ("server"), as the history above
            for msg in client.events(kinds=("log",), snapshot=False):
                if args.process is None or msg["name"] == args.process:
                    line = str(msg["data"].get("line", ""))
                    if not args.verbose and msg["name"] == "server" and trace(line):
                        continue
                    prefix = "" if args.process else f"[{msg['name']}] "
                    print(prefix + line, flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="list running arcsplit instances", description="List running arcsplit instances.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_ps)

    p = sub.add_parser("stop", help="stop a running instance (llama-server first, then rpc-servers)",
                       description="Stop a running instance: llama-server first, then the rpc-servers.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest)")
    p.add_argument("--wait", type=float, default=30.0, metavar="S", help="wait this long for it to exit (default 30)")
    p.set_defaults(func=_stop)

    p = sub.add_parser("restart", help="restart a running instance's group",
                       description="Stop a running instance's group in order and start it again.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest)")
    p.set_defaults(func=_restart)

    p = sub.add_parser("logs", help="show (and follow) a running instance's logs",
                       description="Show the captured output of a running instance's processes.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest)")
    p.add_argument("--process", "-p", metavar="NAME", help="one process: server, rpc0, rpc1, ... (default: all)")
    p.add_argument("--lines", "-n", type=int, default=50, metavar="N", help="lines of history (default 50)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also llama-server's trace lines (arcsplit runs it at -lv 4 for its buffer sizes; without "
                        "this flag logs shows what llama-server's default verbosity would)")
    p.set_defaults(func=_logs)
