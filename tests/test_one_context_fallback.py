"""A one-context group that fails the way hybrid avoids moves to the next route of its list (hybrid): the NEO allocation failure and the
llama.cpp#28765 output copy. No Intel card here, so llama-server is a stand-in that replays a user's verbatim log
(tests/fixtures/runtime/SOURCES.md) and exits as llama.cpp does on a SYCL error (abort); the supervisor, its log
capture and its failure classification are the real ones."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from anyio.from_thread import start_blocking_portal

from dataclasses import replace

from arcsplit.decide.choice import RouteChoice
from arcsplit.decide.routes import RouteList, entry
from arcsplit.errors import RunError
from arcsplit.llama.mode import ModeDecision
from arcsplit.route import Route
from arcsplit.run.fallback import RouteMove
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
def test_one_context_failure_moves_to_the_next_route_of_the_list(tmp_path, log, kind):
    plan = make_plan("sycl", [0, 1], Route.build("multi", "sycl", [0, 1]).devices)
    config = ServeConfig(plan=plan, mode="multi", backend="sycl", server_bin=replaying_server(tmp_path, log),
                         rpc_bin="/nonexistent/ggml-rpc-server", port=18933)
    hybrid = replace(config, plan=make_plan("sycl", [0, 1], Route.build("hybrid", "sycl", [0, 1]).devices),
                     mode="hybrid")
    routes = RouteList((entry(config, ModeDecision("multi"), RouteChoice.untuned("multi", False), "auto's choice"),
                        entry(hybrid, ModeDecision("hybrid"), RouteChoice.untuned("hybrid", False), "next")))
    moves: list[RouteMove] = []

    with start_blocking_portal() as portal:
        sup = Supervisor(config, routes=routes, on_move=moves.append,
                         policy=RestartPolicy(base_delay=0.01, max_failures=0), launcher=launcher_for(config))
        with pytest.raises(RunError) as err:  # hybrid's rpc-server does not exist: the run then gives up
            with portal.wrap_async_context_manager(sup):
                pass
    assert [(m.left.label, m.reason, m.to and m.to.label) for m in moves] == [("multi", "multi_device", "hybrid")], \
        f"{kind} must move to the next route at once"
    assert "no route left" in str(err.value) and "multi: multi_device" in str(err.value)
    assert sup.status()["routes"]["now"] == "hybrid" and sup.config.mode == "hybrid"
