"""The output canary and the route list with real processes: the CPU build's llama-server and rpc-servers, the demo
model, and tests/_corrupt_rpc.py's forwarder in front of each rpc-server, clean until it is told (SIGUSR1) to flip
the sign of the activations llama-server hands it. A route that turns wrong mid-serve is caught within one canary
interval, marked wrong in tune's results, and left for the next route, which answers a real chat request as the
first one did; when that one turns wrong too, the list has run out and the run stops with both reasons. A user's
request that arrives while the canary runs waits about one token of it."""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

import arcsplit
from arcsplit.errors import RunError
from arcsplit.llama import verify
from arcsplit.llama.locate import LlamaBinaries
from arcsplit.proc.ports import free_port
from arcsplit.report import collect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corrupt_rpc import live_build  # noqa: E402
from _procs import wait_until  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
EVERY = 2.0  # the canary's interval here: a check then runs about every 2 s while idle


def _live_corrupting_build(tmp: Path, bins: LlamaBinaries) -> Path:
    """A llama.cpp dir whose ggml-rpc-server is the real one behind the forwarder, clean until SIGUSR1."""
    return Path(live_build(tmp, str(bins.server), str(bins.rpc_server)))


def _until(what: Callable[[], Any], timeout: float, why: str) -> Any:
    return wait_until(what, timeout, why, interval=0.05)  # short states (a check under way) are seen


