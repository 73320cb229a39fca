"""``arcsplit serve``: plan, pick the mode, run the group until SIGINT/SIGTERM.

    arcsplit serve model.gguf --gpus 0,1 [--backend B] [--mode auto|...] [--ctx N] [--host H] [--port P]
                   [-- extra llama-server args]

Everything that can be checked before a process starts is checked first (binaries, ports, model, fit), so
a mistake is one line and exit 2 with nothing left running.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import anyio
from anyio.from_thread import start_blocking_portal

from .. import _api
from .._warm import check_builds, warm_hosts
from ..errors import ArcsplitError, BadInput
from ..netaddr import bus_address
from ..proc.ports import check_free
from ..llama import webui
from ..llama.patches import missing_note
from ..model import read_header
from ..rig import MiB, Rig, load_layout
from ..modes import AUTO, CHOICES as MODE_CHOICES, Mode
from ..route import OUTPUT_LAYER_CHOICES
from ..tune.fingerprint import anything_kept
from ..proc.states import GroupState, MemberState
from . import say as _say
from .options import add_card_options, add_llama_dir



def request_from_args(args: argparse.Namespace) -> Any:
    """The CLI's flags as a ServeRequest (the same one the Python API builds)."""
    return _api.ServeRequest(model=args.model, gpus=args.gpus, backend=args.backend, mode=args.mode, ctx=args.ctx,
                        parallel=args.parallel, host=args.host, port=args.port, rpc_host=args.rpc_host,
                        rpc_ports=args.rpc_ports, threads=args.threads, ubatch=args.ubatch, rpc_cache=args.rpc_cache,
                        rpc_seed=not args.no_rpc_seed,
                        cpu_memory_mib=args.cpu_memory, output_layer=args.output_layer,
                        moe_offload=args.moe_offload, host_memory_mib=args.host_memory,
                        llama_dir=args.llama_dir, build=args.build, extra_args=tuple(args.extra),
                        alias=alias_arg(getattr(args, "alias", None)),
                        stop_grace=getattr(args, "stop_grace", None),
                        **{k: getattr(args, k) for k in ("cache_type", "kv_unified") if hasattr(args, k)})


def alias_arg(value: str | None) -> str | None:
    """--alias NAME: the served model's name, as clients send it in ``model``; one printable line."""
    if value is None:
        return None
    name = value.strip()
    if not name or not name.isprintable():
        raise BadInput(f"--alias {value!r} is empty or holds control characters",
                       "give a name like --alias my-model (default: the model's general.name, else its file name)")
    return name


def build_config(args: argparse.Namespace) -> Any:
    """Everything before the first process: binaries, ports, model, rig, mode, plan -> ServeConfig."""
    p = _api.prepare(request_from_args(args))
    return p.config, p.decision, p.profile, p.rig


def check_serve_flags(args: argparse.Namespace) -> None:
    """serve's own flags that no plan reads (``arcsplit unit serve`` checks them too)."""
    if args.max_restarts < 0:
        raise BadInput(f"--max-restarts {args.max_restarts} is negative", "give 0 or more failures to tolerate")
    if args.stall_timeout <= 0:
        raise BadInput(f"--stall-timeout {args.stall_timeout} must be positive", "give seconds, e.g. 120")


def check_flags(args: argparse.Namespace) -> None:
    """What serve refuses without importing its stack: checked again by cli.main before a layout's early sessions
    start, so a refused run never logs in to another host."""
    check_serve_flags(args)
    if args.metrics_port is not None and args.metrics_port == args.port:
        raise BadInput(f"--metrics-port {args.metrics_port} is llama-server's --port",
                       "give arcsplit's metrics a port of their own")
    if args.bus:  # checked like the metrics endpoint, before any plan: a taken port is the only line
        host, port = bus_address(args.bus)
        for p in (port, port + 1):
            check_free(host, p, "the bus: events on PORT, control on PORT+1", "--bus address")
    model = Path(args.model)
    if not model.exists():
        raise BadInput(f"model {model} does not exist", "pass the path of a .gguf file")
    if not model.is_file():
        raise BadInput(f"model {model} is not a regular file", "pass the path of a .gguf file")


