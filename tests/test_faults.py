"""A fault under load, bounded for the normal suite (bench/faults.py runs the full set): SIGKILL an rpc-server of
a served demo model while streams run. The streams it breaks must fail cleanly (an error, never a hang to the
client timeout), serving must resume on its own, the old group must be gone, and nothing may be left after stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import LoadGen, Served  # noqa: E402
from _procs import dead  # noqa: E402

CLIENT_TIMEOUT = 30.0


@pytest.mark.slow  # starts llama.cpp
@pytest.mark.timeout(120)
def test_sigkill_rpc_server_under_load(demo_model, llama_bins, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.server.parent))
    served = Served(Path(demo_model), ctx=2048, parallel=4)
    served.start()
    try:
        served.wait_ready(90)
        before = {p.pid: n for n, p in served.children().items()}
        assert sorted(before.values()) == ["rpc0", "rpc1", "server"]
        gen = LoadGen(served.url, concurrency=4, max_requests=400, max_seconds=60, timeout=CLIENT_TIMEOUT,
                      max_tokens=24)
        marks: dict[str, float] = {}

        async def fault() -> None:
            while sum(r.outcome == "ok" for r in gen.results) < 3:  # steady first
                await anyio.sleep(0.1)
            await anyio.sleep(0.5)  # requests in flight (24 tokens take > 1 s here)
            marks["kill"] = time.time()
            marks["in_flight"] = gen.in_flight
            victim = next(pid for pid, n in before.items() if n == "rpc0")
            os.kill(victim, signal.SIGKILL)
            while not any(r.start > marks["kill"] and r.outcome == "ok" for r in gen.results):
                await anyio.sleep(0.2)
            marks["resumed"] = min(r.end for r in gen.results if r.start > marks["kill"] and r.outcome == "ok")
            await anyio.sleep(1.0)
            gen.stop()

        async def go() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(gen.run)
                with anyio.fail_after(90):
                    await fault()

        anyio.run(go)
        after = {p.pid: n for n, p in served.children().items()}
    finally:
        served.stop()
    try:
        assert marks["in_flight"] >= 1
        failed = [r for r in gen.results if r.outcome != "ok"]
        assert failed, "killing an rpc-server mid-stream broke no request: the fault did not land"
        assert all(r.outcome == "error" for r in failed), [(r.outcome, r.error) for r in failed]  # clean, no hang
        assert all(r.seconds < CLIENT_TIMEOUT for r in gen.results)
        assert all(r.end >= marks["kill"] - 0.5 for r in failed), "a request failed before the fault"
        resumed = marks["resumed"] - marks["kill"]
        assert resumed < 30, f"serving resumed only after {resumed:.1f} s"
        # the whole group was replaced, in order, and the old one is gone
        assert sorted(after.values()) == ["rpc0", "rpc1", "server"] and not set(after) & set(before)
        for pid in before:
            assert dead(pid)
        assert served.leftovers() == {"processes": [], "ports": [], "temp_files": [], "state_files": []}
    finally:
        served.cleanup()