def _chat(url: str) -> verify.Sample:
    """A real chat request (greedy, 16 tokens, the top 5 log-probabilities), as verify's steps: token strings
    numbered by a table both answers share."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Name the capital of France."}], "max_tokens": 16, "temperature": 0,
        "logprobs": True, "top_logprobs": verify.TOP_K})
    r.raise_for_status()
    steps = []
    for t in r.json()["choices"][0]["logprobs"]["content"]:
        top = tuple((_id(a["token"]), float(a["logprob"])) for a in t["top_logprobs"])
        steps.append(verify.Step(_id(t["token"]), float(t["logprob"]), top))
    return (tuple(steps),)


_IDS: dict[str, int] = {}


def _id(token: str) -> int:
    return _IDS.setdefault(token, len(_IDS))


def _rpc_pids(server: Any) -> list[int]:
    return [p["pid"] for p in server.status()["processes"].values() if p["role"] == "rpc" and p["pid"]]


def _canary(server: Any, verdict: str) -> int:
    return int(server.status()["canary"]["counts"].get(verdict, 0))


def test_a_route_that_turns_wrong_mid_serve_is_left_for_the_next_correct_route(
        demo_model: Path, llama_bins: LlamaBinaries, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tune_dir = tmp_path / "tune"
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tune_dir))
    monkeypatch.setenv("ARCSPLIT_RPC_SHM", "0")  # the activations cross the socket, where the forwarder is
    build = _live_corrupting_build(tmp_path, llama_bins)
    figures: dict[str, float] = {}
    with pytest.raises(RunError) as stopped:
        with arcsplit.serve(demo_model, [0, 1], backend="cpu", ctx=1024, port=free_port(), llama_dir=str(build),
                            bus=False, canary_every=EVERY) as server:
            assert server.mode == "rpc" and [r["label"] for r in server.status()["routes"]["routes"]] == ["rpc", "hybrid"]
            _until(lambda: _canary(server, "reference"), 60, "the canary's first answer, kept as the reference")
            figures["reference_s"] = server.status()["canary"]["last"]["seconds"]
            before = _chat(server.url)
            _until(lambda: _canary(server, "pass"), 60, "a check that passes on the clean route")
            figures["check_s"] = server.status()["canary"]["last"]["seconds"]

            t0 = time.time()
            for pid in _rpc_pids(server):  # rpc's forwarders start flipping what llama-server sends them
                os.kill(pid, signal.SIGUSR1)
            moves = _until(lambda: server.status()["routes"]["moves"], 60, "the canary catching the wrong route")
            figures["detected_s"] = moves[0]["at"] - t0
            assert moves[0]["left"] == "rpc" and moves[0]["reason"] == "wrong" and moves[0]["to"] == "hybrid"
            assert figures["detected_s"] <= EVERY + 20.0, figures  # one interval, and one check on a busy machine
            mismatch = server.status()["canary"]["mismatch"]
            ev = mismatch["evidence"]  # where it parted, and both sides' token and log-probability there
            assert ev["prompt"] in verify.PROMPTS and ev["position"] is not None and ev["reference"]["top"], ev
            assert ev["got"] is None or ev["got"]["token"] != ev["reference"]["token"] or \
                abs(ev["got"]["logprob"] - ev["reference"]["logprob"]) > verify.LOGPROB_TOL, ev

            # the route is marked wrong in tune's results for this rig: neither serve nor tune picks it again
            (kept,) = tune_dir.glob("*.json")
            res = json.loads(kept.read_text())["results"]["cpu:rpc:defaults"]
            assert res["status"] == "wrong" and "output canary" in res["reason"] and res["canary"]["position"] is not None
            # the evidence is in the run's state, and arcsplit report bundles it
            run_dir = Path(server.status()["run_dir"])
            state = json.loads((run_dir / "state.json").read_text())
            assert state["canary"]["mismatch"]["evidence"]["prompt"] == ev["prompt"]
            assert state["routes"]["moves"][0]["left"] == "rpc"
            files = collect(run_dir.name, None, None)
            assert json.loads(files[f"run/{run_dir.name}/canary-mismatch.json"])["evidence"]["position"] == ev["position"]

            _until(lambda: server.status()["state"] == "ready" and server.mode == "hybrid", 90, "hybrid serving")
            figures["serving_again_s"] = time.time() - t0
            passes = _canary(server, "pass")
            _until(lambda: _canary(server, "pass") > passes, 60, "hybrid's answer checked against the reference")
            check = verify.compare(before, _chat(server.url))  # a real chat request: what the clean route answered
            assert check.ok, check.reason
            print(f"\ncanary figures (demo model, 2 CPU cards): {json.dumps({k: round(v, 2) for k, v in figures.items()})}")

            for pid in _rpc_pids(server):  # hybrid's rpc-server turns wrong too: no route left
                os.kill(pid, signal.SIGUSR1)
            _until(lambda: server.status()["state"] == "stopped", 60, "the run stopping with no route left")
    why = str(stopped.value)
    assert "no route left (2 tried)" in why and "rpc: wrong" in why and "hybrid: wrong" in why, why
    marked = {k: r["status"] for k, r in json.loads(next(tune_dir.glob("*.json")).read_text())["results"].items()}
    assert marked == {"cpu:rpc:defaults": "wrong", "cpu:hybrid-last:defaults": "wrong"}


def _timed(url: str, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    httpx.post(f"{url}/completion", json=body, timeout=60).raise_for_status()
    return time.perf_counter() - t


def test_a_request_during_a_canary_check_waits_about_one_token(demo_model: Path, llama_bins: LlamaBinaries) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0, "cache_prompt": False}
    with arcsplit.serve(demo_model, [0, 1], backend="cpu", ctx=1024, port=free_port(), llama_dir=str(llama_bins.bin_dir),
                        bus=False, canary_every=1) as server:
        _until(lambda: server.status()["canary"]["counts"], 60, "the canary's first answer")
        idle, during = [], []
        for _ in range(5):
            _until(lambda: not server.status()["canary"]["running"], 30, "the canary between checks")
            idle.append(_timed(server.url, body))
            _until(lambda: server.status()["canary"]["running"], 30, "a canary check under way")
            time.sleep(0.15)  # its answer streaming by now
            gave_way = _canary(server, "gave_way")
            during.append(_timed(server.url, body))
            _until(lambda: _canary(server, "gave_way") > gave_way, 10, "the canary giving way to the request")
        waited = statistics.median(during) - statistics.median(idle)
        print(f"\nrequest alone {statistics.median(idle):.3f} s, during a canary check {statistics.median(during):.3f} s "
              f"(median of 5; max {max(during):.3f} s)")
        assert waited < 0.5, (idle, during)  # one token of the canary's answer and its cancel, not its whole check


def test_a_route_that_turns_wrong_under_steady_load_is_still_caught(
        demo_model: Path, llama_bins: LlamaBinaries, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that is never idle for a whole check (a request every 0.3 s) still gets one: what its answer
    streamed before it gave way is judged, and a route that computes wrong parts from the reference at once."""
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    monkeypatch.setenv("ARCSPLIT_RPC_SHM", "0")
    build = _live_corrupting_build(tmp_path, llama_bins)
    stop = threading.Event()

    def load(url: str) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    c.post(f"{url}/completion", json={"prompt": "1 2 3", "n_predict": 8, "cache_prompt": False})
                except httpx.HTTPError:
                    pass
                stop.wait(0.3)

    with arcsplit.serve(demo_model, [0, 1], backend="cpu", ctx=1024, port=free_port(), llama_dir=str(build),
                        bus=False, canary_every=EVERY) as server:
        _until(lambda: _canary(server, "reference"), 60, "the canary's first answer, kept as the reference")
        worker = threading.Thread(target=load, args=(server.url,), daemon=True)
        worker.start()
        try:
            t0 = time.time()
            for pid in _rpc_pids(server):
                os.kill(pid, signal.SIGUSR1)
            moves = _until(lambda: server.status()["routes"]["moves"], 60, "the canary catching the wrong route")
            assert moves[0]["reason"] == "wrong" and moves[0]["to"] == "hybrid", moves
            print(f"\nunder steady load: caught {moves[0]['at'] - t0:.1f} s after the corruption began")
        finally:
            stop.set()
            worker.join(70)