def _serve(args: argparse.Namespace) -> int:
    check_flags(args)
    args.metrics = None  # the endpoint, bound first: a taken port is the only line
    if args.metrics_port is not None:
        from ..telemetry.prometheus import MetricsEndpoint  # prometheus_client: only with --metrics-port

        args.metrics = MetricsEndpoint(args.host, args.metrics_port)

    early = getattr(args, "early", None)
    if early is not None:  # cli.main read the layout and started its sessions before its imports
        early.then = functools.partial(_serve_warm, args, early.rig, early.sessions)  # run in cli.main's event loop
        return 0
    rig = load_layout(args.layout) if getattr(args, "layout", None) else None
    if rig is not None and rig.hosts and not args.tui:
        return anyio.run(_serve_warm, args, rig)
    prepared = _api.prepare(_tuned_request(args) if rig is None else request_from_args(args), rig, progress=_say)
    _tell(prepared, args)
    if args.tui:
        return _serve_with_dashboard(prepared, args)
    return anyio.run(_run, prepared, args)


def _tuned_request(args: argparse.Namespace) -> Any:
    """The request, as ``arcsplit tune``'s pick for this rig runs it when one is kept (--mode, --no-tune: as
    asked); ``--tune`` measures first (docs/tune.md)."""
    req = request_from_args(args)
    if not getattr(args, "tune", False) and (getattr(args, "no_tune", False) or req.mode != AUTO
                                             or not anything_kept()):
        return req
    from ..tune import runner

    if getattr(args, "tune", False):
        runner.run_from(req, args.objective, args.budget, args.per_candidate, say=lambda line: _say(f"tune: {line}"))
    got = None if getattr(args, "no_tune", False) else runner.tuned(req, getattr(args, "objective", None))
    if got is None:
        return req
    _say(got[1])
    return got[0]


TUNE_OBJECTIVES = ("decode", "prefill", "streams")  # tune/candidates.py's OBJECTIVES, without importing tune/


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """--objective, --budget, --per-candidate: ``arcsplit tune``'s, and ``serve --tune``'s."""
    p.add_argument("--objective", choices=TUNE_OBJECTIVES, default="decode",
                   help="what the pick is fastest at: decode (one stream), prefill, or streams (every slot busy: "
                        "--parallel N) (default: decode)")
    p.add_argument("--budget", type=float, default=300.0, metavar="S",
                   help="seconds the whole tune may take, start-ups included (default: 300)")
    p.add_argument("--per-candidate", type=float, default=15.0, metavar="S",
                   help="seconds of measuring per started candidate (default: 15)")


async def _serve_warm(args: argparse.Namespace, rig: Rig, early: Any = None) -> int:
    """A layout with other hosts: their ssh logins and node agents start first (``early``: cli.main started them
    before its imports), then this process plans, so the group starts on sessions already open. Everything
    started is ended on every exit path (NodeLauncher.close)."""
    failure: ArcsplitError | None = None
    rc = 1
    async with warm_hosts(rig.hosts, early) as launcher:
        try:
            prepared = await anyio.to_thread.run_sync(_prepare_layout, args, rig)
            _tell(prepared, args)
            check_builds(launcher, prepared.config.server_bin)
            rc = await _run(prepared, args, launcher)
        except ArcsplitError as exc:  # raised after the task group, as itself, not in an ExceptionGroup
            failure = exc
    if failure is not None:
        raise failure
    return rc


def _prepare_layout(args: argparse.Namespace, rig: Rig) -> Any:
    return _api.prepare(request_from_args(args), rig, progress=_say)


