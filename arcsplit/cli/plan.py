"""``arcsplit plan MODEL``: where every layer goes and what each card must hold, without starting anything."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BadInput
from ..memory import CACHE_TYPES
from ..model import load_profile
from ..planner import HOST_DEVICE, Plan, PlanOptions, make_plan
from ..backends import flash_attn_default
from ..llama.detect import CHOICES, BackendChoice
from ..rig import Rig, load_layout, save_layout
from . import print_json

MiB = 1024 * 1024


def _ctx(value: str) -> int | None:
    if value.strip().lower() == "max":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ctx {value!r} is not a number or 'max'") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"--ctx {n} must be positive (or 'max')")
    return n


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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan how a model splits across cards (no processes started)")
    p.add_argument("model", help="GGUF model file (for a split model, any of its shards)")
    p.add_argument("--gpus", metavar="LIST", help="cards to use, in order, e.g. 0,1")
    p.add_argument("--backend", choices=CHOICES, default="auto",
                   help="ggml backend of the live cards (default auto: what serve would pick here)")
    p.add_argument("--layout", metavar="FILE", help="plan for the rig described in a layout TOML instead of live cards")
    p.add_argument("--ctx", type=_ctx, default=None, metavar="N|max", help="context size, or 'max' (default: max)")
    p.add_argument("--np", type=_positive, default=1, metavar="N", help="parallel slots (default: 1)")
    p.add_argument("--cache-type", choices=sorted(CACHE_TYPES), default="f16", help="KV cache type for K and V")
    p.add_argument("--ubatch", type=_positive, default=512, metavar="N", help="micro-batch size (default: 512)")
    p.add_argument("--no-kv-unified", action="store_true", help="one KV stream per slot instead of a shared one")
    p.add_argument("--cpu-memory", type=_positive, metavar="MiB", help="budget of each CPU card (cpu backend)")
    add_moe_options(p)
    p.add_argument("--save", metavar="FILE", help="write the rig and this plan as a layout TOML")
    p.add_argument("--json", action="store_true", help="machine-readable output (Plan.to_dict)")
    p.set_defaults(func=_plan)


def _rig(args: argparse.Namespace) -> tuple[Rig, list[str], BackendChoice | None]:
    choice: BackendChoice | None = None
    if args.layout:
        if args.gpus:
            raise BadInput("--layout and --gpus both name cards", "pass one of them")
        rig = load_layout(args.layout)
    else:
        from ..llama.detect import resolve
        from ..llama.devices import discover_rig, parse_gpus

        gpus = parse_gpus(args.gpus)
        backend, choice = resolve(args.backend)
        rig = discover_rig(backend, gpus, cpu_memory_mib=args.cpu_memory)
    names = []
    for i, card in enumerate(rig.cards):
        # CPU cards are rpc-servers: llama-server sees them as RPC0, RPC1, ... in --rpc order
        names.append(f"RPC{i}" if card.backend == "cpu" else card.device)
    return rig, names, choice


def _plan(args: argparse.Namespace) -> int:
    from ..llama.devices import host_budget

    profile = load_profile(args.model)
    rig, names, choice = _rig(args)
    options = PlanOptions(n_ctx=args.ctx, n_parallel=args.np, kv_unified=not args.no_kv_unified,
                          cache_type_k=args.cache_type, cache_type_v=args.cache_type, n_ubatch=args.ubatch,
                          n_batch=max(2048, args.ubatch),
                          flash_attn=flash_attn_default(rig.cards[0].backend, args.cache_type),
                          moe_offload=args.moe_offload,
                          host_budget=host_budget(rig, args.host_memory, live=not args.layout))
    plan = make_plan(profile, rig, options, devices=names)
    from .devices import say_choice

    say_choice(choice)  # once the plan stands: a failure stays one line
    if args.save:
        pinned = {"model": str(Path(profile.path).name), "n_ctx": plan.n_ctx, "n_parallel": args.np,
                  "cache_type": args.cache_type, "tensor_split": list(plan.tensor_split),
                  "devices": [c.device for c in plan.cards]}
        save_layout(args.save, Rig(cards=rig.cards, name=rig.name), pinned)
    if args.json:
        print_json(plan.to_dict())
    else:
        print(render(plan, profile.n_layer_nextn))
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
        n = plan.options.moe_offload
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
    lines += ["", "llama-server " + " ".join(plan.llama_server_args())]
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
