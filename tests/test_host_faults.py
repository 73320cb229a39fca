"""Issue 43: the defects a fault run across two hosts found, each through the real code path (real processes; a
network namespace with its own sshd where a second host is needed, tests/_netns.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from arcsplit.errors import HostError
from arcsplit.proc.wire import PROTO
from arcsplit.rig import Host
from arcsplit.run.remote import NodeSession

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

sys.path.insert(0, str(Path(__file__).parent))


# ---- 1: a transport that dies at once ends every pending request with its reason ---------------------------------

def test_a_transport_that_exits_ends_every_waiting_request_at_once() -> None:
    """The agent's transport exits (its `arcsplit` missing there) while a request holds the session and a second
    waits its turn: both end with the exit's reason, neither waits out its timeout (the second used to install its
    reply event after the exit had set the first one, and waited the whole 60 s of a hello)."""
    dying = [sys.executable, "-c", "import sys, time; time.sleep(0.5); "
             "sys.stderr.write('sh: 1: /opt/nowhere/arcsplit: not found\\n'); sys.exit(127)"]

    async def main() -> list[str]:
        session = NodeSession(Host("b", "me@b"), dying)
        reasons: list[str] = []

        async def ask(op: str) -> None:
            try:
                await session.request({"op": op}, op, 30.0)
            except HostError as exc:
                reasons.append(str(exc))

        async with anyio.create_task_group() as tg:
            await session.spawn(tg)
            with anyio.fail_after(20):  # well under the requests' own 30 s: the fixed code answers in ~0.5 s
                async with anyio.create_task_group() as asks:
                    asks.start_soon(ask, "hello")
                    asks.start_soon(ask, "ports")
            await session.close(2.0)
        return reasons

    reasons = anyio.run(main)
    assert len(reasons) == 2
    for why in reasons:
        assert "node agent on b exited" in why and "not found" in why, why


# ---- 9: a protocol line with a field of the wrong type is answered as a protocol error ----------------------------

@pytest.mark.parametrize("msg, words", [
    ({"op": "ports", "n": "many"}, ["protocol error", "ports", "n = \"many\"", "not an integer"]),
    ({"op": "ports", "n": 1, "want": ["x"]}, ["protocol error", "want = [\"x\"]"]),
    ({"op": "stop", "name": "rpc0", "grace": "soon"}, ["protocol error", "grace = \"soon\""]),
    ({"op": "stop", "name": "rpc0", "grace": float("nan")}, ["protocol error", "grace = NaN"]),
    ({"op": "ports", "n": True}, ["protocol error", "n = true"]),
])
def test_a_field_of_the_wrong_type_is_a_protocol_error(tmp_path: Path, msg: dict, words: list[str]) -> None:
    """The agent answers a malformed field with an error naming the op and the field, not Python's "invalid
    literal for int()", and keeps serving: a ping after it is answered."""
    from _node_client import NodeClient

    agent = NodeClient([sys.executable, "-m", "arcsplit", "node", "--stdio"],
                       env={**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_BACKEND": "cpu",
                            "ARCSPLIT_LLAMA_DIR": str(tmp_path / "no-build")})
    try:
        agent.send(op="hello", run="r1", proto=PROTO)
        agent.wait("hello")
        agent.send(**msg)
        error = agent.wait("error")
        assert "invalid literal" not in error["message"]
        for w in words:
            assert w in error["message"], error
        agent.send(op="ping")
        agent.wait("pong")
    finally:
        agent.proc.kill()
        agent.proc.wait(10)


# ---- 6: ps and stop with a state folder this user cannot read -----------------------------------------------------

