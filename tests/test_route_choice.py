"""How serve's route was chosen (decide/choice.RouteChoice), without processes: made from tune's kept results,
made by prepare for an untuned or --mode run, carried in status and the plan event, and what each surface renders
from it. tests/test_tune_surfaces.py runs the same through a real tune and a real serve."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from textual.content import Content

import arcsplit
from arcsplit.cli.tune import render as tune_render
from arcsplit.decide.choice import LEGEND, ChosenBy, RouteChoice
from arcsplit.decide.prepare import ServeRequest, preview
from arcsplit.run.events import PlanData
from arcsplit.telemetry.prometheus import render
from arcsplit.tui.state import DashState
from arcsplit.tui.widgets import render_header, render_plan
from arcsplit.tuning import fingerprint as fpmod
from arcsplit.tuning.picks import choice_of
from arcsplit.tuning.runner import TuneReport

# What tune keeps for one fingerprint (fingerprint.store's file), as a run on two CPU cards left it.
KEPT = {
    "objective": "decode", "default": "cpu:rpc:defaults", "updated": 1_780_000_000.0,
    "picks": {"decode": "cpu:single-1card:defaults"},
    "results": {
        "cpu:single-1card:defaults": {"candidate": {"mode": "single"}, "label": "cpu single-1card [defaults]",
                                      "status": "ok", "prefill": 410.5, "decode": 61.25, "streams": 60.0},
        "cpu:rpc:defaults": {"candidate": {"mode": "rpc"}, "label": "cpu rpc [defaults]", "status": "ok",
                             "prefill": 300.0, "decode": 40.5, "streams": 39.0},
        "cpu:hybrid-local:defaults": {"candidate": {"mode": "hybrid"}, "label": "cpu hybrid-local [defaults]",
                                      "status": "pruned", "reason": "the model ties its output to the embeddings"},
        "cpu:hybrid-last:defaults": {"candidate": {"mode": "hybrid"}, "label": "cpu hybrid-last [defaults]",
                                     "status": "wrong", "reason": "2 of 3 prompts differ from the reference"},
    },
}


def _tuned() -> RouteChoice:
    choice = choice_of(KEPT)
    assert choice is not None
    return choice


def test_a_kept_pick_becomes_the_typed_choice_with_its_figures_and_alternatives() -> None:
    c = _tuned()
    assert c.by is ChosenBy.TUNE and c.tuned and c.mode == "single" and c.label == "cpu single-1card [defaults]"
    assert (c.decode, c.prefill, c.streams, c.objective, c.tuned_at) == (61.25, 410.5, 60.0, "decode", 1_780_000_000.0)
    assert [a.key for a in c.alternatives][0] == "cpu:single-1card:defaults" and len(c.alternatives) == 4
    marks = {a.key: (a.pick, a.default, a.status) for a in c.alternatives}
    assert marks["cpu:rpc:defaults"] == (False, True, "ok") and marks["cpu:hybrid-last:defaults"][2] == "wrong"
    assert RouteChoice.from_dict(json.loads(json.dumps(c.to_dict()))) == c  # the wire form reads back whole


def test_no_correct_pick_is_no_tuned_choice() -> None:
    wrong = {**KEPT, "results": {**KEPT["results"], "cpu:single-1card:defaults": {
        **KEPT["results"]["cpu:single-1card:defaults"], "status": "wrong"}}}
    assert choice_of(wrong) is None
    assert choice_of({**KEPT, "picks": {}}) is None
    assert choice_of(KEPT, "prefill") is None  # tuned by decode only: serve --objective prefill is not tuned


def test_lines_say_tuned_asked_or_the_default_order() -> None:
    line = _tuned().line()
    assert "cpu single-1card [defaults]" in line and "chosen by arcsplit tune" in line and "decode 61.2" in line
    assert "prefill 410.5" in line and "streams 60.0" in line
    assert RouteChoice.untuned("rpc", asked=True).line() == "route: rpc, as asked (--mode rpc; not tuned)"
    assert RouteChoice.untuned("hybrid", asked=False).line() == "route: hybrid by the default order (not tuned)"
    table = _tuned().table()
    assert "route [settings]" in table[0] and "2nd decode" in table[0]  # the header names the columns
    assert table[1].startswith(" * cpu single-1card") and any(row.startswith(" d cpu rpc") for row in table)
    assert any("ties its output" in row for row in table)  # a pruned one says why instead of figures


# A tune whose fastest-looking route (hybrid-last, 92.7 t/s) lost the second round to the default (rpc, 72.3 t/s):
# the default stays the pick. A pruned route's note is longer than any column.
LOST = {
    "objective": "decode", "default": "cpu:rpc:defaults", "updated": 1_780_000_000.0,
    "picks": {"decode": "cpu:rpc:defaults"},
    "results": {
        "cpu:rpc:defaults": {"candidate": {"mode": "rpc"}, "label": "cpu rpc [defaults]", "status": "ok",
                             "prefill": 300.0, "decode": 72.3, "streams": 70.0, "confirm_decode": 71.9},
        "cpu:hybrid-last:defaults": {"candidate": {"mode": "hybrid"}, "label": "cpu hybrid-last [defaults]",
                                     "status": "ok", "prefill": 310.0, "decode": 92.7, "streams": 88.0,
                                     "confirm_decode": 68.4},
        "cpu:hybrid-local:defaults": {"candidate": {"mode": "hybrid"}, "label": "cpu hybrid-local [defaults]",
                                      "status": "pruned", "reason": "card 1 is short by 123 MiB for the weights, the "
                                      "KV cache and the compute buffer at this context; lower --ctx or add a card"},
    },
}


def test_the_table_shows_the_second_round_the_default_mark_and_whole_notes() -> None:
    choice = choice_of(LOST)
    assert choice is not None
    pick = next(row for row in choice.table() if "cpu rpc" in row)
    assert pick.startswith("*d cpu rpc")  # the pick is the default order's route: both marks
    lost = next(row for row in choice.table() if "hybrid-last" in row)
    # first round beside the second; "-": kept before tune measured the time to first token
    assert lost.split()[-3:] == ["88.0", "-", "68.4"] and "92.7" in lost
    assert pick.split()[-1] == "71.9"
    pruned = next(row for row in choice.table() if "hybrid-local" in row)
    assert pruned.endswith("lower --ctx or add a card")  # the note whole, not cut mid-word
    assert "d the default order's route" in LEGEND and "2nd" in LEGEND


def test_tune_cli_table_says_the_faster_one_lost_the_second_round() -> None:
    report = TuneReport(fpmod.Fingerprint("cpu", ("0:CPU", "1:CPU"), "", "", "", "6.1", "b", "m", 1024, 1),
                        "decode", dict(LOST["results"]), list(LOST["results"]), "cpu:rpc:defaults",
                        "cpu:rpc:defaults", reused=0, wall_s=30.0)
    out = tune_render(report)
    assert out[0] == f"{LEGEND}:" and "2nd decode" in out[1]
    assert any(row.startswith("*d cpu rpc [defaults]") for row in out)
    said = next(row for row in out if row.startswith("cpu hybrid-last [defaults] was faster"))
    assert "92.7 t/s" in said and "lost the second round (68.4 against 71.9 t/s)" in said
    assert any(row.endswith("lower --ctx or add a card") for row in out)


# A tune by time to first token (ms, shorter is better): the pick is the route with the shortest one, not the one
# with the highest rates.
BY_TTFT = {
    "objective": "ttft", "default": "cpu:rpc:defaults", "updated": 1_780_000_000.0,
    "picks": {"ttft": "cpu:hybrid-last:ub512", "decode": "cpu:rpc:defaults"},
    "results": {
        "cpu:rpc:defaults": {"candidate": {"mode": "rpc"}, "label": "cpu rpc [defaults]", "status": "ok",
                             "prefill": 300.0, "decode": 72.3, "streams": 70.0, "ttft": 33.6, "confirm_ttft": 34.0},
        "cpu:hybrid-last:ub512": {"candidate": {"mode": "hybrid"}, "label": "cpu hybrid-last [ub512]",
                                  "status": "ok", "prefill": 290.0, "decode": 60.1, "streams": 58.0, "ttft": 22.4,
                                  "confirm_ttft": 22.7},
    },
}


def test_a_pick_by_time_to_first_token_shows_it_in_ms_everywhere() -> None:
    from arcsplit.tuning.candidates import rank

    assert rank(BY_TTFT["results"], "ttft") == ["cpu:hybrid-last:ub512", "cpu:rpc:defaults"]  # shortest first
    assert rank(BY_TTFT["results"], "decode") == ["cpu:rpc:defaults", "cpu:hybrid-last:ub512"]
    choice = choice_of(BY_TTFT, "ttft")
    assert choice is not None and choice.objective == "ttft" and choice.ttft == 22.4
    assert "first token 22.4 ms" in choice.line() and RouteChoice.from_dict(choice.to_dict()) == choice
    table = choice.table()
    assert "ttft ms" in table[0] and "2nd ttft" in table[0]
    assert table[1].startswith(" * cpu hybrid-last [ub512]") and table[1].split()[-2:] == ["22.4", "22.7"]
    report = TuneReport(fpmod.Fingerprint("cpu", ("0:CPU", "1:CPU"), "", "", "", "6.1", "b", "m", 1024, 1),
                        "ttft", dict(BY_TTFT["results"]), list(BY_TTFT["results"]), "cpu:rpc:defaults",
                        "cpu:hybrid-last:ub512", wall_s=30.0)
    result = report.result()
    assert result.speedup == pytest.approx(33.6 / 22.4)  # better either way reads above 1
    said = next(row for row in tune_render(report) if row.startswith("\npick"))
    assert "ttft 22.4 ms" in said and "33.6 ms (1.50x better)" in said
    text = render({"state": "ready", "mode": "hybrid", "choice": choice.to_dict()}, None)
    assert "arcsplit_route_tuned_time_to_first_token_seconds 0.0224" in text
    assert "time_to_first_token" not in render({"state": "ready", "mode": "single", "choice": _tuned().to_dict()}, None)


def test_prepare_carries_the_choice_it_was_given_else_says_untuned(demo_model: Path) -> None:
    req = ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", ctx=1024)
    untuned = preview(req).choice
    assert untuned is not None and untuned.by is ChosenBy.DEFAULT and untuned.mode == preview(req).config.mode
    asked = preview(replace(req, mode="rpc")).choice
    assert asked is not None and asked.by is ChosenBy.ASKED and asked.note == "--mode rpc"
    tuned = preview(replace(req, mode="single", gpus=[0], choice=_tuned())).choice
    assert tuned == _tuned()


def test_the_plan_event_carries_it_only_when_known() -> None:
    bare = PlanData(plan={"cards": []}, mode="rpc")
    assert "choice" not in bare.to_dict()  # an instance that says nothing: as before
    sent = PlanData(plan={"cards": []}, mode="single", choice=_tuned()).to_dict()
    assert sent["choice"]["by"] == "tune" and sent["choice"]["alternatives"][1]["label"] == "cpu hybrid-last [defaults]"


def _plain(markup: str) -> str:
    """What the screen shows of a panel's markup (brackets in labels are escaped in it)."""
    return Content.from_markup(markup).plain


