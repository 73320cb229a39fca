"""The options several commands share (which cards, which llama.cpp build) and the line that says what auto picked.

Their own module, light to import: every command's parser adds them, the node agent's included, so the modules that
do the work (cli/llama.py, cli/devices.py) are imported only by the commands that run them.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .. import backends

if TYPE_CHECKING:
    from ..llama.detect import BackendChoice


def add_card_options(p: argparse.ArgumentParser) -> None:
    """--backend, --gpus and --cpu-memory: how every command names the cards it uses."""
    p.add_argument("--backend", choices=backends.choices(), default=backends.AUTO,
                   help="ggml backend (default auto: the cards in sysfs and the llama.cpp builds present decide, "
                        "e.g. sycl on Intel Arc cards with a SYCL build; cpu when there is no GPU)")
    p.add_argument("--gpus", metavar="LIST", help="cards to use, in order, e.g. 0,1 (default: all; cpu: one)")
    p.add_argument("--cpu-memory", type=int, metavar="MiB",
                   help="memory budget of each CPU card (default: an even share of available RAM)")


def add_llama_dir(p: argparse.ArgumentParser) -> None:
    """The --llama-dir and --build options every command that runs llama.cpp shares."""
    p.add_argument("--llama-dir", metavar="DIR",
                   help="a llama.cpp bin dir to use (default: $ARCSPLIT_LLAMA_DIR, PATH, then the managed build)")
    p.add_argument("--build", metavar="KEY",
                   help="a managed build by its key (`arcsplit llama which --all` lists them; default: the "
                        "backend's default build, else its newest)")


def say_choice(choice: BackendChoice | None) -> None:
    """The line that says which backend auto picked and why (stderr: stdout stays the command's output)."""
    if choice is not None:
        for line in (choice.reason, *choice.notes):
            print(f"arcsplit: {line}", file=sys.stderr, flush=True)
