"""``arcsplit demo``: the main job on its embedded default — the demo Gemma model on two CPU cards."""

from __future__ import annotations

import argparse

from ..demo import ensure_demo_model
from ..llama.devices import discover_rig
from ..rig import MiB


def _demo(args: argparse.Namespace) -> int:
    model = ensure_demo_model()
    try:
        from .serve import serve_from_args
    except ImportError:
        rig = discover_rig("cpu", [0, 1], cpu_memory_mib=args.cpu_memory)
        print(f"demo model: {model}")
        for c in rig.cards:
            print(f"card {c.index}: {c.device} {c.name} ({c.total_bytes // MiB} MiB budget)")
        print("`arcsplit serve` is not built yet: the demo stops after building llama.cpp and listing the cards.")
        return 0
    ns = argparse.Namespace(**vars(args))
    ns.model = str(model)
    ns.backend = "cpu"
    ns.gpus = "0,1"
    return serve_from_args(ns, demo=True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the demo model split across two CPU rpc-servers",
                       description="Serve the demo model (Gemma 3 270M) split across two CPU rpc-servers "
                                   "standing in for two cards; prints the URL and an example request.")
    p.add_argument("--cpu-memory", type=int, default=1024, metavar="MiB", help="budget of each CPU card (default 1024)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port of llama-server (default 8080)")
    p.set_defaults(func=_demo)
