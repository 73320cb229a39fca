"""arcsplit tune with real processes: the CPU build's llama-server and rpc-servers, the demo model, real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

import pytest

from arcsplit.decide.prepare import ServeRequest
from arcsplit.llama.locate import LlamaBinaries
from arcsplit.proc.ports import free_port
from arcsplit.tune import fingerprint as fpmod
from arcsplit.tune.runner import TuneRequest, tune, tuned

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tune_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tuned results in a directory of the test's own (the builds stay where conftest keeps them)."""
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    return tmp_path / "tune"


def _request(model: Path, bins: LlamaBinaries, **kw: object) -> ServeRequest:
    fields: dict = dict(model=str(model), gpus=[0, 1], backend="cpu", ctx=1024, llama_dir=str(bins.bin_dir))
    return ServeRequest(**{**fields, **kw})


def test_tune_picks_correct_route_resumes_and_serve_uses_it(demo_model: Path, llama_bins: LlamaBinaries,
                                                          tune_cache: Path) -> None:
    lines: list[str] = []
    req = _request(demo_model, llama_bins)
    first = tune(TuneRequest(req, budget_s=600, per_candidate_s=1, settings=False), say=lines.append)
    tried = {k: first.results[k] for k in first.order}
    assert {r["status"] for r in tried.values()} <= {"ok", "pruned"}, tried
    assert first.pick is not None and tried[first.pick]["status"] == "ok"
    assert first.default == "cpu:rpc:defaults" and tried[first.default]["status"] == "ok"
    assert tried[first.pick]["decode"] >= tried[first.default]["decode"]
    assert any("starting" in line for line in lines)
    assert list(tune_cache.glob("*.json"))

    lines.clear()
    again = tune(TuneRequest(req, budget_s=600, per_candidate_s=1, settings=False), say=lines.append)
    assert again.reused == len(again.order) and again.pick == first.pick
    assert not any("starting" in line for line in lines)  # nothing started: every result came from the cache

    got = tuned(req)
    assert got is not None
    applied, line = got
    picked = first.results[first.pick]["candidate"]
    assert applied.mode == picked["mode"] and "tuned route" in line
    assert tuned(_request(demo_model, llama_bins, mode="rpc")) is None  # --mode overrides
    assert tuned(_request(demo_model, llama_bins, ctx=2048)) is None  # another context: another fingerprint

    # the CLI: plan shows what serve runs, and serve runs the pick without flags, saying so
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARCSPLIT_TUNE_DIR": str(tune_cache),
           "ARCSPLIT_STATE_DIR": str(tune_cache.parent / "state")}
    argv = [str(demo_model), "--backend", "cpu", "--gpus", "0,1", "--ctx", "1024", "--llama-dir", str(llama_bins.bin_dir)]
    plan = subprocess.run([sys.executable, "-m", "arcsplit", "plan", *argv, "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "using the tuned route" in plan.stderr and json.loads(plan.stdout)["mode"] == picked["mode"]
    text = subprocess.run([sys.executable, "-m", "arcsplit", "plan", *argv], env=env, capture_output=True, text=True,
                          timeout=120).stdout
    assert "tuned for this rig" in text and first.results[first.pick]["label"] in text
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", *argv, "--port", str(port), "--no-bus"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stderr is not None
        said = [serve.stderr.readline() for _ in range(3)]
        assert any("using the tuned route" in line for line in said), said
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and serve.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        (state_file,) = (tune_cache.parent / "state").glob("runs/*/state.json")
        names = {p["name"] for p in json.loads(state_file.read_text())["processes"]}
        assert names == {p["name"] for p in json.loads(plan.stdout)["processes"]}
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)


def _corrupting_build(tmp: Path, bins: LlamaBinaries) -> Path:
    """A llama.cpp dir whose ggml-rpc-server is the real one behind tests/_corrupt_rpc.py's bit-flipping forwarder."""
    d = tmp / "corrupt-build"
    d.mkdir()
    (d / "llama-server").symlink_to(bins.server)
    rpc = d / "ggml-rpc-server"
    rpc.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / '_corrupt_rpc.py'} {bins.rpc_server} \"$@\"\n")
    rpc.chmod(0o755)
    return d


def test_tune_rejects_a_route_that_loads_but_computes_wrong(demo_model: Path, llama_bins: LlamaBinaries,
                                                           tune_cache: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_RPC_SHM", "0")  # the weights must cross the socket, where the forwarder is
    build = _corrupting_build(tmp_path, llama_bins)
    req = ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", ctx=1024, llama_dir=str(build),
                       rpc_seed=False)
    lines: list[str] = []
    report = tune(TuneRequest(req, budget_s=600, per_candidate_s=1, settings=False), say=lines.append)
    res = report.results
    assert res["cpu:rpc:defaults"]["status"] == "wrong", res["cpu:rpc:defaults"].get("reason")
    assert res["cpu:hybrid-last:defaults"]["status"] == "wrong"
    assert "decode" not in res["cpu:rpc:defaults"]  # a wrong route is not measured
    assert report.pick == "cpu:single-1card:defaults"
    assert any("REJECTED" in line for line in lines)


def test_tune_cli_bad_input_is_one_line(demo_model: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args, word in ((["--budget", "0"], "--budget"), (["--mode", "rpc"], "--mode"),
                       (["--objective", "speed"], "objective")):
        out = subprocess.run([sys.executable, "-m", "arcsplit", "tune", str(demo_model), "--backend", "cpu", *args],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and word in out.stderr and "Traceback" not in out.stderr


def test_doctor_verify_checks_every_route(demo_model: Path, llama_bins: LlamaBinaries, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARCSPLIT_TUNE_DIR": str(tmp_path / "tune")}
    out = subprocess.run([sys.executable, "-m", "arcsplit", "doctor", "--backend", "cpu", "--gpus", "0,1",
                          "--llama-dir", str(llama_bins.bin_dir), "--verify", str(demo_model), "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = {r["label"]: r for r in json.loads(out.stdout)["verify"]}
    assert rows["cpu single-1card [defaults]"]["status"] == "ok"
    assert rows["cpu rpc [defaults]"]["status"] == "ok" and "matches the reference" in rows["cpu rpc [defaults]"]["reason"]
    assert rows["cpu hybrid-local [defaults]"]["status"] == "pruned"  # gemma3 ties its output: the planner says no
    assert not list((tmp_path / "tune").glob("*.json"))  # a check keeps nothing
