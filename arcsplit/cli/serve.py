"""``arcsplit serve``: plan, pick the mode, run the group until SIGINT/SIGTERM.

    arcsplit serve model.gguf --gpus 0,1 [--backend B] [--mode auto|...] [--ctx N] [--host H] [--port P]
                   [-- extra llama-server args]

Everything that can be checked before a process starts is checked first (binaries, ports, model, fit), so
a mistake is one line and exit 2 with nothing left running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from .._dirs import cache_dir
from ..errors import ArcsplitError, BadInput
from ..rig import MiB
from .devices import add_card_options
from .llama import add_llama_dir

MODE_CHOICES = ("auto", "single", "multi", "multi+workaround", "hybrid", "rpc")


def _observed_path(backend: str) -> Path:
    return cache_dir() / "observed" / f"{backend}.json"


def load_observed(backend: str) -> dict[str, bool]:
    """Modes that failed on this machine before (written when a load hit the allocation signature)."""
    try:
        data = json.loads(_observed_path(backend).read_text(encoding="utf-8"))
        return {str(k): bool(v["ok"]) for k, v in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def record_observed(backend: str, mode: str, ok: bool, message: str) -> None:
    path = _observed_path(backend)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[mode] = {"ok": ok, "message": message[:500], "time": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


def build_config(args: argparse.Namespace) -> Any:
    """Everything before the first process: binaries, ports, model, rig, mode, plan -> ServeConfig."""
    from ..llama.devices import discover_rig, parse_gpus
    from ..llama.locate import find_llama
    from ..llama.mode import choose_mode
    from ..run.ports import check_free
    from ..run.specs import LOOPBACK, ServeConfig

    if args.port is not None and not 0 < args.port < 65536:
        raise BadInput(f"--port {args.port} is not a port number", "use 1-65535")
    rpc_ports = _parse_ports(args.rpc_ports)
    if args.threads is not None and args.threads < 1:
        raise BadInput(f"--threads {args.threads} must be at least 1", "give rpc-server threads per card")
    gpus = parse_gpus(args.gpus)
    binaries = find_llama(args.llama_dir, backend=args.backend)
    check_free(args.host, args.port, "llama-server", "--port")
    for p in rpc_ports or ():
        check_free(args.rpc_host, p, "rpc-server", "--rpc-ports")
    model = Path(args.model)
    if not model.is_file():
        raise BadInput(f"model {model} does not exist", "pass the path of a .gguf file")
    from ..model import load_profile

    profile = load_profile(model)
    rig = discover_rig(args.backend, gpus, binaries if args.backend != "cpu" else None, args.cpu_memory)
    forced = None if args.mode == "auto" else args.mode
    decision = choose_mode(args.backend, len(rig.cards), forced=forced, verdict=_verdict(args, len(rig.cards)),
                           probe_results=load_observed(args.backend) or None)
    plan = _make_plan(profile, rig, args, decision.mode)
    if args.rpc_host != LOOPBACK:
        print(f"arcsplit: warning: rpc-servers listen on {args.rpc_host}; anyone who can reach it can run code "
              f"on them - keep it on a trusted network", file=sys.stderr)
    config = ServeConfig(plan=plan, mode=decision.mode, backend=args.backend, server_bin=str(binaries.server),
                         rpc_bin=str(binaries.rpc_server), host=args.host, port=args.port, rpc_host=args.rpc_host,
                         rpc_ports=tuple(rpc_ports) if rpc_ports else None, threads=args.threads,
                         cores=os.cpu_count() or 1, extra_args=tuple(args.extra),
                         mode_env=tuple(sorted(decision.env.items())), forced_mode=forced is not None)
    return config, decision, profile, rig


def _make_plan(profile: Any, rig: Any, args: argparse.Namespace, mode: str) -> Any:
    from ..planner import PlanOptions, make_plan  # type: ignore[attr-defined]
    from ..run.specs import plan_devices

    options = PlanOptions(n_ctx=args.ctx, n_parallel=args.parallel)
    return make_plan(profile, rig, options, devices=plan_devices(mode, args.backend, [c.index for c in rig.cards]))


def _verdict(args: argparse.Namespace, n_cards: int) -> Any:
    """Only a multi-card Intel run needs the runtime's versions; reading them costs a few subprocesses."""
    if args.backend != "sycl" or n_cards < 2 or args.mode != "auto":
        return None
    from ..llama.facts import gather_facts
    from ..llama.verdict import verdict_for

    return verdict_for("sycl", gather_facts("sycl"))


