"""tests/tools/rpc_set_reuse.cpp, a client of a real rpc-server, built against a managed build's libraries."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from arcsplit.llama import build as build_mod

SET_REUSE = Path(__file__).parent / "tools" / "rpc_set_reuse.cpp"


def build_set_reuse(bin_dir: Path, dest: Path) -> Path:
    """The client, linked to ``bin_dir``'s ggml libraries and compiled with its patched tree's headers."""
    include = next((t / "ggml" / "include" for t in build_mod.cache_trees(bin_dir)
                    if (t / "ggml" / "include" / "ggml-rpc.h").is_file()), None)
    if include is None:
        pytest.skip(f"{bin_dir} is not a build arcsplit made: no ggml headers beside it")
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "the managed build needed a C++ compiler"
    exe = dest / "rpc_set_reuse"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{include}", str(SET_REUSE), f"-L{bin_dir}", "-lggml", "-lggml-base",
                    "-lggml-rpc", f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe
