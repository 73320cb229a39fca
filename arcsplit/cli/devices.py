"""``arcsplit devices``: the cards llama.cpp will see."""

from __future__ import annotations

import argparse

from .. import backends
from ..llama.detect import resolve
from ..llama.devices import card_rows, discover_rig, parse_gpus
from ..llama.locate import find_llama
from . import print_json
from .options import add_card_options, add_llama_dir, say_choice


def _devices(args: argparse.Namespace) -> int:
    gpus = parse_gpus(args.gpus)
    backend, choice = resolve(args.backend, args.llama_dir)
    binaries = None if backends.get(backend).on_cpu else find_llama(args.llama_dir, backend=backend, build=args.build)
    rig = discover_rig(backend, gpus, binaries, args.cpu_memory)
    say_choice(choice)  # once it worked: a failure stays one line
    rows = card_rows(rig)
    if args.json:
        print_json({"backend": backend, "detected": choice.reason if choice else None, "cards": rows})
        return 0
    print(f"{'card':<5} {'device':<9} {'total MiB':>10} {'free MiB':>10}  name")
    for r in rows:
        print(f"{r['index']:<5} {r['device']:<9} {r['total_mib']:>10} {r['free_mib']:>10}  {r['name']}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list the cards llama.cpp will see",
                       description="List the cards llama.cpp will see: backend, index, name, total and free "
                                   "memory. With --backend cpu, each card is an rpc-server on the CPU.")
    add_card_options(p)
    add_llama_dir(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_devices)
