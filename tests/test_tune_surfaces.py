"""``arcsplit.tune()`` and what serve then shows, for real: one tune of the demo model on two CPU cards (the CPU
build's llama-server and rpc-servers, real sockets) through the Python API, kept for the module; then ``arcsplit
serve`` without flags runs the pick, and its status (the bus, ``arcsplit ps``, the run's state file), the Textual
dashboard (pilot) and the metrics endpoint say the route was chosen by tune, with its figures and the alternatives;
with ``--mode`` or ``--no-tune`` they say it was not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env  # noqa: E402
from test_dash import until  # noqa: E402
from test_metrics import scrape, value  # noqa: E402

import arcsplit  # noqa: E402
from arcsplit.llama.locate import LlamaBinaries  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.run.bus import attach  # noqa: E402
from arcsplit.tui.app import DashApp  # noqa: E402
from arcsplit.tui.feed import Feed  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, llama_bins: LlamaBinaries,
          demo_model: Path) -> Iterator[dict[str, Any]]:
    """One real tune, routes only, each started candidate measured for a second; its results kept in the module's
    own directories, which every test's serve and CLI then read."""
    root = tmp_path_factory.mktemp("tuned")
    with isolated_env(root, llama_bins.bin_dir), pytest.MonkeyPatch.context() as mp:
        mp.setenv("ARCSPLIT_TUNE_DIR", str(root / "tune"))
        lines: list[str] = []
        result = arcsplit.tune(demo_model, gpus=[0, 1], backend="cpu", ctx=1024, llama_dir=str(llama_bins.bin_dir),
                               budget_s=600, per_candidate_s=1, settings=False, progress=lines.append)
        argv = [str(demo_model), "--backend", "cpu", "--gpus", "0,1", "--ctx", "1024", "--threads", "1",
                "--llama-dir", str(llama_bins.bin_dir)]
        yield {"root": root, "result": result, "lines": lines, "argv": argv, "model": demo_model,
               "bins": llama_bins}


def test_api_tune_returns_the_pick_and_a_rerun_reuses_every_result(tuned: dict[str, Any]) -> None:
    result = tuned["result"]
    assert isinstance(result, arcsplit.TuneResult) and result.reused == 0 and result.wall_s > 0
    assert {c.status for c in result.candidates} <= {"ok", "pruned"}, result.to_dict()
    assert result.pick is not None and result.pick.status == "ok" and result.pick in result.candidates
    assert result.default is not None and result.default.key == "cpu:rpc:defaults"
    assert result.pick.decode and result.pick.decode >= (result.default.decode or 0)
    assert any("starting" in line for line in tuned["lines"])  # the progress callback heard each step
    assert list((tuned["root"] / "tune").glob("*.json"))

    heard: list[str] = []
    again = arcsplit.tune(tuned["model"], gpus=[0, 1], backend="cpu", ctx=1024,
                          llama_dir=str(tuned["bins"].bin_dir), budget_s=600, per_candidate_s=1, settings=False,
                          progress=heard.append)
    assert again.reused == len(again.candidates) and again.pick == result.pick
    assert not any("starting" in line for line in heard)  # nothing was started: every result came from the cache


@contextlib.contextmanager
def serving(tuned: dict[str, Any], *flags: str) -> Iterator[dict[str, Any]]:
    """``arcsplit serve`` of the tuned rig (with ``flags``), ready, its bus up; stopped on exit."""
    port, mport = free_port(), free_port()
    err = tuned["root"] / f"serve-{port}.err"
    with err.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", *tuned["argv"], "--port", str(port),
                                 "--metrics-port", str(mport), *flags], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=sink, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving" in line, err.read_text()[-2000:]
        with attach() as client:
            yield {"status": client.status(), "said": err.read_text(), "metrics": f"http://127.0.0.1:{mport}/metrics"}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def _ps(*flags: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "arcsplit", "ps", *flags], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def _dashboard_plan() -> tuple[str, str]:
    """The header and the plan panel (key 4) of a real dashboard (Textual's pilot) on the running instance."""
    got: dict[str, str] = {}

    async def main() -> None:
        feed = Feed(attach())
        try:
            app = DashApp(feed)
            async with app.run_test(size=(120, 40)) as pilot:
                await until(pilot, lambda: app.state.connected and app.state.status.get("state") == "ready")
                await pilot.press("4")
                await pilot.pause(0.2)
                got["header"] = str(app.query_one("#header").render())
                got["plan"] = str(app.query_one("#planview").render())
        finally:
            feed.close()

    asyncio.run(main())
    return got["header"], got["plan"]


