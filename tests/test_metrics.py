"""`arcsplit serve --metrics-port`: a real serve of the demo model on two CPU cards, scraped with httpx and
parsed with prometheus_client's own parser; the values are the ones the bus's status() reports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env  # noqa: E402

from arcsplit.cli import main  # noqa: E402
from arcsplit.run.bus import attach  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from arcsplit.telemetry.prometheus import render  # noqa: E402

def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_render_of_a_failing_group_names_states_and_the_failure():
    """The pure half on a status() as the supervisor writes it while backing off (no processes needed)."""
    status = {"state": "backoff", "mode": "rpc", "backend": "cpu", "url": "http://127.0.0.1:8080", "failures": 2,
              "generation": 3, "uptime": None, "last_error": 'rpc0 killed by SIGKILL: "oom"\nlast line',
              "processes": {"rpc0": {"state": "exited", "role": "rpc", "restarts": 2, "uptime": None},
                            "server": {"state": "paused", "role": "server", "restarts": 0, "uptime": 1.5}},
              "plan": {"model": "/m.gguf", "cards": [{"device": "RPC0", "bytes": {"total": 1234}}]}}
    m = parse(render(status, None))
    assert value(m, "arcsplit_group_ready") == 0 and value(m, "arcsplit_group_failures") == 2
    assert value(m, "arcsplit_group_state", arcsplit_group_state="backoff") == 1
    assert value(m, "arcsplit_process_up", process="rpc0", role="rpc") == 0
    assert value(m, "arcsplit_process_restarts_total", process="rpc0") == 2
    # a state the list does not know still shows
    assert value(m, "arcsplit_process_state", process="server", role="server", arcsplit_process_state="paused") == 1
    assert value(m, "arcsplit_last_failure_info", error=status["last_error"]) == 1
    assert value(m, "arcsplit_card_planned_bytes", card="0", device="RPC0") == 1234
    assert not any(name == "arcsplit_card_used_bytes" for name, _ in m)  # no telemetry sample yet


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_bins, demo_model) -> Iterator[dict[str, Any]]:
    with isolated_env(tmp_path_factory.mktemp("metrics"), llama_bins.bin_dir):
        port, mport = free_port(), free_port()
        proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu",
                                 "--gpus", "0,1", "--ctx", "1024", "--threads", "1", "--port", str(port),
                                 "--metrics-port", str(mport)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = proc.stdout.readline()
            assert "serving" in line, line
            yield {"proc": proc, "line": line, "metrics": f"http://127.0.0.1:{mport}/metrics"}
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)


@pytest.mark.slow
def test_metrics_url_is_printed_beside_the_served_url(served):
    assert served["line"].rstrip().endswith(f"arcsplit metrics {served['metrics']}")


@pytest.mark.slow
def test_scrape_matches_status(served):
    with attach() as client:
        deadline = time.monotonic() + 20
        while True:  # utilisation needs two telemetry samples (2 s apart) after the group is ready
            samples = scrape(served["metrics"])
            status = client.status()
            if ("arcsplit_card_utilisation_ratio", (("card", "1"), ("device", "RPC1"))) in samples:
                break
            assert time.monotonic() < deadline, sorted(samples)
            time.sleep(0.5)
    assert value(samples, "arcsplit_group_ready") == 1
    assert value(samples, "arcsplit_group_state", arcsplit_group_state="ready") == 1
    assert value(samples, "arcsplit_group_state", arcsplit_group_state="backoff") == 0
    assert value(samples, "arcsplit_info", mode=status["mode"], backend="cpu", url=status["url"],
                 model=status["plan"]["model"]) == 1
    assert value(samples, "arcsplit_group_uptime_seconds") == pytest.approx(status["uptime"], abs=3)
    for name, p in status["processes"].items():
        assert value(samples, "arcsplit_process_restarts_total", process=name) == p["restarts"]
        assert value(samples, "arcsplit_process_up", process=name, role=p["role"]) == 1
        assert value(samples, "arcsplit_process_state", process=name, role=p["role"],
                     arcsplit_process_state=p["state"]) == 1
    for i, card in enumerate(status["plan"]["cards"]):
        labels = {"card": str(i), "device": card["device"]}
        assert value(samples, "arcsplit_card_planned_bytes", **labels) == card["bytes"]["total"]
        assert value(samples, "arcsplit_card_total_bytes", **labels) == card["free"]
        # a CPU card's used memory is its rpc-server's resident memory (sampled up to 2 s ago, while it still moves)
        rss = psutil.Process(status["processes"][f"rpc{i}"]["pid"]).memory_info().rss
        assert value(samples, "arcsplit_card_used_bytes", **labels) == pytest.approx(rss, rel=0.5)
        assert 0 <= value(samples, "arcsplit_card_utilisation_ratio", **labels) <= 1


@pytest.mark.slow
def test_a_killed_rpc_server_shows_as_a_restart_and_the_last_failure(served, capsys):
    with attach() as client:
        before = client.status()
        os.kill(before["processes"]["rpc1"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            status = client.status()
            if status["state"] == "ready" and status["generation"] > before["generation"]:
                break
            assert time.monotonic() < deadline, status["state"]
            time.sleep(0.3)
    samples = scrape(served["metrics"])
    assert value(samples, "arcsplit_process_restarts_total", process="rpc1") == status["processes"]["rpc1"]["restarts"]
    assert status["processes"]["rpc1"]["restarts"] == before["processes"]["rpc1"]["restarts"] + 1
    assert value(samples, "arcsplit_group_starts_total") == status["generation"]
    failure = [labels for (name, labels) in samples if name == "arcsplit_last_failure_info"]
    assert failure and dict(failure[0])["error"] == "rpc1 (CPU1) exited with signal 9 (killed)"
    # the cause in words, counted per card, and `arcsplit ps` shows both (run/faults.py)
    assert status["last_error"] == "rpc1 (CPU1) exited with signal 9 (killed)" and status["last_error_lines"]
    assert status["card_faults"]["CPU1"]["exit"] >= 1 and status["resets"] == []
    assert main(["ps"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  last error: rpc1 (CPU1) exited with signal 9 (killed)" in out
    assert any(line.startswith("  failures by card: CPU1 exit x") for line in out), out


@pytest.mark.slow
def test_a_taken_metrics_port_is_one_line_and_exit_2(tmp_path, llama_bins, demo_model):
    with socket.socket() as s, isolated_env(tmp_path, llama_bins.bin_dir):
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        r = subprocess.run([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu",
                            "--gpus", "0,1", "--port", str(free_port()), "--metrics-port", str(taken)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--metrics-port" in r.stderr and "Traceback" not in r.stderr
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
