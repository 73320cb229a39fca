"""A member that prints a driver fault and dies (verbatim lines, tests/fixtures/faults): the supervisor names the
cause, counts it per card, reads only this generation's lines, and after the same card is lost twice `arcsplit ps`,
`doctor` and `report` name it with how to reset it. The members are the in-memory launcher's (a real rpc-server
cannot be made to lose a device here); test_metrics.py and test_serve.py kill real ones."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from textual.markup import escape

from arcsplit.cli import main
from arcsplit.cli.serve_run import _report
from arcsplit.decide.specs import ServeConfig
from arcsplit.llama.resets import XE_DOC
from arcsplit.planner import CardPlan, Plan, PlanOptions
from arcsplit.rig import Card
from arcsplit.route import Route
from arcsplit.run.bus import BusServer
from arcsplit.run.supervisor import RestartPolicy, Supervisor, Timeouts
from arcsplit.tui.state import DashState
from arcsplit.tui.widgets import render_plan

from _fake_launcher import FakeLauncher

G = 1 << 30
FAST = Timeouts(rpc_ready=1.0, stall=0.5, stop_grace=0.3, failed_grace=0.1, health_interval=0.05, health_failures=3)
LOST = (Path(__file__).parent / "fixtures" / "faults" / "sycl_device_lost_27198.log").read_text().splitlines()
UR_LINE = "level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)"


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))


def sycl_config() -> ServeConfig:
    """Two Arc cards on xe, one rpc-server each (mode rpc): rpc1 holds SYCL1 at 0000:04:00.0."""
    devices = Route.build("rpc", "sycl", [0, 1]).devices
    cards = tuple(CardPlan(Card("sycl", i, "Intel(R) Arc(TM) Pro B70 Graphics", 32 * G, 32 * G, pci=f"0000:0{i + 3}:00.0",
                                driver="xe"), d, 10 * i, 10 * (i + 1), 1, 1, 0, 1, has_output=i == 1)
                  for i, d in enumerate(devices))
    plan = Plan("/m.gguf", "llama", 19, 4096, PlanOptions(n_ctx=4096), cards)
    return ServeConfig(plan=plan, mode="rpc", backend="sycl", server_bin="/b/llama-server", rpc_bin="/b/rpc",
                       port=8080, cores=2)


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def test_a_lost_device_is_named_counted_per_card_and_twice_means_a_driver_reset(tmp_path, capsys):
    fake = FakeLauncher()
    events: list[Any] = []
    sup = Supervisor(sycl_config(), launcher=fake, policy=RestartPolicy(base_delay=0.01, max_delay=0.04),
                     timeouts=FAST, sweep_leftovers=False)

    async def collect() -> None:
        async with sup.subscribe(10_000) as stream:
            async for ev in stream:
                events.append(ev)

    async def next_generation(fault: list[str], rc: int) -> dict[str, Any]:
        gen = sup.status()["generation"]
        for line in fault:
            fake.members["rpc1"].line(line)
        fake.kill("rpc1", rc)
        await wait_for(lambda: sup.status()["generation"] == gen + 1 and sup.status()["state"] == "ready")
        return sup.status()

    def ps() -> str:
        assert main(["ps"]) == 0
        return capsys.readouterr().out

    async def run() -> str:
        async with sup, anyio.create_task_group() as tg:
            tg.start_soon(collect)
            assert sup.run_dir is not None
            await tg.start(BusServer(sup, sup.run_dir.path, sup.run_dir.path.name).run)
            st = await next_generation(LOST, -6)  # ggml-sycl aborts after the UR error
            assert st["last_error"] == f"rpc1 (SYCL1) lost its device: {UR_LINE}"
            assert st["last_error_lines"][0] == UR_LINE and len(st["last_error_lines"]) == 4
            assert st["causes"] == {"device_lost": 1} and st["card_faults"] == {"SYCL1": {"device_lost": 1}}
            assert st["resets"] == []  # once can be transient
            # the next crash prints nothing: its cause is its own, not the last generation's lines still in the ring
            st = await next_generation([], -9)
            assert st["last_error"] == "rpc1 (SYCL1) exited with signal 9 (killed)" and st["causes"]["exit"] == 1
            assert st["card_faults"] == {"SYCL1": {"device_lost": 1, "exit": 1}}
            st = await next_generation(LOST, -6)
            assert st["card_faults"]["SYCL1"]["device_lost"] == 2
            (reset,) = st["resets"]
            assert reset["card"] == "SYCL1" and "echo 0000:04:00.0 | sudo tee /sys/bus/pci/drivers/xe/unbind" in reset["line"]
            out = await anyio.to_thread.run_sync(ps)
            tg.cancel_scope.cancel()
        return out

    out = anyio.run(run)
    lines = out.splitlines()
    at = lines.index(f"  last error: rpc1 (SYCL1) lost its device: {UR_LINE}")
    assert lines[at + 1] == f"      {UR_LINE}" and "in function dev2dev_memcpy" in lines[at + 4]  # below, not "|"
    assert "  failures by card: SYCL1 device_lost x2, exit x1" in lines
    assert any(ln.startswith("  SYCL1 needs a driver reset (its device was lost 2 times in this run): on the xe")
               and XE_DOC in ln for ln in lines)

    failures = [e.data.to_dict() for e in events if e.kind == "failure"]
    assert [f["cause"] for f in failures] == ["device_lost", "exit", "device_lost"]
    assert failures[0]["card"] == "SYCL1" and failures[0]["lines"][0] == UR_LINE

    # the dashboard: the failure event gives the last error and its lines at once, status() the counts and resets
    dash = DashState()
    dash.set_status({k: v for k, v in sup.status().items() if k not in ("last_error", "last_error_lines")})
    dash.apply({"kind": "failure", "name": "group", "data": failures[-1]})
    plan = render_plan(dash).splitlines()
    at = plan.index(f"[$error]last error:[/] rpc1 (SYCL1) lost its device: {escape(UR_LINE)}")
    assert plan[at + 1] == f"    {escape(UR_LINE)}" and "failures by card: SYCL1 device_lost x2, exit x1" in plan
    assert any(line.startswith("SYCL1 needs a driver reset") for line in plan)

    # the serve terminal: the one line of the backoff, the log lines below it, the card to reset
    async def replay() -> None:
        async def stream() -> Any:
            for ev in events:
                yield ev
        await _report(stream(), sup, None, False)

    capsys.readouterr()
    anyio.run(replay)
    said = capsys.readouterr().err.splitlines()
    at = next(i for i, line in enumerate(said)
              if line.startswith(f"arcsplit: group failed (rpc1 (SYCL1) lost its device: {UR_LINE}); restarting in "))
    assert said[at + 1] == f"arcsplit:     {UR_LINE}" and "dev2dev_memcpy" in said[at + 4]
    assert any(line.startswith("arcsplit: note: SYCL1 needs a driver reset") for line in said)

    assert sup.run_dir is not None
    state = json.loads(sup.run_dir.state_file.read_text())
    assert state["resets"][0]["card"] == "SYCL1" and state["card_faults"]["SYCL1"] == {"device_lost": 2, "exit": 1}
    assert state["last_error_lines"][0] == UR_LINE

    # after the run: doctor and report read its state file
    assert main(["doctor", "--backend", "cpu", "--no-probe"]) == 0
    doctor = capsys.readouterr().out
    assert f"Cards that need a driver reset (arcsplit run {sup.run_dir.path.name})" in doctor
    assert "  SYCL1 needs a driver reset (its device was lost 2 times in this run)" in doctor and XE_DOC in doctor
    bundle = tmp_path / "r.tar.gz"
    assert main(["report", "-o", str(bundle), "--backend", "cpu"]) == 0
    assert "arcsplit: note: SYCL1 needs a driver reset" in capsys.readouterr().err
    with tarfile.open(bundle) as tar:
        name = next(n for n in tar.getnames() if n.endswith("/faults.txt"))
        text = io.TextIOWrapper(tar.extractfile(name) or io.BytesIO()).read()  # type: ignore[arg-type]
    assert f"last error: rpc1 (SYCL1) lost its device: {UR_LINE}" in text and "SYCL1 needs a driver reset" in text
