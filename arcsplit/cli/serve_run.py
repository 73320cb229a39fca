"""``arcsplit serve``'s run: plan, pick the mode, run the group until SIGINT/SIGTERM, and say how it goes.

Its flags, and what it refuses before any plan, are cli/serve.py's: that module imports this one, and with it the
serving stack, only once the flags parsed, after a layout's ssh sessions are spawned (cli.main), so the imports
below overlap the logins.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import time
from pathlib import Path
from typing import Any, Mapping

import anyio
from anyio.from_thread import start_blocking_portal

from .. import _api
from .._warm import check_builds, warm_hosts
from ..errors import ArcsplitError, BadInput
from ..llama import webui
from ..llama.logs import load_stage
from ..llama.patches import missing_note
from ..model import read_header
from ..rig import MiB, Rig, load_layout
from ..modes import AUTO, Mode
from ..tuning.fingerprint import anything_kept
from ..tuning.picks import remembered, tuned
from ..proc.states import GroupState, MemberState
from . import say as _say


def alias_arg(value: str | None) -> str | None:
    """--alias NAME: the served model's name, as clients send it in ``model``; one printable line."""
    if value is None:
        return None
    name = value.strip()
    if not name or not name.isprintable():
        raise BadInput(f"--alias {value!r} is empty or holds control characters",
                       "give a name like --alias my-model (default: the model's general.name, else its file name)")
    return name


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
                        stop_grace=getattr(args, "stop_grace", None), canary=not getattr(args, "no_canary", False),
                        **{k: getattr(args, k) for k in ("cache_type", "kv_unified") if hasattr(args, k)},
                        **({"canary_every": args.canary_every} if getattr(args, "canary_every", None) else {}))


def build_config(args: argparse.Namespace) -> Any:
    """Everything before the first process: binaries, ports, model, rig, mode, plan -> ServeConfig."""
    p = _api.prepare(request_from_args(args))
    return p.config, p.decision, p.profile, p.rig


def serve(args: argparse.Namespace) -> int:
    """``arcsplit serve``, its flags parsed and checked (cli/serve.py's handler)."""
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
    if getattr(args, "tune", False):
        from ..tuning.runner import run_from  # start-up: httpx and the tune runner, only with --tune

        run_from(req, args.objective or "decode", args.budget, args.per_candidate,
                 say=lambda line: _say(f"tune: {line}"))
    got = None if getattr(args, "no_tune", False) else tuned(req, getattr(args, "objective", None))
    if got is None:
        return remembered(req)
    _say(got[1])
    return got[0]


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
    for line in prepared.route_list.lines():
        _say(line)
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
    marker = None if getattr(args, "layout", None) else _api.wrong_marker(request_from_args(args))
    return _api.instance(prepared, max_restarts=args.max_restarts, stall_timeout=args.stall_timeout,
                    hang_after=getattr(args, "hang_after", None),
                    bus=not args.no_bus or args.tui, bus_tcp=args.bus, systemd=True,
                    watchers=(metrics.run,) if metrics else (), say=say, launcher=launcher, mark_wrong=marker)


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
    shown: list[str] = []  # the log lines of the last failure, printed below its one line
    told: set[str] = set()  # the cards already said to need a driver reset
    async for ev in events:
        if as_json:
            if ev.kind != "log":
                print(json.dumps(ev.to_dict(), default=str), flush=True)
            continue
        if ev.kind == "progress":
            pct = int(100 * float(ev.data.get("value", 0)))
            if pct >= last_pct + 10 or pct == 100:
                last_pct = pct
                what = load_stage(ev.data.get("stage"), sup.config.plan.model_path)
                _say(f"loading {what}: {pct}%{_card_loads(ev.data.get('cards') or [])}")
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
                _say(backoff_line(ev.data, sup.policy.max_failures))
                for line in shown:
                    _say(f"    {line}")
                shown = []
                for reset in sup.status().get("resets") or []:  # a card lost again and again (run/faults.py)
                    if reset["card"] not in told:
                        told.add(reset["card"])
                        _say(f"note: {reset['line']}")
        elif ev.kind == "failure":  # comes before the backoff it explains
            shown = [str(line) for line in ev.data.get("lines") or []]
        elif ev.kind == "log" and str(ev.data.get("line", "")).startswith("arcsplit: "):
            _say(str(ev.data["line"]).removeprefix("arcsplit: "))  # the supervisor's own word: a hang, a stuck member
        elif ev.kind == "verdict":
            _say(f"recorded: {ev.data.get('failed_mode')} fails here; now {ev.data.get('fallback')}")
        elif ev.kind == "canary" and ev.data.get("verdict") == "reference":
            _say(f"output canary: its first answer ({ev.data.get('seconds'):.1f} s) is the reference; checked again "
                 "after each start and while idle (--canary-every)")
        elif ev.kind == "host":
            _say(host_line(ev.name, ev.data))


def backoff_line(data: Mapping[str, Any], limit: int) -> str:
    """The group failed and waits before its next start: the failures counted as a whole number (the count decays
    with time ready, --max-restarts's help says how; the fraction is the supervisor's, not the reader's)."""
    counted = round(float(data.get("failures") or 0))
    return (f"group failed ({data.get('error')}); restarting in {float(data.get('delay') or 0):.3g} s "
            f"({counted} failure{'s' if counted != 1 else ''} counted; it gives up past {limit})")


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