def _tell(prepared: Any, args: argparse.Namespace) -> None:
    """What serve says before the group starts: warnings, notes, the mode's reasons, the chat template."""
    for text in prepared.warnings:
        _say(f"warning: {text}")
    for text in prepared.notes:
        _say(text)
    if args.tui:
        return
    for reason in prepared.decision.reasons:
        _say(f"mode {prepared.decision.mode}: {reason}")
    note = chat_note(prepared.config.plan.model_path, args.extra)
    if note:
        _say(f"note: {note}")
    if prepared.config.ui_dir == str(webui.FALLBACK_DIR):
        why = webui.missing_reason(webui.root_of(Path(prepared.config.server_bin).parent))
        _say(f"note: llama.cpp's web UI is not built ({why}); / shows how to get it")
    if prepared.config.mode in (Mode.HYBRID, Mode.RPC):
        note = missing_note(Path(prepared.config.server_bin).parent)
        if note:
            _say(f"note: {note}")


def chat_note(model: str, extra: list[str]) -> str | None:
    """What /v1/chat/completions will do with a model that carries no chat template (None when it has one).

    llama-server then formats chat as ChatML without a word (common/chat.cpp), which a model not trained on it
    answers with garbage, so the user hears it here."""
    if "tokenizer.chat_template" in read_header(model).metadata:
        return None
    if any(a.startswith("--chat-template") for a in extra):
        return "the model has no chat template of its own; chat uses the one you gave (--chat-template)"
    return ("the model has no chat template, so llama-server formats chat as ChatML, which this model may not "
            "follow: use /v1/completions, or name a template with `-- --chat-template NAME`")


def _instance(prepared: Any, args: argparse.Namespace, say: Any, launcher: Any = None) -> Any:
    """The instance, telling systemd about itself when run by it, and watched by the metrics endpoint if any."""
    metrics = getattr(args, "metrics", None)
    return _api.instance(prepared, max_restarts=args.max_restarts, stall_timeout=args.stall_timeout,
                    bus=not args.no_bus or args.tui, bus_tcp=args.bus, systemd=True,
                    watchers=(metrics.run,) if metrics else (), say=say, launcher=launcher)


def _serve_with_dashboard(prepared: Any, args: argparse.Namespace) -> int:
    """``--tui``: the group runs on a private event-loop thread, the dashboard owns the terminal (main thread);
    quitting the dashboard stops the group in order."""
    from ..tui.app import run_dashboard  # textual: only with --tui

    instance = _instance(prepared, args, None)
    with start_blocking_portal() as portal:
        running = portal.start_task_soon(instance.run)
        while instance.bus_info is None and not running.done():
            time.sleep(0.05)
        if running.done():
            running.result()  # the start failed: raise its one-line error
        try:
            run_dashboard(lambda: _api.Client(instance.bus_info))
        finally:
            portal.call(instance.stop)
            try:
                running.result()
            except ArcsplitError:
                pass  # the dashboard already showed why the group stopped
    return 0


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
    _add_arguments(parser)
    ns = parser.parse_args([])
    ns.extra = []
    return vars(ns)


async def _run(prepared: Any, args: argparse.Namespace, launcher: Any = None) -> int:
    instance = _instance(prepared, args, _say, launcher)
    metrics = getattr(args, "metrics", None)
    sup = instance.supervisor
    events = sup.subscribe(10_000)
    failure: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_report, events, sup, metrics.url if metrics else None, args.json_events,
                      getattr(args, "demo", None))
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async def on_signal() -> None:
                async for sig in signals:
                    _say(f"{signal.Signals(sig).name}: stopping llama-server, then the rpc-servers")
                    sup.stop()

            tg.start_soon(on_signal)
            try:
                await instance.run()
            except ArcsplitError as exc:  # raised after the task group, as itself, not in an ExceptionGroup
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return 0


