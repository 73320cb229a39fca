"""A one-context group that fails the way hybrid avoids falls back to hybrid: the NEO allocation failure and the
llama.cpp#28765 output copy. No Intel card here, so llama-server is a stand-in that replays a user's verbatim log
(tests/fixtures/runtime/SOURCES.md) and exits as llama.cpp does on a SYCL error (abort); the supervisor, its log
capture and its failure classification are the real ones."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal

from arcsplit.errors import RunError
from arcsplit.route import Route
from arcsplit.run.remote import launcher_for
from arcsplit.decide.specs import ServeConfig
from arcsplit.run.supervisor import RestartPolicy, Supervisor

from test_specs import make_plan

FX = Path(__file__).parent / "fixtures" / "runtime"


def replaying_server(tmp_path: Path, log: str) -> str:
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nimport os, sys\nsys.stdout.write(open({str(FX / log)!r}).read())\n"
                   "sys.stdout.flush()\nos.abort()\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


@pytest.mark.parametrize("log, kind", [("ur_exception_27063.log", "pinned_output"),
                                       ("multi_device_oom_22885.log", "alloc")])
def test_one_context_failure_hands_over_to_the_hybrid_fallback(tmp_path, log, kind):
    plan = make_plan("sycl", [0, 1], Route.build("multi", "sycl", [0, 1]).devices)
    config = ServeConfig(plan=plan, mode="multi", backend="sycl", server_bin=replaying_server(tmp_path, log),
                         rpc_bin="/nonexistent/ggml-rpc-server", port=18933)
    calls: list[tuple[str, str]] = []

    def fallback(cfg: ServeConfig, message: str) -> None:
        calls.append((cfg.mode, message))
        return None  # decline: the group then gives up, which ends the test

    with start_blocking_portal() as portal:
        sup = Supervisor(config, fallback=fallback, policy=RestartPolicy(base_delay=0.01, max_failures=0),
                         launcher=launcher_for(config))
        with pytest.raises(RunError):
            with portal.wrap_async_context_manager(sup):
                pass
    assert [mode for mode, _ in calls] == ["multi"], f"{kind} must offer the hybrid fallback"
