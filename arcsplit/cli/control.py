"""``arcsplit ps | stop | restart | logs [RUN]``: drive running instances over their bus; ``ps --all`` and ``logs``
also read the runs that have ended from their run directories (proc/rundir.py keeps the newest KEEP_RUNS)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .._api import RouteChoice, attach, failure_line, route_lines, runs
from .. import durations
from ..errors import NotRunning
from ..llama.logs import QuietFilter, pick_lines
from ..proc.rundir import KEEP_RUNS, RunRecord, fault_lines, find_record, run_records, runs_root
from ..roles import Role
from . import print_json


def _ps(args: argparse.Namespace) -> int:
    rows = []
    for info in runs():
        row = {"run": info.run_id, "pid": info.pid, "url": info.url, "model": info.model,
               "started": info.started, "state": None, "mode": None, "ended": None}
        try:
            with attach(info.run_id, timeout=2.0) as client:
                status = client.status()
            row["state"], row["mode"], row["choice"] = status.get("state"), status.get("mode"), status.get("choice")
            row["routes"], row["canary"] = status.get("routes"), status.get("canary")
            row["last_failure"], row["causes"] = status.get("last_failure"), status.get("causes") or {}
            held = {q.get("name"): q for q in (status.get("route") or {}).get("processes") or []}  # Route's
            row["processes"] = {name: {"state": p.get("state"), "pid": p.get("pid"), "restarts": p.get("restarts"),
                                        "paused": p.get("paused", False), "host": p.get("host", ""),
                                        "role": p.get("role"), "cards": r.get("cards", []),
                                        "devices": r.get("devices", [])}
                                for name, p in status.get("processes", {}).items() for r in [held.get(name) or {}]}
            # what went wrong: the last error with its log lines, failures per card, cards to reset (run/faults.py)
            row.update({k: status.get(k) for k in ("last_error", "last_error_lines", "card_faults", "resets")})
        except Exception as exc:  # one unresponsive instance must not hide the others
            row["state"] = f"not answering ({exc})"
        rows.append(row)
    ended = _ended_rows({str(r["run"]) for r in rows}) if args.all else []
    if args.json:
        print_json({"runs": rows + ended})
        return 0
    if not rows:
        print("no arcsplit instance is running")
    else:
        _print_running(rows)
    if ended:
        print(f"\nruns that have ended (the newest {KEEP_RUNS} stay in {runs_root()}; `arcsplit logs RUN` shows one's "
              "logs, `arcsplit report RUN` bundles it):")
        print(f"{'run':<24} {'state':<10} {'mode':<8} {'ended':<19}  model")
        for r in ended:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ended"])) if r["ended"] else "-"
            print(f"{r['run']:<24} {str(r['state']):<10} {str(r['mode']):<8} {when:<19}  {r['model']}")
            for line in r["faults"]:
                print(f"  {line}")
    return 0


def _ended_rows(running: set[str]) -> list[dict[str, Any]]:
    """The runs still on disk that are not among the running ones: how each ended, or "died" (killed)."""
    return [{"run": rec.run_id, "pid": None, "url": rec.url, "model": rec.model, "started": rec.started,
             "state": rec.state + (" (no bus)" if rec.running else ""), "mode": rec.mode, "ended": rec.ended,
             "run_dir": str(rec.path), "faults": list(rec.faults)}
            for rec in run_records() if rec.run_id not in running]


def _print_running(rows: list[dict[str, Any]]) -> None:
    print(f"{'run':<24} {'pid':>7} {'state':<10} {'mode':<8} {'up':>7}  url / model")
    for r in rows:
        up = time.time() - float(str(r["started"]))
        print(f"{r['run']:<24} {r['pid']:>7} {str(r['state']):<10} {str(r['mode']):<8} {up:>6.0f}s  "
              f"{r['url']}  {r['model']}")
        if r.get("choice"):  # how the route was chosen: tuned (its figures), asked, the default order
            print(f"  {RouteChoice.from_dict(r['choice']).line()}")  # type: ignore[arg-type]
        for line in route_lines(r.get("routes"), r.get("canary")):  # type: ignore[arg-type]
            print(f"  {line}")
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
        for line in fault_lines(r):
            print(f"  {line}")


def _stop(args: argparse.Namespace) -> int:
    with attach(args.run) as client:
        client.stop(by="`arcsplit stop`")
        run = client.info
    deadline = time.monotonic() + args.wait
    while run.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped {run.run_id}" if not run.alive() else f"asked {run.run_id} to stop; it is still shutting down")
    return 0


def _restart(args: argparse.Namespace) -> int:
    with attach(args.run) as client:
        client.restart(by="`arcsplit restart`")
        print(f"restarting {client.info.run_id}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    try:
        client = attach(args.run)
    except NotRunning:  # a run that has ended: its log files
        record = find_record(args.run)
        if record is None:
            if args.run is None:
                raise
            raise NotRunning(f"there is no arcsplit run {args.run!r}", "pick one from `arcsplit ps --all`") from None
        return _ended_logs(record, args)
    with client:
        for line in client.logs(args.process, args.lines, verbose=args.verbose):
            print(line)
        if args.follow:
            quiet = QuietFilter()  # as the history above: the dashboard's filter too
            for msg in client.events(kinds=("log",), snapshot=False):
                if args.process is None or msg["name"] == args.process:
                    line = str(msg["data"].get("line", ""))
                    if not args.verbose and quiet.hides(msg["name"], line):
                        continue
                    prefix = "" if args.process else f"[{msg['name']}] "
                    print(prefix + line, flush=True)
    return 0


def _ended_logs(record: RunRecord, args: argparse.Namespace) -> int:
    """A run that is not running any more: the same lines as from a running one, read from its log files."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.ended)) if record.ended else None
    how = ("runs without a bus" if record.running else f"ended {when}" if when else "is not running") \
        + f" ({record.state})"
    print(f"arcsplit: run {record.run_id} {how}; its logs are in {record.path}"
          + ("; nothing more to follow" if args.follow else ""), file=sys.stderr)
    sources = {name: record.log_lines(name, 0) for name in record.log_names()}
    for line in pick_lines(sources, args.process, args.lines, args.verbose):
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="list running arcsplit instances (--all: and the runs that have ended)",
                       description="List running arcsplit instances; --all also the runs that have ended whose run "
                                   f"directories are kept (the newest {KEEP_RUNS}), with how and when each ended.")
    p.add_argument("--all", "-a", action="store_true", help="also the runs that have ended (their logs stay readable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_ps)

    p = sub.add_parser("stop", help="stop a running instance (llama-server first, then rpc-servers)",
                       description="Stop a running instance: llama-server first, then the rpc-servers.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest)")
    p.add_argument("--wait", type=durations.argtype("--wait", allow_zero=True), default=30.0, metavar="TIME",
                   help=f"wait this long for it to exit: {durations.HELP} (default 30s)")
    p.set_defaults(func=_stop)

    p = sub.add_parser("restart", help="restart a running instance's group",
                       description="Stop a running instance's group in order and start it again.")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest)")
    p.set_defaults(func=_restart)

    p = sub.add_parser("logs", help="show (and follow) a running instance's logs, or a finished run's",
                       description="Show the captured output of a running instance's processes, or of a run that "
                                   "has ended (from its run directory: `arcsplit ps --all` lists them).")
    p.add_argument("run", nargs="?", help="run id or a unique prefix (default: the newest running instance, else "
                                          "the newest run)")
    p.add_argument("--process", "-p", metavar="NAME", help="one process: server, rpc0, rpc1, ... (default: all)")
    p.add_argument("--lines", "-n", type=int, default=50, metavar="N", help="lines of history (default 50)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also llama-server's trace lines (arcsplit runs it at -lv 4 for its buffer sizes; without "
                        "this flag logs shows what llama-server's default verbosity would), its load-progress "
                        "state lines and the rpc-servers' connect/close lines; as `arcsplit dash --verbose`")
    p.set_defaults(func=_logs)
