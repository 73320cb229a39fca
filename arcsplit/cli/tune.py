"""``arcsplit tune MODEL``: try every route and a few settings on this machine's cards, keep the fastest correct.

    arcsplit tune model.gguf --gpus 0,1 [--objective decode|prefill|streams|ttft] [--budget S] [--fresh] [--json]

Each candidate is served for real, its output checked against a reference, and measured for a few seconds; the
results are kept per fingerprint (cards, drivers, build, model, context, slots), so ``serve`` then uses the pick
without flags and a rerun resumes. docs/tune.md has the rules.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..objectives import unit
from . import print_json, say
from .serve import add_group_arguments, add_tune_arguments, split_at_double_dash
from .serve_run import request_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="measure every route on these cards and keep the fastest correct one",
                       description="Serve each route this build and rig allow (and a few settings on the best), "
                                   "check its output against a reference, measure prefill, decode, all slots "
                                   "busy and time to first token, and keep the best correct one by --objective "
                                   "for this rig's fingerprint: serve uses it by default. Arguments after -- go "
                                   "to llama-server.")
    p.add_argument("model", help="GGUF model file")
    add_group_arguments(p)
    add_tune_arguments(p)
    p.add_argument("--fresh", action="store_true", help="measure again, ignoring results kept for this fingerprint")
    p.add_argument("--routes-only", action="store_true", help="do not vary ubatch, flash attention or KV type")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(func=_tune, extra=[])
    split_at_double_dash(p)


def _tune(args: argparse.Namespace) -> int:
    from ..tuning.runner import run_from

    report = run_from(request_from_args(args), args.objective, args.budget, args.per_candidate,
                      settings=not args.routes_only, fresh=args.fresh, say=lambda line: say(f"tune: {line}"))
    if args.json:
        print_json(report.to_dict())
        return 0
    print("\n".join(render(report)))
    return 0 if report.pick else 2


def render(report: Any) -> list[str]:
    """The table of every candidate tried (the one every surface shows: TuneResult.table), the pick and the default,
    and a faster-looking candidate that lost the second round, said as such."""
    result = report.result()
    out = [f"{result.legend}:", *result.table()]
    pick, default, objective = result.pick, result.default, result.objective
    if pick is None:
        out.append("no correct route was measured: see the statuses above")
        return out
    u = unit(objective)
    line = f"\npick (*): {pick.label}, {objective} {pick.figure(objective) or 0:.1f} {u}"
    theirs = default.figure(objective) if default is not None else None
    if pick.default:
        line += " (the default order's route, d)"
    elif default is not None and theirs and result.speedup:
        line += f"; the default order's route (d) {default.label}: {theirs:.1f} {u} ({result.speedup:.2f}x better)"
    out.append(line)
    for lost in (c for c in result.candidates if c.second is not None and not c.pick and not c.default):
        out.append(f"{lost.label} was faster in the first round ({lost.figure(objective) or 0:.1f} {u}) but lost the "
                   f"second round ({lost.second:.1f} against {pick.second or 0:.1f} {u}): the pick is the default "
                   "order's route")
    out.append(f"tune took {report.wall_s:.0f} s, {report.reused} result(s) kept from earlier runs"
               + (f", {len(report.not_tried)} not tried within the budget" if report.not_tried else "")
               + "; `arcsplit serve` now uses the pick for this rig (--mode overrides it)")
    return out