def test_the_dashboard_renders_the_choice_from_status_and_the_plan_event() -> None:
    state = DashState(clock=lambda: 1000.0)
    state.apply({"kind": "snapshot", "data": {"status": {"state": "ready", "mode": "single", "backend": "cpu",
                                                         "choice": RouteChoice.untuned("rpc", False).to_dict()}}})
    assert "tuned" not in _plain(render_header(state))
    assert "route: rpc by the default order (not tuned)" in _plain(render_plan(state))
    state.apply({"kind": "plan", "name": "group", "data": {"plan": {}, "mode": "single",
                                                            "choice": _tuned().to_dict()}})
    assert "single/cpu tuned" in _plain(render_header(state))
    plan = _plain(render_plan(state))
    assert "chosen by arcsplit tune" in plan and "decode 61.2" in plan
    assert "* cpu single-1card [defaults]" in plan and "d cpu rpc [defaults]" in plan
    old = DashState()
    old.apply({"kind": "snapshot", "data": {"status": {"state": "ready", "mode": "rpc"}}})
    assert "route:" not in _plain(render_plan(old))  # an older instance's status has no choice: nothing is made up


def test_metrics_name_the_choice_and_the_tuned_figures() -> None:
    text = render({"state": "ready", "mode": "single", "choice": _tuned().to_dict()}, None)
    assert 'arcsplit_route_info{chosen_by="tune",label="cpu single-1card [defaults]"' in text
    assert 'arcsplit_route_tuned_tokens_per_second{figure="decode"} 61.25' in text
    text = render({"state": "ready", "mode": "rpc", "choice": RouteChoice.untuned("rpc", True).to_dict()}, None)
    assert 'chosen_by="asked"' in text and "arcsplit_route_tuned" not in text


