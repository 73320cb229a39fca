"""One filter for `arcsplit logs` and the dashboard's Logs tab (llama/logs.py QuietFilter): llama-server's -lv 4
trace lines, its load-progress state lines and the rpc-servers' per-connection lines are left out of both, and
arcsplit's own readiness check of an rpc-server makes none of those connections."""

from __future__ import annotations

from collections import deque

import anyio
import pytest

from arcsplit.llama.logs import QuietFilter
from arcsplit.proc.ports import free_port
from arcsplit.proc.spec import ProcessSpec
from arcsplit.roles import Role
from arcsplit.run.launch import LocalLauncher
from arcsplit.tui.state import DashState

from _fake_launcher import FakeLauncher
from test_supervisor_fake import supervisor

# Verbatim from a served demo (rpc mode, two CPU rpc-servers), in arrival order; True: hidden without --verbose.
LINES = [
    ("rpc0", "Starting RPC server v7.0.0", False),
    ("rpc0", "  endpoint       : 127.0.0.1:40077", False),
    ("rpc0", "Accepted client connection", True),
    ("rpc0", "RPC: shared-memory link (4 MiB each way)", True),
    ("rpc0", "Client connection closed", True),
    ("rpc1", "RPC: no shared-memory link (/dev/shm: No space left on device); TCP only", False),
    ("server", "0.00.064.395 W srv  llama_server: security: no API key is set and CORS allows all origins", False),
    ("server", "", True),
    ("server", 'cmd_child_to_router:state:{"state":"loading","payload":{"stages":["text_model"],"value":0.0}}', True),
    ("server", "0.00.064.865 I srv    load_model: loading model '/models/m.gguf'", False),
    ("server", "0.00.994.721 I load_tensors: RPC0[127.0.0.1:55815] model buffer size =    65.16 MiB", True),
    ("server", "0.01.244.678 I srv  update_slots: all slots are idle", True),
    ("server", "0.01.244.451 I srv  llama_server: model loaded", False),
]


def test_the_filter_on_verbatim_lines():
    quiet = QuietFilter()
    assert [(p, line, quiet.hides(p, line)) for p, line, _ in LINES] == LINES


@pytest.fixture
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))


def test_logs_and_the_dashboard_show_the_same_lines(_dirs):
    """The same lines through the supervisor's `logs` (what `arcsplit logs` prints) and through the dashboard's
    state (its Logs tab): the same lines are left, and --verbose keeps every one in both."""
    sup = supervisor(FakeLauncher())
    for name, line, _ in LINES:
        sup._rings.setdefault(name, deque()).append(line)
    by_logs = {f"[{name}] {line}" for name in sup._rings for line in sup.logs(name, 100, verbose=False)}
    dash = DashState()
    for name, line, _ in LINES:
        dash.apply({"kind": "log", "name": name, "data": {"line": line}})
    assert {f"[{name}] {line}" for name, line in dash.logs} == by_logs == \
        {f"[{name}] {line}" for name, line, hidden in LINES if not hidden}
    assert dash.log_total == len(LINES) and dash.log_hidden == sum(h for *_, h in LINES)
    verbose = DashState(verbose=True)
    for name, line, _ in LINES:
        verbose.apply({"kind": "log", "name": name, "data": {"line": line}})
    assert len(verbose.logs) == len(LINES) == len(sup.logs(None, 100, verbose=True))


@pytest.mark.slow  # a real rpc-server
def test_readiness_of_an_rpc_server_makes_no_connection(llama_bins):
    """The supervisor's local readiness check asks whether the rpc-server's own process listens; it never
    connects, so the rpc-server logs no connect/close of arcsplit's (only llama-server's own, later)."""
    port = free_port()
    spec = ProcessSpec(name="rpc0", role=Role.RPC, host="127.0.0.1", port=port, cards=(0,), env=(),
                       argv=(str(llama_bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"))
    ring: deque[str] = deque()

    async def main() -> None:
        launcher = LocalLauncher()
        member = launcher.member(spec, log_path=None, on_line=lambda m, line: None, on_exit=lambda m: None,
                                 ring=ring)
        async with anyio.create_task_group() as tg:
            await tg.start(member.run)
            try:
                with anyio.fail_after(30):
                    while not await launcher.accepts(spec):
                        await anyio.sleep(0.02)
                await anyio.sleep(0.5)  # a connection's lines would be in the ring by now
            finally:
                await member.stop(grace=5)

    anyio.run(main)
    assert any("Starting RPC server" in line for line in ring), list(ring)
    assert not [line for line in ring if "client connection" in line.lower()], list(ring)
