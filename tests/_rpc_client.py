"""tests/tools/rpc_set_reuse.cpp, a client of a real rpc-server, built against a managed build's libraries."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from arcsplit.llama import build as build_mod

SET_REUSE = Path(__file__).parent / "tools" / "rpc_set_reuse.cpp"


def build_set_reuse(bin_dir: Path, dest: Path) -> Path:
    """The client, linked to ``bin_dir``'s ggml libraries and compiled with its patched tree's headers (the tree
    CMake was configured from, else the cache's trees)."""
    trees = build_mod.cache_trees(bin_dir)
    cmake_cache = bin_dir.parent / "CMakeCache.txt"
    if cmake_cache.is_file():
        trees = [Path(line.split("=", 1)[1]) for line in cmake_cache.read_text().splitlines()
                 if line.startswith("CMAKE_HOME_DIRECTORY:")] + trees
    include = next((t / "ggml" / "include" for t in trees if (t / "ggml" / "include" / "ggml-rpc.h").is_file()), None)
    if include is None:
        pytest.skip(f"{bin_dir} is not a build arcsplit made: no ggml headers beside it")
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "the managed build needed a C++ compiler"
    exe = dest / "rpc_set_reuse"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{include}", str(SET_REUSE), f"-L{bin_dir}", "-lggml", "-lggml-base",
                    "-lggml-rpc", f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe
