"""``arcsplit serve``: its flags, and what it refuses before anything is planned or started.

    arcsplit serve model.gguf --gpus 0,1 [--backend B] [--mode auto|...] [--ctx N] [--host H] [--port P]
                   [-- extra llama-server args]

Everything that can be checked before a process starts is checked first (binaries, ports, model, fit), so
a mistake is one line and exit 2 with nothing left running. This module holds the parser and the checks that need
no plan, and imports nothing of the serving stack: cli.main parses and checks a layout's serve with it before the
hosts' ssh sessions start, and the run (cli/serve_run.py, which imports the stack) comes after they are spawned,
while they log in. ``plan``, ``tune`` and ``unit`` share its flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import durations
from ..errors import BadInput
from ..modes import AUTO, CHOICES as MODE_CHOICES
from ..netaddr import LOOPBACK, SERVER_PORT, bus_address
from ..objectives import OBJECTIVES
from ..proc.ports import check_free, check_host
from ..route import NATIVE_UBATCH, OUTPUT_LAYER_CHOICES, RPC_UBATCH
from .options import add_card_options, add_llama_dir


def hang_after_arg(text: str) -> float:
    """--hang-after: a duration of at least 5 s (the watchdog reads progress every 2 s while busy), 0 or off."""
    if text.strip().lower() == "off":
        return 0.0
    return durations.argtype("--hang-after", allow_zero=True, minimum=5.0, maximum=86400.0)(text)


def check_serve_flags(args: argparse.Namespace) -> None:
    """serve's own flags that no plan reads (``arcsplit unit serve`` checks them too)."""
    if args.max_restarts < 0:
        raise BadInput(f"--max-restarts {args.max_restarts} is negative", "give 0 or more failures to tolerate")


def check_flags(args: argparse.Namespace) -> None:
    """What serve refuses without importing its stack: checked again by cli.main before a layout's early sessions
    start, so a refused run never logs in to another host."""
    check_serve_flags(args)
    if args.metrics_port is not None and args.metrics_port == args.port:
        raise BadInput(f"--metrics-port {args.metrics_port} is llama-server's --port",
                       "give arcsplit's metrics a port of their own")
    check_ports(args)
    model = Path(args.model)
    if not model.exists():
        raise BadInput(f"model {model} does not exist", "pass the path of a .gguf file")
    if not model.is_file():
        raise BadInput(f"model {model} is not a regular file", "pass the path of a .gguf file")


def check_ports(args: argparse.Namespace) -> None:
    """The ports the user named are free now (llama-server's --port, --metrics-port, the bus's), checked before
    anything slow runs (a tune, the demo's build and model install, other hosts' logins): a taken port is then the
    only line. Out-of-range numbers are decide/prepare.py's to name; the rpc-servers' ports are checked there."""
    if 0 < args.port < 65536:
        check_host(args.host, "--host")
        check_free(args.host, args.port, "llama-server", "--port")
    if args.metrics_port is not None and 0 < args.metrics_port < 65536:
        check_free(args.host, args.metrics_port, "arcsplit's metrics", "--metrics-port")
    if args.bus:  # checked like the metrics endpoint, before any plan
        host, port = bus_address(args.bus)
        for p in (port, port + 1):
            check_free(host, p, "the bus: events on PORT, control on PORT+1", "--bus address")


def add_tune_arguments(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """--objective, --budget, --per-candidate: ``arcsplit tune``'s, and ``serve --tune``'s. serve's --objective
    has no default: without it serve runs the pick of the objective this rig was last tuned for (a tune by ttft
    must not leave serve untuned), and --tune measures by decode."""
    p.add_argument("--objective", choices=OBJECTIVES, default=None if serve else "decode",
                   help="what the pick is fastest at: decode (one stream), prefill, streams (every slot busy: "
                        "--parallel N), or ttft (the shortest time to first token of a prompt) "
                        + ("(default: the pick of the objective last tuned for; --tune: decode)" if serve
                           else "(default: decode)"))
    p.add_argument("--budget", type=durations.argtype("--budget"), default=300.0, metavar="TIME",
                   help=f"how long the whole tune may take, start-ups included: {durations.HELP} (default: 5m)")
    p.add_argument("--per-candidate", type=durations.argtype("--per-candidate"), default=15.0, metavar="TIME",
                   help=f"measuring time per started candidate: {durations.HELP} (default: 15s)")


def _serve(args: argparse.Namespace) -> int:
    """serve's handler: the flags checked, then the serving stack imported and run (cli/serve_run.py)."""
    check_flags(args)
    from . import serve_run  # start-up: the serving stack, after a layout's ssh sessions are spawned (cli.main)

    return serve_run.serve(args)


def serve_from_args(args: argparse.Namespace, demo: str | None = None) -> int:
    """Entry for other commands (``arcsplit demo``) that fill in a serve Namespace themselves."""
    defaults = _defaults()
    for key, value in defaults.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    args.demo = demo  # "chat" or "completion": the example printed once it serves
    return _serve(args)


def _defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args([])
    ns.extra = []
    return vars(ns)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model across cards and keep it running",
                       description="Plan the split, pick the mode (one context, hybrid or rpc-servers), start "
                                   "rpc-servers and llama-server, and restart the group if any member dies. "
                                   "Arguments after -- go to llama-server.")
    p.add_argument("model", help="GGUF file (first shard of a split model)")
    add_serve_arguments(p)
    p.set_defaults(func=_serve, check=check_flags, extra=[])
    split_at_double_dash(p)


def _ctx(value: str) -> int | None:
    """--ctx N, or 'max' (the default): the largest context that fits."""
    if value.strip().lower() == "max":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ctx {value!r} is not a number or 'max'") from None


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} must be positive")
    return n


def moe_offload_arg(value: str) -> int | None:
    """--moe-offload: 'auto' (None: the fewest layers that make it fit), 'off' (0) or a layer count."""
    v = value.strip().lower()
    if v in ("auto", "off"):
        return None if v == "auto" else 0
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--moe-offload {value!r} is not auto, off or a layer count") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"--moe-offload {n} must be 0 or more")
    return n


def add_moe_options(p: argparse.ArgumentParser) -> None:
    """--moe-offload and --host-memory, shared by plan and serve."""
    p.add_argument("--moe-offload", type=moe_offload_arg, default=None, metavar="auto|N|off",
                   help="keep the routed experts of the first N layers in host RAM (--n-cpu-moe); auto: the fewest "
                        "layers that make the model fit, none when it fits (default: auto)")
    p.add_argument("--host-memory", type=_positive, metavar="MiB",
                   help="host RAM those experts may use (default: available RAM less the CPU cards' budgets; "
                        "with --layout: not checked)")


