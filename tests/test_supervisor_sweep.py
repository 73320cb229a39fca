"""The start-up sweep: leftovers of a dead supervisor die; a live supervisor's children and reused pids do not."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from arcsplit.proc.rundir import sweep


def _entry(p: subprocess.Popen, argv: list[str], create_time: float | None = None) -> dict:
    return {"name": "rpc0", "pid": p.pid, "pgid": p.pid, "port": 1,
            "create_time": create_time if create_time is not None else psutil.Process(p.pid).create_time(),
            "argv": argv}


def _write(root, run, supervisor: dict, procs: list[dict]) -> None:
    d = root / run
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"supervisor": supervisor, "processes": procs}))


def test_sweep_kills_only_what_matches_pid_create_time_and_cmdline(tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    leftover, reused, owned = (subprocess.Popen(argv) for _ in range(3))
    try:
        dead_supervisor = {"pid": 2 ** 22 + 12345, "create_time": 1.0}
        me = psutil.Process()
        _write(tmp_path, "dead", dead_supervisor, [
            _entry(leftover, argv),
            _entry(reused, argv, create_time=psutil.Process(reused.pid).create_time() - 100),  # pid reused
        ])
        _write(tmp_path, "live", {"pid": me.pid, "create_time": me.create_time()}, [_entry(owned, argv)])
        killed = sweep(tmp_path, grace=5)
        assert killed == [leftover.pid]
        assert leftover.wait(5) is not None
        assert reused.poll() is None and owned.poll() is None
        assert json.loads((tmp_path / "dead" / "state.json").read_text())["processes"] == []
    finally:
        for p in (leftover, reused, owned):
            p.kill()
            p.wait()


def test_two_instances_of_one_process_in_one_second_get_their_own_run_dirs(tmp_path, monkeypatch):
    # the Python API may serve twice at once from one process: one run dir (and bus.json) each
    from arcsplit.proc.rundir import RunDir

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path))
    monkeypatch.setattr("arcsplit.proc.rundir.new_run_id", lambda: "20261201-000000-42")
    dirs = [RunDir.create().path for _ in range(3)]
    assert [d.name for d in dirs] == ["20261201-000000-42", "20261201-000000-42-2", "20261201-000000-42-3"]
    assert RunDir.create("20261201-000000-42").path == dirs[0]  # a run id given by the caller is reused


def test_a_clock_step_leaves_a_live_run_alive_and_its_children_unswept(tmp_path):
    """psutil's create_time is the start since boot plus the boot time as the wall clock gives it now: a step of
    the clock (NTP, a virtual machine resumed) moves it. What a run recorded before the step must still name the
    same live processes: the bus lists the run, the sweep leaves it alone; a dead run's leftover still goes."""
    from arcsplit.run.bus import BusInfo
    from arcsplit.proc.rundir import since_boot, supervisor_identity

    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    owned, leftover = (subprocess.Popen(argv) for _ in range(2))
    try:
        me = supervisor_identity()
        step = 2.5  # the recorded wall times are off by this much after the step
        stepped = {**me, "create_time": me["create_time"] - step}
        _write(tmp_path, "live", stepped, [{**_entry(owned, argv, psutil.Process(owned.pid).create_time() - step),
                                             "since_boot": since_boot(owned.pid)}])
        _write(tmp_path, "dead", {"pid": 2 ** 22 + 1, "create_time": 1.0, "since_boot": 1.0},
               [{**_entry(leftover, argv, psutil.Process(leftover.pid).create_time() - step),
                 "since_boot": since_boot(leftover.pid)}])
        assert sweep(tmp_path, grace=5) == [leftover.pid]
        assert owned.poll() is None and leftover.wait(5) is not None
        info = BusInfo(run_id="r", run_dir=str(tmp_path), pub="", ctl="", pid=me["pid"],
                       create_time=stepped["create_time"], started=0.0, since_boot=me["since_boot"])
        assert info.alive()
        # a file from before since_boot was recorded falls back to the wall clock, as it did
        old = BusInfo(run_id="r", run_dir=str(tmp_path), pub="", ctl="", pid=me["pid"],
                      create_time=me["create_time"], started=0.0)
        assert old.alive() and not BusInfo(**{**old.__dict__, "create_time": me["create_time"] - step}).alive()
    finally:
        for p in (owned, leftover):
            p.kill()
            p.wait()
