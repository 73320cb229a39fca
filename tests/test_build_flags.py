"""The managed build: one writer of the cache at a time, and the host flags every native build gets."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arcsplit.llama.build import _build_lock


def test_second_build_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    # The first "build" is another process holding the tree's lock, as a second terminal would.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; fh = open(sys.argv[1], 'a'); fcntl.flock(fh, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(1.0)", str(tmp_path / "lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        said: list[str] = []
        entered = threading.Event()

        def second() -> None:
            with _build_lock(lambda step, pct: said.append(step)):
                entered.set()

        t = threading.Thread(target=second)
        start = time.monotonic()
        t.start()
        assert not entered.wait(0.3), "the second build went ahead while the first held the tree"
        t.join(10)
        assert entered.is_set() and holder.wait(5) == 0
        assert time.monotonic() - start >= 0.5
        assert any("waiting for another arcsplit process" in s for s in said)
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_free_again_after_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    for _ in range(2):
        with _build_lock(lambda step, pct: None):
            pass


def test_native_x86_builds_leave_out_amx_kernels() -> None:
    from arcsplit.llama.build import NO_AMX, BuildConfig, host_flags

    # ggml's AMX kernels trap in VMs that advertise AMX (this project's CI machines): never compiled in.
    assert host_flags("x86_64") == (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    assert host_flags("aarch64") == ()
    # A user's own flags come after ours, so `--cmake-flag=-DCMAKE_C_FLAGS=` turns AMX back on (cmake: last -D wins).
    flags = BuildConfig("cpu", extra_flags=("-DCMAKE_C_FLAGS=",)).cmake_flags
    assert flags.index("-DCMAKE_C_FLAGS=") > flags.index(f"-DCMAKE_C_FLAGS={NO_AMX}")