def test_the_api_tune_result_is_a_frozen_view_of_the_report() -> None:
    report = TuneReport(fpmod.Fingerprint("cpu", ("0:CPU", "1:CPU"), "", "", "", "6.1", "b", "m", 1024, 1),
                        "decode", dict(KEPT["results"]), list(KEPT["results"]), "cpu:rpc:defaults",
                        "cpu:single-1card:defaults", reused=1, wall_s=12.5)
    result = report.result()
    assert isinstance(result, arcsplit.TuneResult) and result.pick is not None and result.default is not None
    assert result.pick.key == "cpu:single-1card:defaults" and result.pick.decode == 61.25 and result.pick.pick
    assert result.default.label == "cpu rpc [defaults]" and result.default.default
    assert [c.key for c in result.candidates] == list(KEPT["results"])  # in the order tried
    assert result.speedup == pytest.approx(61.25 / 40.5) and (result.wall_s, result.reused) == (12.5, 1)
    assert json.loads(json.dumps(result.to_dict()))["pick"] == "cpu:single-1card:defaults"
    with pytest.raises(AttributeError):
        result.pick = None  # type: ignore[misc]


@pytest.mark.parametrize("kw, word", [({"budget_s": 0}, "budget_s=0"), ({"objective": "speed"}, "objective"),
                                      ({"mode": "rpc"}, "mode='rpc'"), ({"per_candidate_s": -1}, "per_candidate_s=-1")])
def test_api_tune_bad_input_is_the_clis_one_line_bad_input(demo_model: Path, kw: dict, word: str,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    with pytest.raises(arcsplit.BadInput) as err:
        arcsplit.tune(demo_model, gpus=[0, 1], backend="cpu", **kw)
    assert word in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "tune").exists()  # refused before anything was measured or kept


def test_arcsplit_tune_is_the_function_however_the_package_was_imported() -> None:
    import arcsplit.tuning.runner as runner  # the package is arcsplit.tuning: importing it leaves arcsplit.tune alone

    assert callable(arcsplit.tune) and runner.tune is not arcsplit.tune
    from arcsplit import tune

    with pytest.raises(arcsplit.BadInput):
        tune("m.gguf", budget_s=0)
