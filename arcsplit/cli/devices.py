"""``arcsplit devices``: the cards llama.cpp will see."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .. import backends
from . import print_json
from .llama import add_llama_dir

if TYPE_CHECKING:
    from ..llama.detect import BackendChoice


def add_card_options(p: argparse.ArgumentParser) -> None:
    """--backend, --gpus and --cpu-memory: how every command names the cards it uses."""
    p.add_argument("--backend", choices=backends.choices(), default="auto",
                   help="ggml backend (default auto: the cards in sysfs and the llama.cpp builds present decide, "
                        "e.g. sycl on Intel Arc cards with a SYCL build; cpu when there is no GPU)")
    p.add_argument("--gpus", metavar="LIST", help="cards to use, in order, e.g. 0,1 (default: all; cpu: one)")
    p.add_argument("--cpu-memory", type=int, metavar="MiB",
                   help="memory budget of each CPU card (default: an even share of available RAM)")


def say_choice(choice: BackendChoice | None) -> None:
    """The line that says which backend auto picked and why (stderr: stdout stays the command's output)."""
    if choice is not None:
        for line in (choice.reason, *choice.notes):
            print(f"arcsplit: {line}", file=sys.stderr, flush=True)


def _devices(args: argparse.Namespace) -> int:
    from ..llama.detect import resolve
    from ..llama.devices import card_rows, discover_rig, parse_gpus
    from ..llama.locate import find_llama

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
