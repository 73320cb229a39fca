"""The runs that have ended, as `ps --all` and `logs` read them from their run directories (proc/rundir.py):
how each ended, the newest first, a run id's prefix, and a long log read from its end only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from arcsplit.cli import main
from arcsplit.errors import BadInput
from arcsplit.proc.rundir import find_record, read_record, run_records, supervisor_identity, tail_lines


def _run(root: Path, run_id: str, **state: object) -> Path:
    d = root / run_id
    d.mkdir(parents=True)
    base = {"supervisor": {"pid": 999_999_999, "create_time": 1.0}, "started": 100.0, "url": "http://127.0.0.1:1",
            "mode": "rpc", "group": "ready", "processes": [], "plan": {"model": "/m/demo.gguf"}}
    (d / "state.json").write_text(json.dumps({**base, **state}))
    return d


def test_how_each_run_ended(tmp_path):
    stopped = read_record(_run(tmp_path, "a", group="stopped", ended=200.0))
    killed = read_record(_run(tmp_path, "b", group="ready", swept=300.0))  # supervisor gone, no end written
    here = read_record(_run(tmp_path, "c", supervisor=supervisor_identity(), group="ready"))
    assert stopped and (stopped.state, stopped.ended, stopped.model, stopped.running) == ("stopped", 200.0,
                                                                                            "/m/demo.gguf", False)
    assert killed and (killed.state, killed.ended) == ("died", None)
    assert here and (here.state, here.running) == ("ready", True)
    (tmp_path / "d").mkdir()  # no state.json: not a run to list
    assert read_record(tmp_path / "d") is None


def test_newest_first_and_prefixes(tmp_path):
    _run(tmp_path, "20250101-120000-7", started=1.0, ended=2.0)
    _run(tmp_path, "20250102-120000-8", started=3.0, ended=4.0)
    assert [r.run_id for r in run_records(tmp_path)] == ["20250102-120000-8", "20250101-120000-7"]
    found = find_record(None, tmp_path)
    assert found and found.run_id == "20250102-120000-8"
    found = find_record("20250101", tmp_path)
    assert found and found.run_id == "20250101-120000-7"
    assert find_record("2026", tmp_path) is None
    with pytest.raises(BadInput, match="matches 2 runs"):
        find_record("2025", tmp_path)


def test_tail_reads_the_end_of_a_long_log_only(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    got = tail_lines(log, 0, window=4096)
    assert got[-1] == "line 99999" and len(got) < 600
    assert got[0].startswith("line ") and int(got[0].split()[1]) == 99999 - len(got) + 1  # no cut first line
    assert tail_lines(log, 3) == ["line 99997", "line 99998", "line 99999"]


def test_ps_all_and_logs_of_an_ended_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))
    d = _run(tmp_path / "runs", "20250101-120000-7", group="stopped", ended=time.time(),
             last_error="rpc1 exited with signal 9 (killed)")
    (d / "rpc0.log").write_text("=== start rpc\nStarting RPC server\n")
    (d / "server.log").write_text("=== start server\nmain: model loaded\n")
    assert main(["ps"]) == 0
    assert "20250101-120000-7" not in capsys.readouterr().out  # only running instances without --all
    assert main(["ps", "--all"]) == 0
    out = capsys.readouterr().out
    assert "20250101-120000-7" in out and "stopped" in out and "/m/demo.gguf" in out
    assert "  last error: rpc1 exited with signal 9 (killed)" in out  # what went wrong, as ps says it of a running one
    assert main(["logs", "20250101"]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines() == ["[rpc0] === start rpc", "[rpc0] Starting RPC server",
                                    "[server] === start server", "[server] main: model loaded"]
    assert "ended" in got.err and str(d) in got.err
    assert main(["logs", "-p", "server", "-n", "1"]) == 0
    assert capsys.readouterr().out == "main: model loaded\n"
