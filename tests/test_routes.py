"""The routes serve may run, decided before the start, and when the supervisor moves down them; the output canary's
verdict. No processes: the default order (llama/mode.fallbacks), the list decide/ builds (decide/routes.py), tune's
ranking as a list and a route marked wrong in tune's results (tuning/picks.py), the walk (run/fallback.py), the
canary's judgement (run/canary.judge) on answers recorded from the real CPU build. tests/test_canary_real.py runs
them against real processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from arcsplit.decide.choice import ChosenBy, RouteChoice, RuledOut
from arcsplit.decide.prepare import ServeRequest, preview
from arcsplit.decide.routes import RouteEntry, RouteList, entry
from arcsplit.decide.specs import ServeConfig
from arcsplit.errors import BadInput
from arcsplit.llama import verify
from arcsplit.llama.mode import ModeDecision, choose_mode, fallbacks
from arcsplit.llama.verdict import Verdict
from arcsplit.modes import Mode
from arcsplit.proc.states import Cause
from arcsplit.route import Route
from arcsplit.run.canary import Verdict as Said, judge
from arcsplit.run.fallback import FallbackPolicy, Leave, RouteTracker, route_lines
from arcsplit.telemetry.prometheus import render
from arcsplit.tuning import fingerprint as fpmod
from arcsplit.tuning import picks

from test_specs import make_plan

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]


def _samples() -> dict[str, verify.Sample]:
    data = json.loads((FIX / "tune" / "cpu_routes_gemma3_270m.json").read_text())
    return {k: verify.from_json(v) for k, v in data.items()}


# -- the default order ------------------------------------------------------------------------------------------


def test_the_default_order_goes_down_from_autos_choice() -> None:
    cuda = choose_mode("cuda", 2)
    later, out = fallbacks("cuda", 2, cuda)
    assert cuda.mode is Mode.MULTI and [d.mode for d in later] == [Mode.HYBRID, Mode.RPC] and out == ()
    cpu = choose_mode("cpu", 2)
    assert cpu.mode is Mode.RPC and [d.mode for d in fallbacks("cpu", 2, cpu)[0]] == [Mode.HYBRID]
    assert fallbacks("cuda", 1, choose_mode("cuda", 1)) == ((), ())  # one card: no other route
    remote = choose_mode("cuda", 2, n_remote=1)  # one card here, one on another host
    assert remote.mode is Mode.HYBRID and [d.mode for d in fallbacks("cuda", 2, remote, n_remote=1)[0]] == [Mode.RPC]
    assert fallbacks("cuda", 2, choose_mode("cuda", 2, n_remote=2), n_remote=2) == ((), ())


def test_what_the_verdict_or_the_probe_rules_out_is_left_out_with_why() -> None:
    bad = Verdict(status="bad", affects="multi-device", summary="NEO 25.44 fails multi-device allocations",
                  rule="neo-alloc", sources=("intel/compute-runtime#916",))
    decision = choose_mode("sycl", 2, verdict=bad)
    later, out = fallbacks("sycl", 2, decision, verdict=bad)
    assert decision.mode is Mode.HYBRID and [d.mode for d in later] == [Mode.RPC]
    why = dict(out)
    assert "versions say it fails" in why[Mode.MULTI] and "compute-runtime#916" in why[Mode.MULTI]
    assert "workaround" in why[Mode.MULTI_WORKAROUND]
    probed = {"multi": True, "hybrid": False}  # a recorded failure of hybrid here
    later, out = fallbacks("sycl", 2, choose_mode("sycl", 2, probe_results=probed), probe_results=probed)
    assert [d.mode for d in later] == [Mode.RPC] and "probe: hybrid failed" in dict(out)[Mode.HYBRID]
    distrust = "no check has verified one context on 4 cards"
    later, out = fallbacks("sycl", 4, choose_mode("sycl", 4, distrust_one_context=distrust),
                           distrust_one_context=distrust)
    assert dict(out)[Mode.MULTI] == distrust and [d.mode for d in later] == [Mode.RPC]


# -- the list decide/ builds -------------------------------------------------------------------------------------


def _req(model: Path, **kw: object) -> ServeRequest:
    return ServeRequest(**{"model": str(model), "gpus": [0, 1], "backend": "cpu", "ctx": 1024, **kw})  # type: ignore[arg-type]


def test_every_route_is_planned_before_the_start(demo_model: Path) -> None:
    p = preview(_req(demo_model))
    routes = p.route_list
    assert [r.label for r in routes.routes] == ["rpc", "hybrid"] and not routes.asked
    assert routes.first.config is p.config and routes.routes[1].config.mode is Mode.HYBRID
    assert routes.routes[1].config.plan.cards and routes.routes[1].choice.by is ChosenBy.DEFAULT
    assert routes.lines()[0].startswith("routes, in order: rpc, hybrid")
    asked = preview(_req(demo_model, mode="hybrid")).route_list
    assert [r.label for r in asked.routes] == ["hybrid"] and asked.asked and "only (--mode" in asked.lines()[0]


def test_a_route_kept_as_computing_wrong_is_left_out_and_the_next_runs(demo_model: Path) -> None:
    ruled = (RuledOut("rpc", "cpu rpc [defaults]", "computes wrong here: the output canary"),)
    p = preview(_req(demo_model, ruled_out=ruled))
    assert p.config.mode is Mode.HYBRID and [r.label for r in p.route_list.routes] == ["hybrid"]
    assert p.route_list.left_out == (("rpc", "computes wrong here: the output canary"),)
    assert any(r.startswith("left out rpc") for r in p.decision.reasons)
    both = (*ruled, RuledOut("hybrid", "cpu hybrid-last [defaults]", "computes wrong here"))
    with pytest.raises(BadInput, match="every route this rig allows computed wrong here"):
        preview(_req(demo_model, ruled_out=both))


def test_tunes_ranking_is_the_list_pick_first(demo_model: Path) -> None:
    pick = RouteChoice(ChosenBy.TUNE, "rpc", "cpu rpc [defaults]", "decode", 1.0, 40.0, 300.0, 39.0,
                       key="cpu:rpc:defaults")
    nxt = _req(demo_model, mode="hybrid", verified=True, choice=replace(pick, mode="hybrid", key="cpu:hybrid-last:defaults",
                                                                        label="cpu hybrid-last [defaults]"))
    p = preview(_req(demo_model, mode="rpc", verified=True, choice=pick, fallbacks=(nxt,),
                     ruled_out=(RuledOut("hybrid", "cpu hybrid-local [defaults]", "pruned in arcsplit tune: ties"),)))
    rl = p.route_list
    assert [(r.label, r.key, r.config.mode) for r in rl.routes] == [
        ("cpu rpc [defaults]", "cpu:rpc:defaults", "rpc"), ("cpu hybrid-last [defaults]", "cpu:hybrid-last:defaults", "hybrid")]
    assert rl.left_out == (("cpu hybrid-local [defaults]", "pruned in arcsplit tune: ties"),) and not rl.asked


def _kept(samples: dict[str, verify.Sample]) -> dict:
    def res(mode: str, key: str, status: str, decode: float | None, **extra: object) -> dict:
        cand = {"mode": mode, "backend": "cpu", "output_layer": "last" if mode == "hybrid" else "auto",
                "one_card": mode == "single"}
        figs = {"decode": decode, "prefill": 100.0, "streams": 10.0} if decode else {}
        return {"candidate": cand, "label": key, "status": status, **figs, **extra}

    return {"objective": "decode", "picks": {"decode": "cpu:rpc:defaults"}, "results": {
        "cpu:single-1card:defaults": res("single", "cpu:single-1card:defaults", "ok", 30.0, sample=verify.to_json(
            samples["single"]), reason="reference (the whole model on one card)"),
        "cpu:rpc:defaults": res("rpc", "cpu:rpc:defaults", "ok", 40.0, sample=verify.to_json(samples["rpc"])),
        "cpu:rpc:ub256": res("rpc", "cpu:rpc:ub256", "ok", 39.0) | {"candidate": {
            "mode": "rpc", "backend": "cpu", "settings": {"ubatch": 256}}},
        "cpu:hybrid-last:defaults": res("hybrid", "cpu:hybrid-last:defaults", "ok", 35.0),
        "cpu:hybrid-local:defaults": res("hybrid", "cpu:hybrid-local:defaults", "pruned", None, reason="ties")
        | {"candidate": {"mode": "hybrid", "backend": "cpu", "output_layer": "local"}},
    }}


def test_tunes_kept_results_give_the_ranking_each_route_once_and_the_canarys_reference() -> None:
    s = _samples()
    kept = _kept(s)
    nexts, ruled = picks.ranked_routes(kept, "cpu:rpc:defaults", "decode")
    assert nexts == ["cpu:hybrid-last:defaults", "cpu:single-1card:defaults"]  # rpc's ub256: the same route
    assert [(r.mode, r.label) for r in ruled] == [("hybrid", "cpu:hybrid-local:defaults")] and "pruned" in ruled[0].why
    assert picks.reference_of(kept) == s["single"]  # what tune checked every route against
    del kept["results"]["cpu:single-1card:defaults"]
    assert picks.reference_of(kept) == s["rpc"]  # else the pick's own checked answer


def test_a_route_marked_wrong_is_never_picked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    demo_model: Path) -> None:
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    fp = fpmod.Fingerprint("cpu", ("0:CPU", "1:CPU"), "", "", "", "6.1", "build", "model", 1024, 1)
    monkeypatch.setattr(picks, "fingerprint_of", lambda p, b: fp)
    monkeypatch.setattr(picks, "find_llama", lambda *a, **k: None)
    req = _req(demo_model)
    assert fpmod.store(fp, _kept(_samples()))
    assert picks.tuned(req) is not None  # tune's pick, rpc, runs
    key = picks.mark_wrong(req, "cpu:rpc:defaults", "rpc", {"reason": "prompt 1, token 1: token 9 where ..."})
    res = fpmod.load(fp)["results"][key]
    assert key == "cpu:rpc:defaults" and res["status"] == "wrong" and "output canary" in res["reason"]
    assert res["canary"]["reason"].startswith("prompt 1") and "decode" in res  # what tune measured stays
    assert picks.tuned(req) is None  # the pick computes wrong: no tuned route
    known = picks.remembered(req)
    assert [r.mode for r in known.ruled_out] == ["rpc"] and known.reference == _samples()["single"]
    assert preview(known).config.mode is Mode.HYBRID  # the default order less rpc
    # a default-order route tune never measured: marked under the key tune would give it
    assert picks.mark_wrong(req, "", "hybrid", {"reason": "x"}) == "cpu:hybrid-last:defaults"
    assert picks.mark_wrong(_req(demo_model, ubatch=256), "", "rpc", {"reason": "x"}) == "cpu:rpc:ub256"


# -- the walk down the list --------------------------------------------------------------------------------------


def _list(demo_model: Path) -> RouteList:
    return preview(_req(demo_model)).route_list


def test_when_a_route_is_left(demo_model: Path) -> None:
    t = RouteTracker(_list(demo_model), FallbackPolicy(load_failures=3, hangs=3, hang_window=1800.0))
    assert t.why_leave(Cause.EXIT, None, loaded=True, now=0) is None  # a crash once ready: restarted, not left
    assert t.why_leave(Cause.EXIT, None, loaded=False, now=1) is None
    assert t.why_leave(Cause.EXIT, None, loaded=False, now=2) is None
    t.ready()  # a load that worked in between: the count starts over
    assert [t.why_leave(Cause.LOAD, None, loaded=False, now=i) for i in range(3)] == [None, None, Leave.LOAD]
    assert t.why_leave(Cause.EXIT, "alloc", loaded=False, now=3) != Leave.MULTI_DEVICE  # rpc is no one context
    hangs = RouteTracker(_list(demo_model))
    assert [hangs.why_leave(Cause.HANG, None, True, now) for now in (0, 1000, 1900)] == [None, None, None]  # 3 in 31 min
    assert hangs.why_leave(Cause.HANG, None, True, 2000) is Leave.HANG  # 1000, 1900, 2000: 3 within 30 min
    assert RouteTracker(_list(demo_model)).why_leave(Cause.WRONG, None, True, 0) is Leave.WRONG  # at once


def test_a_one_context_allocation_failure_leaves_at_once() -> None:
    def route(mode: str) -> RouteEntry:
        plan = make_plan("sycl", [0, 1], Route.build(mode, "sycl", [0, 1]).devices)
        config = ServeConfig(plan=plan, mode=Mode(mode), backend="sycl", server_bin="llama-server", rpc_bin="rpc")
        return entry(config, ModeDecision(Mode(mode)), RouteChoice.untuned(mode, False), "x")

    t = RouteTracker(RouteList((route("multi"), route("hybrid"))))
    assert t.why_leave(Cause.EXIT, "pinned_output", loaded=False, now=0) is Leave.MULTI_DEVICE
    t.move(Leave.MULTI_DEVICE, "failed to allocate SYCL0 buffer", 1.0)
    assert t.why_leave(Cause.EXIT, "alloc", loaded=False, now=2) is None  # hybrid: one failed load so far


def test_moves_and_the_list_running_out(demo_model: Path) -> None:
    t = RouteTracker(_list(demo_model))
    move = t.move(Leave.WRONG, "prompt 1, token 1: token 9 where the reference chose 506", 10.0)
    assert move.to is not None and move.to.label == "hybrid" and t.current.label == "hybrid" and t.next is None
    assert move.line() == ("route rpc computes wrong (prompt 1, token 1: token 9 where the reference chose 506); "
                           "now hybrid")
    last = t.move(Leave.WRONG, "prompt 2, token 3: ...", 20.0)
    assert last.to is None and t.current.label == "hybrid" and "no route left" in last.line()
    why = t.exhausted("")
    assert why.startswith("no route left (2 tried): rpc: wrong (prompt 1") and "hybrid: wrong (prompt 2" in why
    status = t.to_dict()
    assert status["now"] == "hybrid" and [m["left"] for m in status["moves"]] == ["rpc", "hybrid"]
    lines = route_lines(status, {"on": True, "every": 600.0, "reference": "first ready", "counts": {"wrong": 2},
                                 "last": {"verdict": "wrong", "seconds": 1.2}})
    assert lines[0] == "route now: hybrid (2 of 2: rpc, hybrid)" and lines[1].startswith("left rpc: wrong (prompt 1")
    assert lines[-1].startswith("output canary: every 600 s while idle, reference first ready; checks: wrong 2")
    assert route_lines(None, {"on": False}) == ["output canary: off"] and route_lines(None, None) == []


def test_metrics_count_route_changes_by_reason_and_canary_tries(demo_model: Path) -> None:
    t = RouteTracker(_list(demo_model))
    t.move(Leave.WRONG, "x", 1.0)
    text = render({"state": "ready", "routes": t.to_dict(),
                   "canary": {"on": True, "counts": {"pass": 3, "gave_way": 1}, "last": {"seconds": 1.25}}})
    assert 'arcsplit_route_changes_total{reason="wrong"} 1.0' in text
    assert 'arcsplit_route_changes_total{reason="hang"} 0.0' in text
    assert 'arcsplit_route_now_info{label="hybrid",of="2",position="2"} 1.0' in text
    assert 'arcsplit_canary_checks_total{verdict="pass"} 3.0' in text and "arcsplit_canary_last_seconds 1.25" in text


# -- the canary's judgement --------------------------------------------------------------------------------------


def test_the_canary_judges_each_prompt_as_it_comes() -> None:
    s = _samples()
    ref = s["single"]
    assert judge(None, ref[:2]) == (None, None)  # no reference yet, not every prompt answered: ask on
    assert judge(None, ref)[0] is Said.REFERENCE
    verdict, check = judge(ref, s["rpc"][:1])  # one prompt so far, within tune's tolerance of the reference
    assert verdict is None and check is not None and check.ok
    assert judge(ref, s["rpc"])[0] is Said.PASS and judge(ref, s["hybrid"])[0] is Said.PASS  # real noise accepted
    wrong = (s["rpc"][0], tuple(replace(st, token=st.token + 7, logprob=-9.0) for st in s["rpc"][1]))
    verdict, check = judge(ref, wrong)
    assert verdict is Said.WRONG and check is not None and (check.prompt, check.position) == (1, 0)
    ev = verify.evidence(ref[:2], wrong, check)
    assert ev["prompt"] == verify.PROMPTS[1] and ev["position"] == 0
    assert ev["got"]["token"] == ref[1][0].token + 7 and ev["reference"]["token"] == ref[1][0].token
    assert ev["reference"]["top"] and math.isclose(ev["got"]["logprob"], -9.0)


# -- bad values --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon", "0.5s", "8d"])
def test_a_bad_canary_interval_is_one_line_and_exit_2(value: str, demo_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ARCSPLIT_STATE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu",
                          f"--canary-every={value}"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2 and "--canary-every" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(BadInput, match="--canary-every"):
        preview(_req(demo_model, canary_every=value))


def test_the_api_takes_the_interval_as_seconds_or_a_duration(demo_model: Path) -> None:
    assert preview(_req(demo_model, canary_every="2m")).request.canary_every == 120.0
    assert preview(_req(demo_model, canary_every=30)).request.canary_every == 30.0
    assert preview(_req(demo_model, canary=False, canary_every=0)).request.canary is False  # off: not read


def test_the_dashboard_shows_the_route_now_and_why_the_last_was_left(demo_model: Path) -> None:
    from textual.content import Content

    from arcsplit.tui.state import DashState
    from arcsplit.tui.widgets import render_plan

    t = RouteTracker(_list(demo_model))
    state = DashState(clock=lambda: 1000.0)
    state.apply({"kind": "snapshot", "data": {"status": {"state": "ready", "mode": "rpc", "routes": t.to_dict(),
                                                         "canary": {"on": True, "every": 600.0, "counts": {}}}}})
    assert "route now: rpc (1 of 2: rpc, hybrid)" in Content.from_markup(render_plan(state)).plain
    state.apply({"kind": "canary", "name": "group", "data": {"verdict": "wrong", "seconds": 1.5, "prompts": 1,
                                                              "reason": "prompt 1, token 1: ..."}})
    state.apply({"kind": "route", "name": "group", "data": {"left": "rpc", "reason": "wrong", "message": "prompt 1",
                                                             "to": "hybrid", "mode": "hybrid"}})
    plan = Content.from_markup(render_plan(state)).plain
    assert "route now: hybrid (2 of 2: rpc, hybrid)" in plan and "left rpc: wrong (prompt 1)" in plan
    assert "checks: wrong 1; last: wrong in 1.5 s" in plan
