"""``arcsplit plan MODEL``: where every layer goes and what each card must hold, without starting anything."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._api import planned_specs, preview
from ..errors import BadInput
from ..hosts import CONTROL_SHOWN, control_argv, node_argv, shares_connection
from ..memory import CACHE_TYPES
from ..planner import LinkCost, Plan
from ..rig import Rig, load_layout, save_layout
from ..route import HOST_DEVICE
from ..tuning.fingerprint import anything_kept
from ..tuning.picks import summary, tuned
from ..roles import Role
from . import print_json
from .serve import add_group_arguments, split_at_double_dash
from .serve_run import request_from_args

MiB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan how a model splits across cards (no processes started)",
                       description="Plan the split for the mode serve would run (or --mode), and print the exact "
                                   "argv of llama-server and of each rpc-server. Arguments after -- go to "
                                   "llama-server, as with serve.")
    p.add_argument("model", help="GGUF model file (for a split model, any of its shards)")
    add_group_arguments(p)
    p.add_argument("--layout", metavar="FILE", help="plan for the rig described in a layout TOML instead of live cards")
    p.add_argument("--cache-type", choices=sorted(CACHE_TYPES), default="f16", help="KV cache type for K and V")
    p.add_argument("--no-kv-unified", dest="kv_unified", action="store_false",
                   help="one KV stream per slot instead of a shared one")
    p.add_argument("--measure", action="store_true",
                   help="take each card's compute buffer from llama.cpp's own dry run (llama-fit-params on the "
                        "cards as serve places them; for a --layout, CPU rpc-servers on 127.0.0.1 stand in; seconds) "
                        "and cache it: later plans and serve with the same model and options use it without running "
                        "anything")
    p.add_argument("--save", metavar="FILE", help="write the rig and this plan as a layout TOML")
    p.add_argument("--json", action="store_true", help="machine-readable output (Plan.to_dict, route, processes)")
    p.set_defaults(func=_plan, extra=[])
    split_at_double_dash(p)


def _plan(args: argparse.Namespace) -> int:
    if args.layout and args.gpus:
        raise BadInput("--layout and --gpus both name cards", "pass one of them")
    rig = load_layout(args.layout) if args.layout else None
    req, tuned_lines = replace(request_from_args(args), measure=args.measure), []
    if rig is None and anything_kept():  # what serve would run: the tuned pick for this rig (docs/tune.md)
        got, tuned_lines = tuned(req), summary(req)  # the summary by the user's request: the pick's is another
        if got is not None:
            print(f"arcsplit: {got[1]}", file=sys.stderr, flush=True)
            req = got[0]
    prepared = preview(req, rig)
    config, plan, profile = prepared.config, prepared.config.plan, prepared.profile
    if args.save:
        pinned = {"model": str(Path(profile.path).name), "n_ctx": plan.n_ctx, "n_parallel": args.parallel,
                  "cache_type": args.cache_type, "tensor_split": list(plan.tensor_split),
                  "devices": [c.device for c in plan.cards]}
        save_layout(args.save, Rig(cards=prepared.rig.cards, name=prepared.rig.name, hosts=prepared.rig.hosts), pinned)
    specs = planned_specs(prepared)
    for line in (*prepared.warnings, *prepared.notes):  # which backend auto picked, and why; stdout stays the plan
        print(f"arcsplit: {line}", file=sys.stderr, flush=True)
    secret = dict(config.secret_env)
    shared = {h.name: h for h in prepared.rig.hosts if shares_connection(h)}  # links added to the node's ssh

    def argv(s: Any) -> list[str]:  # a proc.spec.ProcessSpec (the CLI reaches run/ only through the API)
        if s.role == Role.LINK and s.node in shared:
            return control_argv(shared[s.node], CONTROL_SHOWN, "forward", s.argv)
        return list(s.argv)

    processes: list[dict[str, Any]] = [{"name": s.name, "role": s.role, "cards": list(s.cards), "argv": argv(s),
                  "env": {k: v for k, v in s.env if k not in secret}, "unset": list(s.env_unset), "node": s.node,
                  "connect": s.dial if s.role == Role.RPC else None} for s in specs]
    used = [h for h in prepared.rig.hosts if any(c.card.host == h.name for c in plan.cards)]
    hosts: list[dict[str, Any]] = [{"name": h.name, "ssh": h.ssh, "link": h.link, "address": h.address,
                                     "node_argv": node_argv(h, CONTROL_SHOWN if h.name in shared else None)}
                                    for h in used]
    if args.json:
        print_json({**plan.to_dict(), "mode": config.mode, "reasons": list(prepared.decision.reasons),
                    "choice": prepared.choice.to_dict() if prepared.choice else None,
                    "routes": prepared.route_list.to_dict(),  # serve's list: this route first, then what it moves to
                    "route": config.route.to_dict(), "processes": processes, "hosts": hosts})
        return 0
    print(render(plan, profile.n_layer_nextn))
    print(f"\nmode {config.mode}: {'; '.join(prepared.decision.reasons)}")
    print("\n".join(prepared.route_list.lines()))
    if tuned_lines:
        print("\n" + "\n".join(tuned_lines))
    if hosts:
        print("this machine:")
    for proc in processes:
        if not proc["node"]:
            print(_process_line(proc))
    for h in hosts:
        print(f"host {h['name']} (ssh {h['ssh']}, link {h['link']}{' to ' + h['address'] if h['address'] else ''}):")
        print(f"{'node':>9}: {shlex.join(h['node_argv'])}")
        for proc in processes:
            if proc["node"] == h["name"] and proc["role"] == Role.RPC:
                print(_process_line(proc) + "   (started there by the node)")
        for proc in processes:
            if proc["node"] == h["name"] and proc["role"] == Role.LINK:
                print(_process_line(proc) + ("   (a forward added to the node's ssh here)" if h["name"] in shared
                                             else "   (runs here)"))
    if not config.rpc_ports and len(processes) > 1:
        print("(rpc ports: free ones now; serve picks its own unless --rpc-ports fixes them)")
    if args.save:
        print(f"\nsaved rig and plan to {args.save}")
    return 0


def _process_line(proc: dict[str, Any]) -> str:
    """One process's command as a shell takes it (pasted as it is: a value with a space stays one word)."""
    env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in proc["env"].items())
    return f"{proc['name']:>9}: {env + ' ' if env else ''}{shlex.join(proc['argv'])}"


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def _size(n: int) -> str:
    return f"{n / MiB:,.1f} MiB" if n >= MiB else f"{n / 1024:,.1f} KiB"


