"""The ``arcsplit`` command. Each command group lives in its own module and only calls the public API.

Exit codes: 0 ok, 2 bad input or cannot do it (an ArcsplitError), 1 unexpected failure.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
from typing import Any, Sequence

from .. import __version__
from ..errors import ArcsplitError

# Modules that each define ``register(subparsers)``; a command's handler is ``args.func(args) -> int``.
_COMMAND_MODULES = ("llama", "devices", "model", "plan", "layouts", "doctor", "serve", "tune", "control", "dash", "demo", "report",
                    "unit", "node")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2, like every other arcsplit error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"arcsplit: {message}; see `{self.prog} --help`\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; ``only``: just that command's (a command's module imports what it runs: the node
    agent, started over ssh on every group start, should not pay for the serving stack's imports)."""
    parser = _Parser(prog="arcsplit", description="Run one llama.cpp model across several GPUs and keep it running.")
    parser.add_argument("--version", action=_Version, nargs=0, help="show arcsplit's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in (only,) if only in _COMMAND_MODULES else _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


class _Version(argparse.Action):
    """--version (arcsplit.__version__, which pyproject reads too)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version())
        parser.exit(0)


def _version() -> str:
    return f"arcsplit {__version__}"


def say(text: str) -> None:
    """A progress or notice line on stderr: stdout stays the command's output (its --json)."""
    print(f"arcsplit: {text}", file=sys.stderr, flush=True)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # a layout with other hosts: their ssh sessions start before anything is imported
        from .._warm import layout_hosts, run_early

        rig = layout_hosts(argv)
        if rig is not None:
            try:  # the flags first: a refused run logs in to no host (a usage error exits 2 here)
                _check_serve(argv)
            except ArcsplitError as exc:
                print(f"arcsplit: {exc}", file=sys.stderr)
                return exc.exit_code
            try:
                return run_early(rig, lambda early: _main(argv, early))
            except ArcsplitError as exc:  # raised by serve, run in run_early's event loop after _main
                print(f"arcsplit: {exc}", file=sys.stderr)
                return exc.exit_code
            except KeyboardInterrupt:  # before serve's own handling: every session started is ended already
                print("arcsplit: interrupted", file=sys.stderr)
                return 130
    return _main(argv)


def _check_serve(argv: list[str]) -> None:
    """serve's flags parsed and checked as serve will (cli/serve.py check_flags), before its sessions start: that
    module imports nothing of the serving stack (cli/serve_run.py), which comes while the sessions log in."""
    args = build_parser("serve").parse_args(argv)
    args.check(args)


def _main(argv: list[str], early: Any = None) -> int:
    """``early``: serve's host sessions already running (_warm.EarlyStart); this then runs in a worker thread and
    serve leaves its run in ``early.then``."""
    with _imports_without_gc():
        parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if early is not None:
        args.early = early
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ArcsplitError as exc:
        print(f"arcsplit: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("arcsplit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


class _imports_without_gc:
    """The commands' imports with the cyclic garbage collector paused, then frozen out of its later passes.

    Importing creates hundreds of thousands of long-lived objects (modules, classes, dataclasses, enums) and next to
    no garbage; each full collection during the imports walks all of them again, which cost ``--help``, ``plan`` and
    the node agent 20-50 ms of CPU (bench/startup.py). After the imports, gc.freeze() moves what they made to the
    permanent generation, so a long-running serve's collections skip it too; reference counting frees as before.
    """

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.freeze()
        if self.was_enabled:
            gc.enable()


def run() -> None:
    try:
        rc = main()
    except KeyboardInterrupt:  # a Ctrl-C during the imports, before any command's own handling
        print("arcsplit: interrupted", file=sys.stderr)
        rc = 130
    sys.exit(rc)
