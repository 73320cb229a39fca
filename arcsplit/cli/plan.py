"""``arcsplit plan MODEL``: where every layer goes and what each card must hold, without starting anything."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..memory import CACHE_TYPES
from ..planner import Plan
from ..rig import Rig, load_layout, save_layout
from ..route import HOST_DEVICE
from . import print_json
from .serve import add_group_arguments, request_from_args, split_at_double_dash

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
    p.add_argument("--save", metavar="FILE", help="write the rig and this plan as a layout TOML")
    p.add_argument("--json", action="store_true", help="machine-readable output (Plan.to_dict, route, processes)")
    p.set_defaults(func=_plan, extra=[])
    split_at_double_dash(p)


def _plan(args: argparse.Namespace) -> int:
    from .._api import planned_specs, preview

    if args.layout and args.gpus:
        raise BadInput("--layout and --gpus both name cards", "pass one of them")
    rig = load_layout(args.layout) if args.layout else None
    prepared = preview(request_from_args(args), rig)
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
    processes: list[dict[str, Any]] = [{"name": s.name, "role": s.role, "cards": list(s.cards), "argv": list(s.argv),
                  "env": {k: v for k, v in s.env if k not in secret}, "unset": list(s.env_unset)} for s in specs]
    if args.json:
        print_json({**plan.to_dict(), "mode": config.mode, "reasons": list(prepared.decision.reasons),
                    "route": config.route.to_dict(), "processes": processes})
        return 0
    print(render(plan, profile.n_layer_nextn))
    print(f"\nmode {config.mode}: {'; '.join(prepared.decision.reasons)}")
    for proc in processes:
        env = " ".join(f"{k}={v}" for k, v in proc["env"].items())
        print(f"{proc['name']:>7}: {env + ' ' if env else ''}{' '.join(proc['argv'])}")
    if not config.rpc_ports and len(processes) > 1:
        print("(rpc ports: free ones now; serve picks its own unless --rpc-ports fixes them)")
    if args.save:
        print(f"\nsaved rig and plan to {args.save}")
    return 0


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f}"


def render(plan: Plan, n_nextn: int = 0) -> str:
    """A table a person reads at a glance, and a map of which layers live where."""
    o = plan.options
    head = (f"{Path(plan.model_path).name}  ({plan.arch}, {plan.n_layer} layers + output)  "
            f"context {plan.n_ctx:,}  slots {o.n_parallel}  KV {o.cache_type_k}/{o.cache_type_v}  "
            f"ubatch {o.n_ubatch}")
    cols = ["card", "device", "layers", "weights", "KV", "state", "compute", "total", "free", "free after", "largest"]
    rows = []
    for c in plan.cards:
        end = min(c.end_layer, plan.n_layer)  # the output unit is shown as "+out" on the card that computes it
        layers = f"{c.first_layer}-{end - 1}" if end > c.first_layer else "-"
        if c.has_output:
            layers = f"{layers} +out" if end > c.first_layer else "output"
        rows.append([c.card.name[:28], c.device, layers, _mib(c.weights), _mib(c.kv), _mib(c.state),
                     _mib(c.compute), _mib(c.total), _mib(c.card.free_bytes), _mib(c.free_after), c.largest])
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    fmt = lambda r: "  ".join(v.ljust(widths[i]) if i < 3 or i == 10 else v.rjust(widths[i])  # noqa: E731
                              for i, v in enumerate(r))
    lines = [head, "", fmt(cols).rstrip() + "   (MiB)", fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    lines.append(f"host (llama-server's CPU): {_mib(plan.host_bytes)} MiB (token embeddings, input buffers)")
    if plan.host_expert_bytes:
        n = plan.options.moe_offload or 0
        lines.append(f"  of which routed experts of layers 0-{n - 1} (--n-cpu-moe {n}): {_mib(plan.host_expert_bytes)} MiB; "
                     f"a decoded token reads about {_mib(plan.host_read_per_token)} MiB of them from host RAM")
    if plan.ctx_limit:
        lines.append(f"context {plan.n_ctx:,} is bounded by {plan.ctx_limit}")
    lines += ["", "layer map:"]
    for c in plan.cards:
        marks = []
        for il in range(c.first_layer, min(c.end_layer, plan.n_layer)):
            marks.append(f"{il}(mtp)" if il >= plan.n_layer - n_nextn else str(il))
        if c.has_output:
            marks.append("[out]")
        where = "not offloaded" if c.device == HOST_DEVICE else c.device
        lines.append(f"  {where:>14}: {' '.join(marks) if marks else '(none)'}")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