AS_NOBODY = """
import os, sys
from arcsplit.cli import main
os.environ["ARCSPLIT_STATE_DIR"] = sys.argv[2]
for cmd in (["ps"], ["stop"]):  # every module both commands import, loaded while the interpreter's tree is readable
    main(cmd)
os.environ["ARCSPLIT_STATE_DIR"] = sys.argv[1]
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # nobody, from here on
sys.stdout.write("---\\n"); sys.stdout.flush(); sys.stderr.write("---\\n"); sys.stderr.flush()
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user (nobody) needs root")
@pytest.mark.parametrize("command", [["ps"], ["ps", "--json"], ["stop"]])
def test_ps_and_stop_with_an_unreadable_state_folder_are_one_line(tmp_path: Path, command: list[str]) -> None:
    """A runs/ folder left by `sudo -E arcsplit serve` (root's, 0700), then `arcsplit ps` or `stop` as a user: one
    line naming the folder and the fix, exit 2, no traceback (it was a 32-line PermissionError)."""
    state = tmp_path / "state"
    (state / "runs" / "20261206-000000-1").mkdir(parents=True)
    state.chmod(0o755)
    (state / "runs").chmod(0o700)  # root's
    empty = tmp_path / "empty"
    empty.mkdir()
    tmp_path.chmod(0o755)
    r = subprocess.run([sys.executable, "-c", AS_NOBODY, str(state), str(empty), *command], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = [line for line in r.stderr.partition("---\n")[2].splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(err) == 1, r.stderr[-2000:]
    assert str(state / "runs") in err[0] and "ARCSPLIT_STATE_DIR" in err[0], err
    assert r.stdout.partition("---\n")[2] == ""


# ---- 2: report leaves out every other host's ssh destination, user and name ------------------------------------

def test_report_leaves_out_the_other_hosts_destinations_users_and_names(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A run dir as a two-host serve leaves it: state.json's hosts (an ssh:// destination with a user and port, a
    user@host one, and a bare alias), the plan's cards naming the hosts (the layout's), a link log with the ssh
    command line, the agent's lines in an rpc-server log. None of the destinations, users or machine names (or
    the short alias, in state.json) is in the bundle's files, and the README says so."""
    from arcsplit.report import collect

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "state" / "runs" / "20261206-000000-1"
    run.mkdir(parents=True)
    state = {"mode": "rpc", "processes": [],
             "plan": {"cards": [{"host": ""}, {"host": "gpu-box-b"}, {"host": "gpu-box-c"}]},
             "hosts": {"gpu-box-b": {"ssh": "ssh://alice-ops@gpu-box-b.lab.example:2222", "arcsplit": "0.1.0"},
                       "gpu-box-c": {"ssh": "carol-admin@10.9.8.7", "arcsplit": "0.1.0"},
                       "d": {"ssh": "d", "arcsplit": "0.1.0"}}}
    (run / "state.json").write_text(json.dumps(state))
    (run / "link-gpu-box-b.log").write_text(
        "=== 2026-12-06 00:00:00 start ssh -o BatchMode=yes -N -L 127.0.0.1:5001:127.0.0.1:5001 "
        "ssh://alice-ops@gpu-box-b.lab.example:2222\nssh: connect to host gpu-box-b.lab.example port 2222\n")
    (run / "rpc-gpu-box-c-0.log").write_text("[gpu-box-c] node agent on gpu-box-c exited: carol-admin@10.9.8.7: "
                                             "Permission denied (publickey)\n")
    files = collect(None, None, None, environ={"HOME": str(tmp_path)})
    blob = "\n".join(files.values())
    for planted in ("alice-ops", "gpu-box-b", "lab.example", "carol-admin", "10.9.8.7", "gpu-box-c"):
        assert planted not in blob, (planted, [n for n, t in files.items() if planted in t])
    hosts = json.loads(files["run/20261206-000000-1/state.json"])["hosts"]
    assert {h["ssh"] for h in hosts.values()} == {"<host>"}
    assert "ssh destinations" in files["README.txt"]


# ---- 7, 9: a run refused for its layout or flags logs in to no host --------------------------------------------

HOSTS_LAYOUT = """
[[hosts]]
name = "b"
ssh = "ssh://me@127.0.0.1:{port}"
{extra}
[[cards]]
backend = "cpu"
memory_mib = 1024
[[cards]]
backend = "cpu"
host = "b"
memory_mib = 1024
"""
UNUSED_HOST = '[[hosts]]\nname = "c"\nssh = "ssh://me@127.0.0.1:{port}"\n'


@pytest.mark.parametrize("case, extra, flags, words", [
    ("model-missing", "", ["{dir}/missing.gguf"], ["missing.gguf", "does not exist"]),
    ("bad-flag-value", "", ["{model}", "--ctx", "lots"], ["--ctx"]),
    ("negative-max-restarts", "", ["{model}", "--max-restarts=-1"], ["--max-restarts"]),
    ("metrics-port-is-port", "", ["{model}", "--port", "8093", "--metrics-port", "8093"], ["--metrics-port"]),
    ("host-no-card-uses", UNUSED_HOST, ["{model}"], ["host 'c'", "has no card"]),
])
def test_a_refused_serve_logs_in_to_no_host(tmp_path: Path, case: str, extra: str, flags: list[str],
                                           words: list[str]) -> None:
    """Each host's "sshd" is a loopback listener that counts connections: serve refuses the run (one line, exit 2)
    before any ssh connects, where it used to start every [[hosts]] entry's session first."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    layout = tmp_path / "layout.toml"
    layout.write_text(HOSTS_LAYOUT.format(port=port, extra=extra.format(port=port)))
    argv = [a.replace("{model}", str(model)).replace("{dir}", str(tmp_path)) for a in flags]
    env = {**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt")}
    try:
        r = subprocess.run([sys.executable, "-m", "arcsplit", "serve", *argv, "--layout", str(layout)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        for w in words:
            assert w in lines[0], lines
        with pytest.raises(TimeoutError):  # the socket module's timeout: nothing connected
            conn, _ = listener.accept()
            conn.close()
    finally:
        listener.close()


# ---- issue 43: another local user's listener on an rpc-server's port -------------------------------------------

SQUATTER = r"""
import os, select, socket, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
held, seen = {}, set()
while time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in seen:
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid != parent or not argv[0].endswith(b"rpc-server") or b"-p" not in argv:
            continue  # only the rpc-servers of the serve under test
        seen.add(pid)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", int(argv[argv.index(b"-p") + 1])))
            s.listen(16)
            held[s] = s.getsockname()[1]
            print("took", held[s], flush=True)
        except OSError:
            s.close()
    for s in select.select(list(held), [], [], 0)[0]:
        conn, _ = s.accept()
        conn.settimeout(0.5)
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        print("data" if data else "probe", held[s], flush=True)  # data: a client spoke to it (llama-server)
        conn.close()
    time.sleep(0.002)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not shutil.which("setpriv"),
                    reason="needs root to run a squatter as nobody (setpriv) with the system python")