def _parse_ports(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        ports = [int(p) for p in text.split(",")]
    except ValueError:
        raise BadInput(f"--rpc-ports {text!r} is not a list of ports", "write it like --rpc-ports 50052,50053") from None
    if any(not 0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
        raise BadInput(f"--rpc-ports {text!r} has a bad or repeated port", "list distinct ports 1-65535")
    return ports


def _serve(args: argparse.Namespace) -> int:
    config, decision, _profile, _rig = build_config(args)
    for reason in decision.reasons:
        _say(f"mode {decision.mode}: {reason}")
    return anyio.run(_run, config, args)


async def _run(config: Any, args: argparse.Namespace) -> int:
    from ..run.supervisor import RestartPolicy, Supervisor, Timeouts

    def fallback(cfg: Any, message: str) -> Any:
        from dataclasses import replace

        from ..model import load_profile
        from ..rig import Rig

        record_observed(cfg.backend, cfg.mode, False, message)
        _say(f"{cfg.mode} failed with the multi-device allocation error; falling back to hybrid (recorded)")
        rig = Rig(cards=tuple(c.card for c in cfg.plan.cards))
        plan = _make_plan(load_profile(cfg.plan.model_path), rig, args, "hybrid")
        return replace(cfg, plan=plan, mode="hybrid", mode_env=())

    policy = RestartPolicy(max_failures=args.max_restarts)
    sup = Supervisor(config, policy=policy, timeouts=Timeouts(stall=args.stall_timeout), fallback=fallback)
    events = sup.subscribe(10_000)
    failure: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_report, events, sup, args.json_events)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async def on_signal() -> None:
                async for sig in signals:
                    _say(f"{signal.Signals(sig).name}: stopping llama-server, then the rpc-servers")
                    sup.stop()

            tg.start_soon(on_signal)
            try:
                await sup.run()
            except ArcsplitError as exc:  # raised after the task group, as itself, not in an ExceptionGroup
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return 0


async def _report(events: Any, sup: Any, as_json: bool) -> None:
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
                _say(f"loading {ev.data.get('stage') or 'model'}: {pct}%")
        elif ev.kind == "state" and ev.data.get("state") == "ready" and ev.name != "server":
            _say(f"{ev.name} ready on {ev.data.get('endpoint')} (pid {ev.data.get('pid')})")
        elif ev.kind == "group":
            state = ev.data.get("state")
            if state == "starting":
                last_pct = -10
            elif state == "ready":
                print(f"arcsplit: serving {sup.url} (mode {sup.config.mode}, {len(sup.config.plan.cards)} card(s))",
                      flush=True)
                for line in _buffer_table(ev.data.get("buffers") or {}):
                    _say(line)
            elif state == "backoff":
                _say(f"group failed ({ev.data.get('error')}); restart {ev.data.get('failures')} in "
                     f"{ev.data.get('delay'):.1f} s")
        elif ev.kind == "verdict":
            _say(f"recorded: {ev.data.get('failed_mode')} fails here; now {ev.data.get('fallback')}")


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


def _say(text: str) -> None:
    print(f"arcsplit: {text}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model across cards and keep it running",
                       description="Plan the split, pick the mode (one context, hybrid or rpc-servers), start "
                                   "rpc-servers and llama-server, and restart the group if any member dies. "
                                   "Arguments after -- go to llama-server.")
    p.add_argument("model", help="GGUF file (first shard of a split model)")
    add_card_options(p)
    add_llama_dir(p)
    p.add_argument("--mode", choices=MODE_CHOICES, default="auto", help="how the cards share the model (default: auto)")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (default: the largest that fits)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="parallel sequences, -np (default: 1)")
    p.add_argument("--host", default="127.0.0.1", help="llama-server address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="llama-server port (default: 8080)")
    p.add_argument("--rpc-host", default="127.0.0.1",
                   help="rpc-server address (default: 127.0.0.1; anything else is reachable from the network)")
    p.add_argument("--rpc-ports", metavar="LIST", help="rpc-server ports, one per rpc-server (default: free ports)")
    p.add_argument("--threads", type=int, metavar="N", help="threads per rpc-server (default: cores / cards)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="consecutive failures before giving up (default: 5)")
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="S",
                   help="give up a load after this long without any progress (default: 120)")
    p.add_argument("--json-events", action="store_true", help="print every event but log lines as JSON on stdout")
    p.set_defaults(func=_serve, extra=[])
    _split_at_double_dash(p)


def _split_at_double_dash(p: argparse.ArgumentParser) -> None:
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
