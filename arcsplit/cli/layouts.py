"""``arcsplit layouts``: the layouts arcsplit ships, one line each; ``--layout NAME`` takes any of them."""

from __future__ import annotations

import argparse
from typing import Any

from ..rig import load_layout, shipped_layouts
from . import print_json


def _layouts(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for name, path in shipped_layouts().items():
        rig = load_layout(path)
        hosts = {c.host for c in rig.cards}
        rows.append({"name": name, "title": rig.name, "cards": len(rig.cards), "hosts": len(hosts),
                     "backends": sorted({c.backend for c in rig.cards}), "path": str(path)})
    if args.json:
        print_json(rows)
        return 0
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        where = f", {r['hosts']} hosts" if r["hosts"] > 1 else ""
        print(f"{r['name']:<{width}}  {r['title']} ({r['cards']} cards, {'/'.join(r['backends'])}{where})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layouts", help="list the shipped layouts (rigs to plan for: --layout NAME)",
                       description="The layouts arcsplit ships: `plan`, `serve` and `unit` take one by name "
                                   "(--layout 2x-arc-pro-b70) or any layout file by path.")
    p.add_argument("--json", action="store_true", help="one object per layout")
    p.set_defaults(func=_layouts)
