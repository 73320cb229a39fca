"""Shared fixtures: the real llama.cpp CPU build and the real demo model, built/installed once."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from arcsplit.llama.locate import LlamaBinaries, find_llama

# The suite runs the CPU build whatever cards this machine has: `--backend auto` means cpu here unless a test
# unsets this (tests/test_detect.py simulates an Arc machine). Children started by tests inherit it.
os.environ["ARCSPLIT_BACKEND"] = "cpu"
# Nor do they see what `arcsplit tune` kept for this user: serve (CLI and API) would run a tuned pick instead of
# the mode a test expects. Tests of tune set their own directory.
_TUNE_DIR = tempfile.mkdtemp(prefix="arcsplit-test-tune-")
os.environ["ARCSPLIT_TUNE_DIR"] = _TUNE_DIR
atexit.register(shutil.rmtree, _TUNE_DIR, True)


@pytest.fixture(scope="session")
def llama_bins() -> LlamaBinaries:
    """The CPU build arcsplit manages (scripts/test builds it first), or $ARCSPLIT_LLAMA_DIR; never a llama-server
    that happens to be on the host's PATH."""
    if os.environ.get("ARCSPLIT_LLAMA_DIR"):
        return find_llama(backend="cpu")
    from arcsplit.llama.build import BuildConfig, build

    config = BuildConfig("cpu")
    build(config)
    return find_llama(backend="cpu", build=config.key)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from arcsplit.demo import ensure_demo_model

    return ensure_demo_model()



@pytest.fixture
def net(tmp_path: Path, llama_bins: LlamaBinaries):
    """One remote "host" b: a network namespace joined by a veth pair, running sshd (tests/_netns.py); this
    checkout's arcsplit and llama.cpp build run there as ``net.host().arcsplit``. Removed on every exit path.
    Skips with the reason when namespaces or sshd cannot run here (not root, no `ip netns`, no openssh-server)."""
    from _netns import NetHarness, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    with NetHarness(tmp_path / "net", ("b",), llama_bins.bin_dir) as harness:
        yield harness