def test_another_users_listener_on_an_rpc_port_never_gets_llama_servers_connection(tmp_path: Path, demo_model: Path,
                                                                                   llama_bins: Any) -> None:
    """A program of another user (nobody) reads each starting rpc-server's `-p PORT` from /proc and binds it first.
    The rpc-server then cannot bind and exits (its start fails, the group tries again on fresh ports); what must
    never happen is llama-server connecting to that program, which the readiness probe alone allowed (measured
    before the fix: it spoke to the squatter after 2 of 9 squats). Ready now means the rpc-server's own process
    holds the listening socket."""
    env = {**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt"),
           "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    serve = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--gpus", "0,1", "--mode",
                              "rpc", "--ctx", "512", "--threads", "1", "--port", str(_free_port()), "--max-restarts",
                              "50"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    squatter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 "-c", SQUATTER, str(serve.pid), "90"], stdout=subprocess.PIPE, text=True,
                                cwd="/", env={"PATH": "/usr/bin:/bin"})
    try:
        out, _ = squatter.communicate(timeout=150)
    finally:
        squatter.kill()
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
    took = [line for line in out.splitlines() if line.startswith("took")]
    if not took:
        pytest.skip("the squatter never bound a port first on this machine: the window was not exercised")
    assert not [line for line in out.splitlines() if line.startswith("data")], out