def test_serve_runs_the_pick_and_every_surface_says_it_was_tuned(tuned: dict[str, Any]) -> None:
    pick = tuned["result"].pick
    with serving(tuned) as run:
        assert "using the tuned route" in run["said"]
        # "mode hybrid: route: ...", "mode single: route: cpu single-1card ...": whichever mode the pick runs
        assert re.search(rf"mode \S+: route: {re.escape(pick.label)}, chosen by arcsplit tune", run["said"]), run["said"]
        assert "forced by --mode" not in run["said"]  # the user typed no --mode
        choice = run["status"]["choice"]
        assert choice["by"] == "tune" and choice["label"] == pick.label and choice["objective"] == "decode"
        assert (choice["decode"], choice["prefill"], choice["streams"]) == (pick.decode, pick.prefill, pick.streams)
        assert choice["tuned_at"] and run["status"]["mode"] == choice["mode"]
        assert {a["key"] for a in choice["alternatives"]} == {c.key for c in tuned["result"].candidates}

        (row,) = json.loads(_ps("--json").stdout)["runs"]
        assert row["choice"] == choice  # arcsplit ps --json: the same record
        text = _ps().stdout
        assert f"route: {pick.label}, chosen by arcsplit tune (decode" in text and f"decode {pick.decode:.1f}" in text
        state_file = Path(run["status"]["run_dir"]) / "state.json"
        assert json.loads(state_file.read_text())["choice"] == choice  # what `arcsplit report` bundles

        header, plan = _dashboard_plan()
        assert "tuned" in header
        assert "chosen by arcsplit tune" in plan and f"decode {pick.decode:.1f}" in plan
        assert all(c.label in plan for c in tuned["result"].candidates)  # the alternatives measured

        samples = scrape(run["metrics"])
        assert value(samples, "arcsplit_route_info", chosen_by="tune", mode=choice["mode"], label=pick.label,
                     objective="decode", note="") == 1
        assert value(samples, "arcsplit_route_tuned_tokens_per_second", figure="decode") == pick.decode


def test_plan_says_the_route_came_from_tune(tuned: dict[str, Any]) -> None:
    """`plan` without --mode after a tune: the mode line names tune (RouteChoice.line), as serve and ps do."""
    pick = tuned["result"].pick
    out = subprocess.run([sys.executable, "-m", "arcsplit", "plan", *tuned["argv"]], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    (mode_line,) = [line for line in out.stdout.splitlines() if line.startswith("mode ")]
    assert re.match(rf"mode \S+: route: {re.escape(pick.label)}, chosen by arcsplit tune \(decode", mode_line), mode_line
    assert "forced by --mode" not in out.stdout
    rows = out.stdout.splitlines()  # the tuned table: the default order's route marked, the second round's column
    assert any("2nd decode" in row for row in rows) and any(row.startswith(("*d ", " d ")) for row in rows), rows
    forced = subprocess.run([sys.executable, "-m", "arcsplit", "plan", *tuned["argv"], "--mode", "hybrid"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert "mode hybrid: forced by --mode hybrid" in forced.stdout, forced.stdout  # the user's own --mode


@pytest.mark.parametrize("flags, line", [(("--mode", "rpc"), "route: rpc, as asked (--mode rpc; not tuned)"),
                                         (("--no-tune",), "by the default order (not tuned)")])
def test_serve_untuned_says_so(tuned: dict[str, Any], flags: tuple[str, ...], line: str) -> None:
    with serving(tuned, *flags) as run:
        assert "using the tuned route" not in run["said"]
        assert run["status"]["choice"]["by"] in ("asked", "default") and not run["status"]["choice"]["alternatives"]
        assert line in _ps().stdout
        header, plan = _dashboard_plan()
        assert "tuned" not in header and line in plan
