"""Shared fixtures: the real llama.cpp CPU build and the real demo model, built/installed once."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest

from arcsplit.llama.locate import LlamaBinaries, find_llama


@pytest.fixture(scope="session")
def llama_bins() -> LlamaBinaries:
    """The CPU build arcsplit manages (scripts/test builds it first), or $ARCSPLIT_LLAMA_DIR."""
    if not os.environ.get("ARCSPLIT_LLAMA_DIR"):
        from arcsplit.llama.build import BuildConfig, build

        build(BuildConfig("cpu"))
    return find_llama(backend="cpu")


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from arcsplit.demo import ensure_demo_model

    return ensure_demo_model()


@contextlib.contextmanager
def arcsplit_dirs_in(root: Path, llama_bins: LlamaBinaries) -> Iterator[dict[str, str]]:
    """State, sockets and caches under ``root`` (and the CPU build), in os.environ so subprocesses get them too."""
    env = {"ARCSPLIT_STATE_DIR": str(root / "state"), "ARCSPLIT_RUNTIME_DIR": str(root / "rt"),
           "ARCSPLIT_CACHE_DIR": str(root / "cache"), "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
