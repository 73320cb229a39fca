"""Whether an rpc-server can read its weights from the GGUF itself (patch 0006, ``--seed-cache``).

A fact of a llama.cpp build, read both by the supervisor (decide/weightcache.py seeds this machine's rpc-servers) and
by the node agent on another host (which drops ``--seed-cache`` where its build cannot): so it lives with the
other build facts, light enough for the agent's start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .patches import build_patches

PATCH = "0006-rpc-seed-cache-from-gguf"
SEED_FLAG = "--seed-cache"  # rpc-server: index this GGUF into the cache directory and serve from it


def can_seed(rpc_bin: Path, foreign_flags: frozenset[str] | None) -> bool:
    """Whether this rpc-server can seed: a managed build carrying the patch, or a foreign one offering the flag."""
    if not sys.platform.startswith("linux"):
        return False  # the patch reads /proc/self/maps; elsewhere the flag fails
    if foreign_flags is not None:
        return SEED_FLAG in foreign_flags
    return PATCH in (build_patches(rpc_bin.parent) or [])