async def _report(events: Any, sup: Any, metrics_url: str | None, as_json: bool, demo: str | None = None) -> None:
    """Progress and state changes on stderr (or every event as a JSON line on stdout with --json-events)."""
    last_pct = -10
    async for ev in events:
        if as_json:
            if ev.kind != "log":
                print(json.dumps(ev.to_dict(), default=str), flush=True)
            continue
        if ev.kind == "progress":
            pct = int(100 * float(ev.data.get("value", 0)))
            if pct >= last_pct + 10 or pct == 100:
                last_pct = pct
                _say(f"loading {ev.data.get('stage') or 'model'}: {pct}%{_card_loads(ev.data.get('cards') or [])}")
        elif ev.kind == "state" and ev.data.get("state") == MemberState.READY and ev.name != "server":
            _say(f"{ev.name} ready on {ev.data.get('endpoint')} (pid {ev.data.get('pid')})")
        elif ev.kind == "group":
            state = ev.data.get("state")
            if state == GroupState.STARTING:
                last_pct = -10
            elif state == GroupState.READY:
                metrics = f"; arcsplit metrics {metrics_url}" if metrics_url else ""
                print(f"arcsplit: serving {sup.url} (mode {sup.config.mode}, {len(sup.config.plan.cards)} card(s))"
                      f"{metrics}", flush=True)
                for line in _buffer_table(ev.data.get("buffers") or {}):
                    _say(line)
                for note in ev.data.get("notes") or ():
                    _say(f"note: {note}")
                if demo:
                    _example(sup.url, demo, sup.config.alias or "")
            elif state == GroupState.BACKOFF:
                _say(f"group failed ({ev.data.get('error')}); restart {ev.data.get('failures')} in "
                     f"{ev.data.get('delay'):.1f} s")
        elif ev.kind == "verdict":
            _say(f"recorded: {ev.data.get('failed_mode')} fails here; now {ev.data.get('fallback')}")
        elif ev.kind == "host":
            _say(host_line(ev.name, ev.data))


SLOW_AGENT_START_S = 0.3  # Python and the agent's first imports take ~0.1-0.15 s on a small machine
SLOW_LOGIN_S = 0.5  # the rest (connect, key exchange, authentication): ~0.15-0.3 s on a LAN, OpenSSH 9.2's default


def host_line(name: str, data: Mapping[str, Any]) -> str:
    """What serve says when a host's session opens: the login and the agent's start, and of that the agent's own
    start there (from sshd's fork of the login shell), with a hint when either part is slow: the shell's rc runs
    on every start, and so does the login (its key exchange is the user's ssh's choice)."""
    opened = data.get("opened_s")
    line = f"host {name} ({data.get('ssh')}): ssh login and node agent in {opened:.2f} s"
    started = data.get("started_s")
    if isinstance(started, (int, float)):
        line += f", of which the agent's start there {started:.2f} s"
        if started > SLOW_AGENT_START_S:
            line += (f" (slow: the login shell's rc on {name} runs first on every start; `time ssh "
                     f"{data.get('ssh')} true` shows it, docs/multihost.md)")
        elif isinstance(opened, (int, float)) and opened - started > SLOW_LOGIN_S:
            line += (f" (the login itself took {opened - started:.2f} s: connection, key exchange and "
                     f"authentication, on every start; `ssh -v {data.get('ssh')} true` shows each step, "
                     "docs/multihost.md)")
    return line


def _card_loads(cards: list[dict[str, Any]]) -> str:
    """The "(card 0 35/35 MiB, card 1 28/56 MiB, host 28/28 MiB)" of a load line, from a progress event."""
    parts = [f"{'host' if c['card'] is None else 'card ' + str(c['card'])} {c['done'] // MiB}/{c['total'] // MiB} MiB"
             for c in cards]
    return f" ({', '.join(parts)})" if parts else ""


def _buffer_table(buffers: dict[str, Any]) -> list[str]:
    rows = ["card  device   model MiB (plan)    KV MiB (plan)  compute MiB (plan)"]
    for i, c in enumerate(buffers.get("cards", [])):
        a, p = c.get("actual", {}), c.get("plan", {})
        cols = [f"{a.get(k, 0) / MiB:8.1f} ({p.get(k, 0) / MiB:6.1f})" for k in ("model", "KV", "compute")]
        rows.append(f"{i:<5} {c.get('device', ''):<8} {cols[0]:>18} {cols[1]:>16} {cols[2]:>19}")
    host = buffers.get("host") or {}
    if host:
        rows.append("host  (llama-server CPU) " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in host.items()))
    return rows


