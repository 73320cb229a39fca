"""Issue 43: the defects a fault run across two hosts found, each through the real code path (real processes; a
network namespace with its own sshd where a second host is needed, tests/_netns.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from arcsplit.errors import HostError
from arcsplit.proc.wire import PROTO
from arcsplit.rig import Host
from arcsplit.run.remote import NodeSession

ROOT = Path(__file__).resolve().parents[1]
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
    ({"op": "ports", "n": 1, "want": ["x"]}, ["protocol error", "want = \"x\""]),
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