def _link_lines(links: tuple[LinkCost, ...]) -> list[str]:
    """What crosses each link to another host, per decoded token and per prefill ubatch."""
    lines = ["", f"links, at a full context of {links[0].n_ctx:,} tokens (llama.cpp's RPC relays every hop between "
                 "cards through llama-server, here):"]
    for lc in links:
        parts = [f"activations {_size(lc.act_bytes * (lc.act_crossings + lc.out_crossings))}",
                 f"attention masks {_size(lc.mask_bytes)}"]
        parts += [f"logits {_size(lc.logits_bytes)}"] if lc.logits_bytes else []
        lines.append(f"  {lc.host} ({lc.link}, {lc.gbit:g} Gbit/s {'given' if lc.gbit_given else 'assumed'}, "
                     f"{lc.rpc_servers} rpc-server(s)"
                     + (f" for {lc.graph_computes} cards, which copy between themselves there" if
                        lc.graph_computes > lc.rpc_servers else "") + "):")
        lines.append(f"    per decoded token: {_size(lc.token_bytes)} ({', '.join(parts)}), {lc.round_trips} round "
                     f"trip(s), {lc.token_ms:.2f} ms")
        lines.append(f"    per prefill ubatch of {lc.n_ubatch}: {_size(lc.ubatch_bytes)}, {lc.gets} round trip(s) "
                     f"+ {lc.graph_computes} graph_compute(s), {lc.ubatch_ms:.1f} ms")
        start, full = lc.prefill_tps_start, lc.prefill_tps_full
        if start and full:
            lines.append(f"    prefill at most {start:,.0f} tokens/s at an empty context, about {full:,.0f} over a "
                         "prompt that fills the context")
    return lines


def render(plan: Plan, n_nextn: int = 0) -> str:
    """A table a person reads at a glance, and a map of which layers live where."""
    o = plan.options
    head = (f"{Path(plan.model_path).name}  ({plan.arch}, {plan.n_layer} layers + output)  "
            f"context {plan.n_ctx:,}  slots {o.n_parallel}  KV {o.cache_type_k}/{o.cache_type_v}  "
            f"ubatch {o.n_ubatch}")
    cols = ["card", "device", "layers", "weights", "KV", "state", "compute", "total", "free", "free after", "largest",
            "compute from"]
    rows = []
    for c in plan.cards:
        end = min(c.end_layer, plan.n_layer)  # the output unit is shown as "+out" on the card that computes it
        layers = f"{c.first_layer}-{end - 1}" if end > c.first_layer else "-"
        if c.has_output:
            layers = f"{layers} +out" if end > c.first_layer else "output"
        name = (f"{c.card.host}/" if c.card.host else "") + c.card.name  # another host's card: b/<name>
        rows.append([name, c.device, layers, _mib(c.weights), _mib(c.kv), _mib(c.state),
                     _mib(c.compute), _mib(c.total), _mib(c.card.free_bytes), _mib(c.free_after), c.largest,
                     c.compute_source or "-"])
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    fmt = lambda r: "  ".join(v.ljust(widths[i]) if i < 3 or i >= 10 else v.rjust(widths[i])  # noqa: E731
                              for i, v in enumerate(r))
    lines = [head, "", fmt(cols).rstrip() + "   (MiB)", fmt(["-" * w for w in widths])]
    lines += [fmt(r).rstrip() for r in rows]
    held = (f"input buffers; token embeddings on {plan.cards[0].device}, the first card" if plan.options.input_on_first
            else "token embeddings, input buffers")
    lines.append(f"host (llama-server's CPU): {_mib(plan.host_bytes)} MiB ({held})")
    if plan.host_expert_bytes:
        n = plan.options.moe_offload or 0
        lines.append(f"  of which routed experts of layers 0-{n - 1} (--n-cpu-moe {n}): {_mib(plan.host_expert_bytes)} MiB; "
                     f"a decoded token reads about {_mib(plan.host_read_per_token)} MiB of them from host RAM")
    if plan.ctx_limit:
        lines.append(f"context {plan.n_ctx:,} is bounded by {plan.ctx_limit}")
    if plan.card_ctx_max:
        lines.append("context each card could hold on this split (--ctx max takes the smallest):")
        for c, n in zip(plan.cards, plan.card_ctx_max):
            lines.append(f"  {c.device:>14}: {n:,} tokens; largest term there: {c.largest}")
    if plan.links:
        lines += _link_lines(plan.links)
    lines += ["", "layer map:"]
    for c in plan.cards:
        marks = []
        for il in range(c.first_layer, min(c.end_layer, plan.n_layer)):
            marks.append(f"{il}(mtp)" if il >= plan.n_layer - n_nextn else str(il))
        if c.has_output:
            marks.append("[out]")
        where = "not offloaded" if c.device == HOST_DEVICE else c.device
        where += f" ({c.card.host})" if c.card.host else ""
        lines.append(f"  {where:>14}: {' '.join(marks) if marks else '(none)'}")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