def _example(url: str, kind: str, model: str) -> None:
    """The request the demo prints: the model by its served name, as an OpenAI client would send it."""
    name = json.dumps(model).replace("'", "'\\''")  # inside the shell's single quotes
    if kind == "chat":
        request = (f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                   f"    -d '{{\"model\": {name}, \"messages\": [{{\"role\": \"user\", "
                   "\"content\": \"Name the capital of France.\"}]}'\n"
                   f"or open {url} in a browser")
    else:  # a base model continues text but has no chat template
        request = (f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\\n"
                   f"    -d '{{\"model\": {name}, \"prompt\": \"The capital of France is\", \"max_tokens\": 16, "
                   "\"temperature\": 0}'")
    print(f"\ntry it (Ctrl-C stops everything):\n{request}\n", flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model across cards and keep it running",
                       description="Plan the split, pick the mode (one context, hybrid or rpc-servers), start "
                                   "rpc-servers and llama-server, and restart the group if any member dies. "
                                   "Arguments after -- go to llama-server.")
    p.add_argument("model", help="GGUF file (first shard of a split model)")
    _add_arguments(p)
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
    p.add_argument("--mode", choices=MODE_CHOICES, default="auto", help="how the cards share the model (default: auto)")
    p.add_argument("--ctx", type=_ctx, metavar="N|max", help="context length (default: max, the largest that fits)")
    p.add_argument("--parallel", "--np", type=int, default=1, metavar="N",
                   help="parallel sequences (slots), llama-server -np (default: 1)")
    p.add_argument("--host", default="127.0.0.1", help="llama-server address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="llama-server port (default: 8080)")
    p.add_argument("--rpc-host", default="127.0.0.1",
                   help="rpc-server address (default: 127.0.0.1; anything else is reachable from the network)")
    p.add_argument("--rpc-ports", metavar="LIST", help="rpc-server ports, one per rpc-server (default: free ports)")
    p.add_argument("--threads", type=int, metavar="N", help="threads per rpc-server (default: cores / cards)")
    p.add_argument("--rpc-cache", action="store_true",
                   help="rpc-servers cache weight tensors on local disk (rpc-server -c), so a restart reloads faster")
    p.add_argument("--no-rpc-seed", action="store_true",
                   help="send the weights to the rpc-servers over the socket, as stock llama.cpp does (default: with a "
                        "build carrying patch 0006 they read them from the GGUF on this machine, no copy)")
    p.add_argument("--ubatch", type=int, metavar="N",
                   help="micro-batch size, -ub (default: 256 on hybrid/rpc routes, measured faster; else 512)")
    p.add_argument("--output-layer", choices=OUTPUT_LAYER_CHOICES, default="auto",
                   help="hybrid mode: local puts the output layer on llama-server's own card (-ot), so the logits "
                        "do not cross the RPC link; last/auto keep llama.cpp's place (the last card)")
    add_moe_options(p)
    p.add_argument("--alias", metavar="NAME",
                   help="the model's name in /v1/models and clients' requests (default: the GGUF's general.name, "
                        "else its file name)")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_group_arguments(p)
    p.add_argument("--tune", action="store_true",
                   help="run `arcsplit tune` first (results kept for this rig are reused), then serve its pick")
    p.add_argument("--no-tune", action="store_true",
                   help="ignore a tuned result for this rig: the fixed default order decides (as --mode does)")
    add_tune_arguments(p)
    p.add_argument("--layout", metavar="FILE",
                   help="serve on the cards of a layout TOML, other hosts' included ([[hosts]]: their rpc-servers "
                        "are started over ssh by `arcsplit node --stdio`; docs/multihost.md)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="failures counted before giving up; each 30 s ready halves the count (default: 5)")
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="S",
                   help="give up a load after this long without any progress (default: 120)")
    p.add_argument("--stop-grace", type=float, default=None, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping or restarting (default: per backend, "
                        "30 on sycl, 10 elsewhere; docs/runtime.md)")
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
