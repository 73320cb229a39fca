"""systemd: the notify protocol against a real AF_UNIX datagram socket (path and abstract), `arcsplit unit`
output checked by systemd's own `systemd-analyze verify` where it exists, and a real `arcsplit serve` under a
notify socket: READY=1 only once /health answers 200, WATCHDOG=1 while ready, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from arcsplit.cli import main
from arcsplit.cli.unit import quote, render_unit
from arcsplit.proc.ports import free_port
from arcsplit.run.systemd import notify, watchdog_interval


def datagram_socket(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(5)
    return s


def test_notify_sends_one_datagram_to_a_path_socket(tmp_path):
    path = str(tmp_path / "notify")
    with datagram_socket(path) as s:
        assert notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": path})
        assert s.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_reaches_an_abstract_socket():
    name = f"arcsplit-test-{os.getpid()}"
    with datagram_socket("\0" + name) as s:
        assert notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"WATCHDOG=1"


def test_notify_without_systemd_or_with_a_gone_socket_sends_nothing_and_never_raises(tmp_path):
    assert notify("READY=1", {}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_us():
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def unit_fields(text: str) -> dict[str, list[str]]:
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields.setdefault(key, []).append(value)
    return fields


def test_unit_runs_the_given_command_as_a_notify_service(tmp_path):
    command = ["serve", "my model.gguf", "--gpus", "0,1", "--backend", "sycl", "--", "--alias", "50%$off"]
    text = render_unit(command, str(tmp_path), {"ARCSPLIT_CACHE_DIR": "/srv/cache", "HOME": "/root"})
    f = unit_fields(text)
    assert f["Type"] == ["notify"] and f["NotifyAccess"] == ["main"] and f["KillMode"] == ["mixed"]
    assert "WatchdogSec" in f and "TimeoutStartSec" in f
    # systemd unescapes %% and $$; after that the words are the command as typed
    words = shlex.split(f["ExecStart"][0].replace("%%", "%").replace("$$", "$"))
    assert words[-len(command):] == command and Path(words[0]).name in ("arcsplit", Path(sys.executable).name)
    assert f["WorkingDirectory"] == [str(tmp_path)]
    assert "ARCSPLIT_CACHE_DIR=/srv/cache" in f["Environment"] and not any("HOME" in e for e in f["Environment"])
    assert quote("a b") == '"a b"' and quote("x%y") == "x%%y"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_analyze_accepts_the_unit(tmp_path):
    unit = tmp_path / "arcsplit.service"
    unit.write_text(render_unit(["serve", "model.gguf", "--gpus", "0,1"], str(tmp_path), {}))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True)
    complaints = [line for line in r.stderr.splitlines() if str(unit) in line and "ExecStart" not in line]
    assert not complaints, r.stderr


@pytest.mark.parametrize("argv, fix", [
    (["unit"], "arcsplit unit serve"),
    (["unit", "serve", "m.gguf", "--", "--api-key", "sk-123"], "EnvironmentFile"),
    (["unit", "serve", "m.gguf", "--tui"], "arcsplit dash"),
])
def test_unit_refuses_what_a_unit_cannot_hold(argv, fix, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fix in err and err.count("\n") == 1 and "sk-123" not in err


@pytest.mark.slow
def test_serve_tells_systemd_ready_after_health_then_pings_and_stops(tmp_path, llama_bins, demo_model):
    path = str(tmp_path / "notify")
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "ARCSPLIT_LLAMA_DIR":
           str(llama_bins.bin_dir), "ARCSPLIT_STATE_DIR": str(tmp_path / "state"),
           "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt")}
    with datagram_socket(path) as s:
        proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu",
                                 "--gpus", "0,1", "--ctx", "1024", "--threads", "1", "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            s.settimeout(120)
            got = []
            while not any(m.startswith("READY=1") for m in got):
                got.append(s.recv(4096).decode())
            # READY=1 only after the server answers: the health check at that moment is 200
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            s.settimeout(5)
            pings = [s.recv(4096).decode() for _ in range(3)]  # every 0.5 s; each within the 5 s timeout
            assert pings == ["WATCHDOG=1"] * 3
            proc.send_signal(signal.SIGTERM)
            rest = []
            while not any(m.startswith("STOPPING=1") for m in rest):
                rest.append(s.recv(4096).decode())
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("argv, words", [
    (["/nonexistent.gguf", "--gpus", "0,1"], ["/nonexistent.gguf", "does not exist"]),
    (["{text}", "--gpus", "0,1", "--backend", "cpu"], ["not a GGUF"]),
    (["{model}", "--backend", "cpu", "--gpus", "0,0"], ["twice"]),
    (["{model}", "--layout", "3x-imaginary"], ["3x-imaginary", "arcsplit layouts"]),
    (["{model}", "--backend", "cpu", "--gpus", "0,1", "--cpu-memory", "5"], ["short by"]),
    (["{model}", "--backend", "cpu", "--gpus", "0,1", "--max-restarts", "-1"], ["--max-restarts"]),
])
def test_unit_checks_the_command_as_serve_would_and_writes_nothing(argv, words, demo_model, tmp_path, capsys):
    """`unit serve /nonexistent.gguf --gpus 0,1` wrote a unit and exited 0: a service that could never start."""
    (tmp_path / "text.gguf").write_text("not a model\n")
    argv = [a.replace("{model}", str(demo_model)).replace("{text}", str(tmp_path / "text.gguf")) for a in argv]
    assert main(["unit", "serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert all(w in err for w in words), err


def test_unit_for_a_good_command_is_written(demo_model, capsys):
    assert main(["unit", "serve", str(demo_model), "--backend", "cpu", "--gpus", "0,1", "--cpu-memory", "1024"]) == 0
    assert "ExecStart=" in capsys.readouterr().out
