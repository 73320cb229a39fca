"""Bad invocations of the real CLI: exit 2, one line on stderr that names the problem and the fix, no traceback,
and nothing left behind: no process, no state file listing processes, no temp file, no half-written output.

Each case runs `python -m arcsplit ...` as a subprocess with its own state, cache, runtime and temp dirs, so what
it leaves (or starts) can be found by those dirs alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a Python process (and a plan or a serve attempt) per case

# (id, argv with {model} {dir} {busy} placeholders, words the message must contain)
CASES = [
    ("unknown-flag", ["--bogus"], ["--bogus"]),
    ("unknown-command", ["frobnicate"], ["frobnicate"]),
    ("plan-unknown-flag", ["plan", "{model}", "--gpuz", "0"], ["--gpuz"]),
    ("missing-model-arg", ["plan"], ["model"]),
    ("gpus-empty-item", ["plan", "{model}", "--gpus", "0,,1"], ["--gpus", "0,1"]),
    ("gpus-not-numbers", ["plan", "{model}", "--gpus", "a,b"], ["--gpus"]),
    ("gpus-duplicate", ["plan", "{model}", "--gpus", "0,0"], ["twice"]),
    ("gpus-negative", ["plan", "{model}", "--gpus=-1"], ["negative"]),
    ("serve-cpu-card-missing", ["serve", "{model}", "--backend", "cpu", "--gpus", "9", "--port", "{free}"],
     ["no cpu card 9", "--gpus 0,1"]),
    ("devices-cpu-card-missing", ["devices", "--backend", "cpu", "--gpus", "0,2"], ["no cpu card 2"]),
    ("serve-gpus-duplicate", ["serve", "{model}", "--gpus", "1,1", "--port", "{free}"], ["twice"]),
    ("ctx-negative", ["plan", "{model}", "--ctx", "-5"], ["--ctx", "positive"]),
    ("ctx-junk", ["plan", "{model}", "--ctx", "lots"], ["--ctx"]),
    ("serve-ctx-negative", ["serve", "{model}", "--ctx", "-5", "--port", "{free}"], ["--ctx", "positive"]),
    ("np-zero", ["plan", "{model}", "--np", "0"], ["--np"]),
    ("cpu-memory-zero", ["plan", "{model}", "--cpu-memory", "0"], ["--cpu-memory"]),
    ("backend-unknown", ["plan", "{model}", "--backend", "quantum"], ["quantum"]),
    ("model-missing", ["plan", "{dir}/nope.gguf"], ["does not exist"]),
    ("model-dangling-link", ["plan", "{dir}/dangling.gguf"], ["does not exist"]),
    ("model-is-directory", ["plan", "{dir}/adir"], ["directory"]),
    ("model-is-fifo", ["plan", "{dir}/fifo.gguf"], ["not a regular file"]),
    ("model-not-gguf", ["plan", "{dir}/text.gguf"], ["not a GGUF"]),
    ("model-empty", ["plan", "{dir}/empty.gguf"], ["not a GGUF"]),
    ("model-truncated", ["plan", "{dir}/trunc.gguf"], ["trunc.gguf"]),
    ("layout-bad-toml", ["plan", "{model}", "--layout", "{dir}/bad.toml"], ["not valid TOML"]),
    ("layout-is-directory", ["plan", "{model}", "--layout", "{dir}/adir"], ["directory"]),
    ("layout-missing", ["plan", "{model}", "--layout", "{dir}/missing.toml"], ["does not exist"]),
    ("layout-is-fifo", ["plan", "{model}", "--layout", "{dir}/fifo.toml"], ["not a regular file"]),
    ("layout-no-cards", ["plan", "{model}", "--layout", "{dir}/nocards.toml"], ["[[cards]]"]),
    ("layout-negative-memory", ["plan", "{model}", "--layout", "{dir}/negmem.toml"], ["memory_mib"]),
    ("layout-unknown-backend", ["plan", "{model}", "--layout", "{dir}/badbackend.toml"], ["quantum"]),
    ("layout-and-gpus", ["plan", "{model}", "--layout", "{dir}/good.toml", "--gpus", "0"], ["--layout", "--gpus"]),
    ("serve-layout-and-gpus", ["serve", "{model}", "--layout", "{dir}/good.toml", "--gpus", "0", "--port", "{free}"],
     ["--layout", "--gpus"]),
    ("node-without-stdio", ["node"], ["--stdio"]),
    ("node-allow-bind-any", ["node", "--stdio", "--allow-bind", "0.0.0.0"], ["every interface", "one LAN/VPN"]),
    # issue 43: addresses parsed as addresses, names resolved once; the heartbeat a positive finite number
    ("node-allow-bind-zero", ["node", "--stdio", "--allow-bind", "0"], ["'0'", "every interface"]),
    ("node-allow-bind-mapped-any", ["node", "--stdio", "--allow-bind", "::ffff:0.0.0.0"], ["every interface"]),
    ("node-allow-bind-no-address", ["node", "--stdio", "--allow-bind", "no-such-host.invalid"],
     ["no-such-host.invalid", "no IP address"]),
    # the progress watchdog's bound: a duration of 5 s or more, 0 or off
    ("serve-hang-after-nan", ["serve", "{model}", "--hang-after", "nan", "--port", "{free}"], ["--hang-after"]),
    ("serve-hang-after-short", ["serve", "{model}", "--hang-after", "2s", "--port", "{free}"],
     ["--hang-after", "at least 5 s"]),
    ("serve-hang-after-junk", ["serve", "{model}", "--hang-after=-1m", "--port", "{free}"], ["--hang-after"]),
    ("node-heartbeat-nan", ["node", "--stdio", "--heartbeat", "nan"], ["--heartbeat"]),
    ("node-heartbeat-inf", ["node", "--stdio", "--heartbeat", "inf"], ["--heartbeat"]),
    ("node-heartbeat-zero", ["node", "--stdio", "--heartbeat", "0"], ["--heartbeat"]),
    ("node-heartbeat-negative", ["node", "--stdio", "--heartbeat=-1"], ["--heartbeat"]),
    # durations: plain seconds or 90s/5m/1h (arcsplit/durations.py); anything else names the flag and the units
    ("tune-budget-unknown-unit", ["tune", "{model}", "--budget", "5parsecs"], ["--budget", "5parsecs", "5m"]),
    ("tune-per-candidate-zero", ["tune", "{model}", "--per-candidate", "0s"], ["--per-candidate", "too short"]),
    ("serve-stall-timeout-junk", ["serve", "{model}", "--port", "{free}", "--stall-timeout", "soon"],
     ["--stall-timeout", "90s"]),
    ("serve-stop-grace-too-long", ["serve", "{model}", "--port", "{free}", "--stop-grace", "2h"],
     ["--stop-grace", "too long"]),
    ("stop-wait-negative", ["stop", "--wait=-5s"], ["--wait", "90s"]),
    ("doctor-timeout-unit", ["doctor", "--timeout", "3y"], ["--timeout", "90s"]),
    ("save-to-directory", ["plan", "{model}", "--gpus", "0,1", "--save", "{dir}/adir"], ["adir"]),
    ("save-to-missing-dir", ["plan", "{model}", "--gpus", "0,1", "--save", "{dir}/no/such/x.toml"], ["cannot write"]),
    ("does-not-fit", ["plan", "{model}", "--gpus", "0,1", "--cpu-memory", "5"], ["short by"]),
    ("serve-port-out-of-range", ["serve", "{model}", "--port", "70000"], ["--port"]),
    ("serve-port-taken", ["serve", "{model}", "--gpus", "0,1", "--port", "{busy}"], ["already in use", "--port"]),
    # before the demo builds llama.cpp or installs its model (an empty cache here): the taken port is the only line
    ("demo-port-taken", ["demo", "--port", "{busy}"], ["already in use", "--port"]),
    ("demo-metrics-port-taken", ["demo", "--port", "{free}", "--metrics-port", "{busy}"],
     ["already in use", "--metrics-port"]),
    ("serve-rpc-ports-junk", ["serve", "{model}", "--port", "{free}", "--rpc-ports", "1,x"], ["--rpc-ports"]),
    ("serve-rpc-ports-count", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--rpc-ports", "{free2}"],
     ["2 ports"]),
    ("serve-rpc-port-taken", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--rpc-ports",
                              "{busy},{free2}"], ["already in use", "--rpc-ports"]),
    ("serve-threads-zero", ["serve", "{model}", "--port", "{free}", "--threads", "0"], ["--threads"]),
    ("serve-parallel-zero", ["serve", "{model}", "--port", "{free}", "--parallel", "0"], ["--parallel"]),
    ("serve-mode-multi-on-cpu", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--mode", "multi"],
     ["--mode multi"]),
    ("serve-llama-dir-missing", ["serve", "{model}", "--port", "{free}", "--llama-dir", "{dir}/nobuild"],
     ["--llama-dir"]),
    ("serve-rpc-host-not-here", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--rpc-host", "192.0.2.7"],
     ["--rpc-host"]),
    ("serve-host-unknown-name", ["serve", "{model}", "--port", "{free}", "--host", "no-such-host.invalid"],
     ["--host"]),
    ("serve-does-not-fit", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--cpu-memory", "5"],
     ["short by"]),
    # issue 43: a TCP bus whose PUB (PORT) or ROUTER (PORT+1) port is taken, or out of range
    ("serve-bus-port-taken", ["serve", "{model}", "--port", "{free}", "--bus", "tcp://127.0.0.1:{busy}"],
     ["already in use", "{busy}", "--bus"]),
    ("serve-bus-next-port-taken", ["serve", "{model}", "--port", "{free}", "--bus", "tcp://127.0.0.1:{busy-1}"],
     ["already in use", "{busy}", "--bus"]),
    ("serve-bus-port-out-of-range", ["serve", "{model}", "--port", "{free}", "--bus", "tcp://127.0.0.1:65535"],
     ["65535", "out of range"]),
    ("devices-bad-gpus", ["devices", "--gpus", "x"], ["--gpus"]),
    # llama-server's own arguments after --: checked against the build's --help before anything starts
    ("serve-extra-unknown-flag", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--", "--no-such-flag"],
     ["--no-such-flag", "--help"]),
    ("serve-extra-api-key-no-value", ["serve", "{model}", "--gpus", "0,1", "--port", "{free}", "--", "--api-key"],
     ["--api-key", "needs a value"]),
    ("plan-extra-unknown-flag", ["plan", "{model}", "--gpus", "0,1", "--", "--no-such-flag"], ["--no-such-flag"]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("badcli")
    (d / "adir").mkdir()
    os.mkfifo(d / "fifo.gguf")
    os.mkfifo(d / "fifo.toml")
    (d / "dangling.gguf").symlink_to(d / "gone" / "x.gguf")
    (d / "text.gguf").write_text("hello, this is not a model at all\n")
    (d / "empty.gguf").write_bytes(b"")
    (d / "bad.toml").write_text("not toml [[[\n")
    (d / "nocards.toml").write_text('[rig]\nname = "x"\n')
    (d / "negmem.toml").write_text('[[cards]]\nbackend = "cpu"\nindex = 0\nname = "a"\nmemory_mib = -5\n')
    (d / "badbackend.toml").write_text('[[cards]]\nbackend = "quantum"\nindex = 0\nname = "a"\nmemory_mib = 5\n')
    (d / "good.toml").write_text('[[cards]]\nbackend = "cpu"\nindex = 0\nname = "a"\nmemory_mib = 4096\n')
    return d


@pytest.fixture(scope="module")
def busy_port():
    """A port some other program holds, whose predecessor is free ({busy-1}: a bus whose PORT+1 is taken). Picked
    below Linux's ephemeral range (32768 up), so no port another case binds to 0 ever lands on its predecessor."""
    for port in range(21001, 30000, 7):
        with socket.socket() as below:
            try:
                below.bind(("127.0.0.1", port - 1))
            except OSError:
                continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        s.listen()
        yield port
        s.close()
        return
    pytest.skip("no pair of free ports below the ephemeral range on this machine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(marker: str) -> list[str]:
    """Live processes whose environment carries this case's private state dir."""
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.environ().get("ARCSPLIT_STATE_DIR") == marker and p.pid != os.getpid():
                found.append(f"{p.pid} {p.info['name']}")
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.parametrize("argv,words", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation(argv, words, files, busy_port, demo_model, llama_bins, tmp_path):
    subs = {"{model}": str(demo_model), "{dir}": str(files), "{busy}": str(busy_port), "{free}": str(_free_port()),
            "{free2}": str(_free_port()), "{busy-1}": str(busy_port - 1)}
    args = []
    for a in argv:
        for k, v in subs.items():
            a = a.replace(k, v)
        args.append(a)
    for name in ("state", "cache", "runtime", "tmp"):
        (tmp_path / name).mkdir()
    env = dict(os.environ, ARCSPLIT_STATE_DIR=str(tmp_path / "state"), ARCSPLIT_CACHE_DIR=str(tmp_path / "cache"),
               ARCSPLIT_RUNTIME_DIR=str(tmp_path / "runtime"), TMPDIR=str(tmp_path / "tmp"),
               ARCSPLIT_LLAMA_DIR=str(llama_bins.server.parent))
    before = set(files.rglob("*"))
    res = subprocess.run([sys.executable, "-m", "arcsplit", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    err_lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, f"exit {res.returncode}: {res.stderr[-1500:]}"
    assert "Traceback" not in res.stderr
    assert len(err_lines) == 1, res.stderr
    line = err_lines[0]
    assert line.startswith("arcsplit: ")
    problem, sep, fix = line.partition("; ")
    assert sep and fix.strip(), f"no fix named: {line}"
    for w in words:
        for k, v in subs.items():
            w = w.replace(k, v)
        assert w in line, f"{w!r} not in {line!r}"
    assert res.stdout == "", res.stdout
    # nothing left running or half-written
    assert _marked(str(tmp_path / "state")) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not any(p.suffix == ".tmp" for p in (tmp_path / "state").rglob("*"))
    assert not list((tmp_path / "state").rglob("state.json")), "a run dir was made for a run that never started"
    assert set(files.rglob("*")) == before, "a file was written next to the inputs"
