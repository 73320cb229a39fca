"""``arcsplit devices``: the cards llama.cpp will see."""

from __future__ import annotations

import argparse

from ..backends import NAMES as BACKENDS
from ..llama.devices import discover_rig, parse_gpus
from ..llama.locate import find_llama
from ..rig import MiB
from . import print_json
from .llama import add_llama_dir


def add_card_options(p: argparse.ArgumentParser) -> None:
    """--backend, --gpus and --cpu-memory: how every command names the cards it uses."""
    p.add_argument("--backend", choices=BACKENDS, default="cpu", help="ggml backend (default: cpu)")
    p.add_argument("--gpus", metavar="LIST", help="cards to use, in order, e.g. 0,1 (default: all; cpu: one)")
    p.add_argument("--cpu-memory", type=int, metavar="MiB",
                   help="memory budget of each CPU card (default: an even share of available RAM)")


def _devices(args: argparse.Namespace) -> int:
    gpus = parse_gpus(args.gpus)
    binaries = None if args.backend == "cpu" else find_llama(args.llama_dir, backend=args.backend, build=args.build)
    rig = discover_rig(args.backend, gpus, binaries, args.cpu_memory)
    rows = [
        {"backend": c.backend, "index": c.index, "device": c.device, "name": c.name,
         "total_mib": c.total_bytes // MiB, "free_mib": c.free_bytes // MiB, "pci": c.pci, "driver": c.driver}
        for c in rig.cards
    ]
    if args.json:
        print_json({"backend": args.backend, "cards": rows})
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
