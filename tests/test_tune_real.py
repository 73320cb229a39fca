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

import arcsplit
from arcsplit import synth
from arcsplit.decide.prepare import ServeRequest, plan_for_mode, preview
from arcsplit.llama.locate import LlamaBinaries
from arcsplit.proc.ports import free_port
from arcsplit.rig import MiB
from arcsplit.tuning import fingerprint as fpmod
from arcsplit.tuning import verify
from arcsplit.tuning.candidates import Candidate
from arcsplit.tuning.picks import request_for, tuned
from arcsplit.tuning.runner import TuneRequest, tune

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
    # every correct route's time to first token (ms, the client's clock) is measured beside its rates
    assert all(r["ttft"] > 0 for r in tried.values() if r["status"] == "ok")
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

    # the Python API's serve runs the pick too, and says so in its status; tuned=False runs the default order
    import arcsplit

    api = dict(backend="cpu", ctx=1024, llama_dir=str(llama_bins.bin_dir), bus=False)
    with arcsplit.serve(demo_model, [0, 1], port=free_port(), **api) as server:
        st = server.status()
        assert st["mode"] == picked["mode"] and st["choice"]["by"] == "tune", st["choice"]
    with arcsplit.serve(demo_model, [0, 1], port=free_port(), tuned=False, **api) as server:
        st = server.status()
        assert st["mode"] == first.results[first.default]["candidate"]["mode"] and st["choice"]["by"] == "default"

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

    # by time to first token: the kept figures are ranked shortest first (a second round may keep the default)
    lines.clear()
    by_ttft = tune(TuneRequest(req, objective="ttft", budget_s=600, per_candidate_s=1, settings=False),
                   say=lines.append)
    assert by_ttft.reused == len(by_ttft.order)  # the first run measured it: nothing is started for the ranking
    ttft = {k: r["ttft"] for k, r in by_ttft.results.items() if r.get("status") == "ok"}
    assert by_ttft.pick in (min(ttft, key=ttft.__getitem__), by_ttft.default)
    assert all(" ms" in line for line in lines if line.startswith("second round"))
    got = tuned(req, "ttft")
    assert got is not None and got[0].choice is not None and got[0].choice.objective == "ttft"
    assert got[0].choice.ttft == ttft[by_ttft.pick] and "first token" in got[1]
    last = tuned(req)  # serve and plan without --objective: the objective this rig was last tuned for
    assert last is not None and last[0].choice is not None and last[0].choice.objective == "ttft"


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


# Each CPU card of the MoE rig: 30 MiB (14 MiB after the 16 MiB margin). The 12-layer synthetic qwen3moe's
# attention, embeddings, KV and compute need about 14 MiB on one card, so the whole model on one card is refused,
# and its routed experts (3 MiB a layer) fit the two cards only for a few layers: the planner keeps the rest in
# llama-server's host RAM (--n-cpu-moe), bounded by HOST_MIB.
MOE_CARD_MIB, HOST_MIB = 30, 1024


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.write_qwen3moe(tmp_path_factory.mktemp("tune-moe") / "moe.gguf", n_layer=12, n_embd=256, n_head=4,
                                n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=2, n_ff_exp=128, n_vocab=2000,
                                seed=3)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _all_on_one_card(model: Path, bins: LlamaBinaries) -> verify.Sample:
    """The reference computed another way: every expert on one CPU card big enough for the whole model."""
    with arcsplit.serve(model, gpus=[0], backend="cpu", ctx=512, port=free_port(), cpu_memory_mib=1024,
                        moe_offload=0, llama_dir=str(bins.bin_dir), bus=False) as srv, httpx.Client(timeout=120) as c:
        assert srv.plan.options.moe_offload == 0
        return verify.sample(c, srv.url)


def test_tune_varies_expert_offload_on_a_moe_that_does_not_fit(moe_model: Path, llama_bins: LlamaBinaries,
                                                              tune_cache: Path) -> None:
    req = _request(moe_model, llama_bins, ctx=512, cpu_memory_mib=MOE_CARD_MIB, host_memory_mib=HOST_MIB)
    lines: list[str] = []
    report = tune(TuneRequest(req, budget_s=600, per_candidate_s=1), say=lines.append)
    res = {k: report.results[k] for k in report.order}
    one = res["cpu:single-1card:defaults"]  # planned over one card's memory: refused before any process
    assert one["status"] == "pruned" and "argv" not in one and "short by" in one["reason"], one

    # every candidate started is the planner's plan: its --n-cpu-moe, within each card's and the host's bounds
    p = preview(req)
    started = {k: r for k, r in res.items() if "argv" in r}
    assert len(started) >= 4, lines
    for k, r in started.items():
        c = Candidate.from_dict(r["candidate"])
        plan = plan_for_mode(p.profile, p.rig, request_for(p.request, c, p.rig), c.mode)
        assert _flag(r["argv"], "--n-cpu-moe") == str(r["planned"]["moe_offload"]) == str(plan.options.moe_offload), k
        assert all(cp.total <= cp.card.budget_bytes for cp in plan.cards), k
        assert plan.host_bytes <= HOST_MIB * MiB, k
    assert report.pick in started and res[report.pick]["status"] == "ok"

    # the settings phase ran on the best route, with two more layers' experts in host RAM than the planner's
    (varied,) = [r for r in started.values() if r["candidate"]["settings"]["moe_offload"] is not None]
    base = Candidate.from_dict(varied["candidate"]).route_key
    planned = res[f"cpu:{base}:defaults"]["planned"]["moe_offload"]
    assert 0 < planned < p.profile.n_layer_main - 1  # some experts on the cards, some in host RAM
    assert _flag(varied["argv"], "--n-cpu-moe") == str(planned + 2), varied["argv"]
    assert varied["status"] == "ok" and "decode" in varied, varied.get("reason")

    # and it computes what the model with every expert on one big card does
    reference = _all_on_one_card(moe_model, llama_bins)
    for k, r in started.items():
        check = verify.compare(reference, verify.from_json(r["sample"]))
        assert check.ok, (k, check.reason)