def add_group_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that decide what a group runs: shared by ``serve`` and ``plan``, so both build the same Route."""
    add_card_options(p)
    add_llama_dir(p)
    p.add_argument("--mode", choices=MODE_CHOICES, default=AUTO, help="how the cards share the model (default: auto)")
    p.add_argument("--ctx", type=_ctx, metavar="N|max", help="context length (default: max, the largest that fits)")
    p.add_argument("--parallel", "--np", type=int, default=1, metavar="N",
                   help="parallel sequences (slots), llama-server -np (default: 1)")
    p.add_argument("--host", default=LOOPBACK, help=f"llama-server address (default: {LOOPBACK})")
    p.add_argument("--port", type=int, default=SERVER_PORT, help=f"llama-server port (default: {SERVER_PORT})")
    p.add_argument("--rpc-host", default=LOOPBACK,
                   help=f"rpc-server address (default: {LOOPBACK}; anything else is reachable from the network)")
    p.add_argument("--rpc-ports", metavar="LIST", help="rpc-server ports, one per rpc-server (default: free ports)")
    p.add_argument("--threads", type=int, metavar="N", help="threads per rpc-server (default: cores / cards)")
    p.add_argument("--rpc-cache", action="store_true",
                   help="rpc-servers cache weight tensors on local disk (rpc-server -c), so a restart reloads faster")
    p.add_argument("--no-rpc-seed", action="store_true",
                   help="send the weights to the rpc-servers over the socket, as stock llama.cpp does (default: with a "
                        "build carrying patch 0006 they read them from the GGUF on this machine, no copy)")
    p.add_argument("--ubatch", type=int, metavar="N",
                   help=f"micro-batch size, -ub (default: {RPC_UBATCH} on hybrid/rpc routes, measured faster; "
                        f"else {NATIVE_UBATCH})")
    p.add_argument("--output-layer", choices=OUTPUT_LAYER_CHOICES, default="auto",
                   help="hybrid mode: local puts the output layer on llama-server's own card (-ot), so the logits "
                        "do not cross the RPC link; last/auto keep llama.cpp's place (the last card)")
    add_moe_options(p)
    p.add_argument("--alias", metavar="NAME",
                   help="the model's name in /v1/models and clients' requests (default: the GGUF's general.name, "
                        "else its file name)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """serve's flags but the model (``arcsplit demo`` fills in the rest of a serve Namespace from them)."""
    add_group_arguments(p)
    p.add_argument("--tune", action="store_true",
                   help="run `arcsplit tune` first (results kept for this rig are reused), then serve its pick")
    p.add_argument("--no-tune", action="store_true",
                   help="ignore a tuned result for this rig: the fixed default order decides (as --mode does)")
    add_tune_arguments(p, serve=True)
    p.add_argument("--layout", metavar="FILE",
                   help="serve on the cards of a layout TOML, other hosts' included ([[hosts]]: their rpc-servers "
                        "are started over ssh by `arcsplit node --stdio`; docs/multihost.md)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="failures counted before giving up; each 30 s ready halves the count (default: 5)")
    p.add_argument("--stall-timeout", type=durations.argtype("--stall-timeout"), default=120.0, metavar="TIME",
                   help=f"give up a load after this long without any progress: {durations.HELP} (default: 2m)")
    p.add_argument("--stop-grace", type=durations.argtype("--stop-grace", allow_zero=True, maximum=3600.0),
                   default=None, metavar="TIME",
                   help=f"time between SIGTERM and SIGKILL when stopping or restarting: {durations.HELP}, at most 1h "
                        "(default: per backend, 30s on sycl, 10s elsewhere; docs/runtime.md)")
    every = durations.argtype("--canary-every", minimum=durations.CANARY_MIN_S, maximum=durations.CANARY_MAX_S)
    p.add_argument("--canary-every", type=every, default=None, metavar="TIME",
                   help="check the output (a short greedy answer against tune's, else the first one) this often "
                        "while every slot is idle, and after each start; a mismatch moves to the next route "
                        f"({durations.HELP}; default: 10m; 1s to 7d; docs/usage.md)")
    p.add_argument("--no-canary", action="store_true", help="no output canary")
    p.add_argument("--hang-after", type=hang_after_arg, default=None, metavar="TIME",
                   help="restart the group when its compute makes no progress this long while every process is "
                        "alive (a card hung in its driver); longer where the route has shown longer pauses or its "
                        f"processes compute; 0 or off: never (default: 20s; {durations.HELP}; docs/watchdog.md)")
    p.add_argument("--json-events", action="store_true", help="print every event but log lines as JSON on stdout")
    p.add_argument("--bus", metavar="tcp://HOST:PORT",
                   help="serve the bus over TCP with CURVE keys: events on PORT, control on PORT+1 "
                        "(default: private ipc:// sockets)")
    p.add_argument("--no-bus", action="store_true", help="do not open the control/event bus")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve arcsplit's own metrics (cards, processes, restarts) for Prometheus on "
                        "http://HOST:P/metrics (HOST is --host); llama-server's /metrics stays on --port")
    p.add_argument("--tui", action="store_true", help="run the dashboard in the foreground")


def split_at_double_dash(p: argparse.ArgumentParser) -> None:
    """Everything after ``--`` goes to llama-server untouched. argparse alone cannot do this once a positional
    (the model) has been matched, so the subparser splits its own arguments first."""
    parse = p.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        extra: list[str] = []
        if "--" in args:
            i = args.index("--")
            args, extra = args[:i], args[i + 1:]
        ns, rest = parse(args, namespace)
        ns.extra = extra
        return ns, rest

    p.parse_known_args = parse_known_args  # type: ignore[method-assign]
