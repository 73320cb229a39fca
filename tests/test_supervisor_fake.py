"""The supervisor's restart, backoff, stall, watchdog and ordered stop against an in-memory launcher: seconds,
no llama.cpp. The same supervisor runs real processes in test_serve.py and test_faults.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import anyio
import pytest

from arcsplit.errors import RunError
from arcsplit.planner import CardPlan, Plan, PlanOptions
from arcsplit.rig import Card
from arcsplit.route import Route
from arcsplit.run.supervisor import RestartPolicy, Supervisor, Timeouts
from arcsplit.decide.specs import ServeConfig

from _fake_launcher import FakeLauncher, Script

G = 1 << 30
FAST = Timeouts(rpc_ready=1.0, stall=0.5, stop_grace=0.3, failed_grace=0.1, health_interval=0.05, health_failures=3)


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "rt"))


def config(mode: str = "rpc", backend: str = "cuda", indices: tuple[int, ...] = (0, 1)) -> ServeConfig:
    devices = Route.build(mode, backend, list(indices)).devices
    n = len(indices)
    cards = tuple(CardPlan(Card(backend, i, f"card {i}", 16 * G, 16 * G), d, 10 * k, 10 * (k + 1), 1, 1, 0, 1,
                           has_output=k == n - 1) for k, (i, d) in enumerate(zip(indices, devices)))
    plan = Plan("/m.gguf", "llama", 10 * n - 1, 4096, PlanOptions(n_ctx=4096), cards)
    return ServeConfig(plan=plan, mode=mode, backend=backend, server_bin="/b/llama-server", rpc_bin="/b/rpc",
                       port=8080, cores=2)


def supervisor(launcher: FakeLauncher, policy: RestartPolicy = RestartPolicy(base_delay=0.01, max_delay=0.04),
               **kw: Any) -> Supervisor:
    return Supervisor(config(**kw), launcher=launcher, policy=policy, timeouts=FAST, sweep_leftovers=False)


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def group_states(events: list[Any]) -> list[str]:
    return [e.data["state"] for e in events if e.kind == "group"]


async def collect(sup: Supervisor, into: list[Any]) -> None:
    async with sup.subscribe(10_000) as stream:
        async for ev in stream:
            into.append(ev)


def test_rpc_servers_start_before_llama_server_and_stop_after_it():
    fake = FakeLauncher()

    async def main() -> None:
        async with supervisor(fake) as sup:
            assert sup.status()["state"] == "ready"
            assert sorted(fake.started[:2]) == ["rpc0", "rpc1"] and fake.started[2:] == ["server"]
        assert fake.stopped[0] == "server" and sorted(fake.stopped[1:]) == ["rpc0", "rpc1"]
        assert sup.status()["state"] == "stopped"

    anyio.run(main)


def test_a_member_that_dies_restarts_the_whole_group_in_order():
    fake = FakeLauncher()
    events: list[Any] = []

    async def main() -> None:
        async with supervisor(fake) as sup, anyio.create_task_group() as tg:
            tg.start_soon(collect, sup, events)
            fake.kill("rpc1")
            await wait_for(lambda: sup.status()["generation"] == 2 and sup.status()["state"] == "ready")
            st = sup.status()
            assert {n: p["restarts"] for n, p in st["processes"].items()} == {"rpc0": 1, "rpc1": 1, "server": 1}
            assert st["failures"] == 1 and st["last_error"] == "rpc1 (CUDA1) exited with signal 9 (killed)"
            assert fake.stopped[0] == "server"  # the survivor llama-server goes first, then the other rpc-server
            assert len(fake.started) == 6 and fake.started[-1] == "server"
            tg.cancel_scope.cancel()
        assert group_states(events)[:3] == ["stopping", "backoff", "starting"]

    anyio.run(main)


def test_backoff_doubles_up_to_its_cap_then_gives_up_with_the_reason():
    fake = FakeLauncher(rpc0=Script(start_rc=1))
    events: list[Any] = []
    policy = RestartPolicy(base_delay=0.01, max_delay=0.04, max_failures=4)

    async def main() -> None:
        sup = Supervisor(config(), launcher=fake, policy=policy, timeouts=FAST, sweep_leftovers=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, sup, events)
            await anyio.sleep(0)
            with pytest.raises(RunError, match=r"gave up after 5 failures in a row: rpc0 \(CUDA0\) exited with code 1 while starting: "
                                                 r"error: failed to load model; logs: "):
                await sup.run()

    anyio.run(main)
    delays = [e.data["delay"] for e in events if e.kind == "group" and e.data["state"] == "backoff"]
    assert delays == [0.01, 0.02, 0.04, 0.04]
    assert fake.started.count("server") == 0  # llama-server never starts without its rpc-servers


def test_a_load_without_progress_stalls_and_output_counts_as_progress():
    stalled = FakeLauncher(server=Script(ready=False))

    async def main(fake: FakeLauncher) -> Supervisor:
        sup = supervisor(fake, policy=RestartPolicy(max_failures=0))
        with anyio.fail_after(5):
            await sup.run()
        return sup

    with pytest.raises(RunError, match="llama-server made no progress for"):
        anyio.run(main, stalled)
    assert stalled.stopped[0] == "server"
    # The same load printing a line every 0.1 s outlives the 0.5 s stall timeout and becomes ready at 1.2 s.
    slow = FakeLauncher(server=Script(ready_after=1.2, lines_every=0.1))

    async def ready() -> None:
        async with supervisor(slow, policy=RestartPolicy(max_failures=0)) as sup:
            assert sup.status()["state"] == "ready" and sup.status()["failures"] == 0

    anyio.run(ready)


def test_watchdog_restarts_a_group_whose_server_stops_answering_while_alive():
    fake = FakeLauncher()

    async def main() -> None:
        async with supervisor(fake) as sup:
            fake.health_code = 503
            await wait_for(lambda: sup.status()["generation"] == 2)
            assert "stopped answering /health (answers 503, 3 times" in sup.status()["last_error"]
            assert fake.stopped[0] == "server"
            fake.health_code = 200
            await wait_for(lambda: sup.status()["state"] == "ready")

    anyio.run(main)


def test_stop_waits_out_the_grace_then_forces_a_member_that_ignores_sigterm():
    fake = FakeLauncher(server=Script(ignores_term=True))

    async def main() -> None:
        async with supervisor(fake) as sup:
            t0 = anyio.current_time()
        assert FAST.stop_grace <= anyio.current_time() - t0 < FAST.stop_grace + 1
        assert sup.status()["processes"]["server"]["returncode"] == -9
        assert fake.stopped[0] == "server" and sorted(fake.stopped[1:]) == ["rpc0", "rpc1"]

    anyio.run(main)


def test_a_cancelled_group_stops_in_order_too():
    """Cancelling the task that runs the group (an error in the caller's ``async with`` block, a caller's timeout)
    stops it as stop() does: llama-server first, and an rpc-server only once llama-server has exited. An
    rpc-server that goes first makes llama-server abort in its RPC calls on the way out."""
    fake = FakeLauncher(server=Script(exit_after=0.2))

    async def main() -> None:
        sup = supervisor(fake)
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            tg.cancel_scope.cancel()
        assert fake.log[0] == ("stop", "server")
        server_gone = fake.log.index(("exit", "server"))
        assert all(fake.log.index(("stop", rpc)) > server_gone for rpc in ("rpc0", "rpc1"))
        assert sup.status()["state"] == "stopped"

    anyio.run(main)


def test_a_cancel_while_members_start_reaches_them():
    """A cancel that comes while members are still starting (before they report started) reaches them: anyio's
    TaskGroup.start waits for the task it started to end, so a member out of the cancel's reach from its first
    moment held the cancelled group. A layout's unreachable host cancels this machine's rpc-servers as they start:
    ``serve`` then took 60 s to give up."""
    fake = FakeLauncher(rpc0=Script(start_after=0.5), rpc1=Script(start_after=0.5))

    async def main() -> None:
        sup = supervisor(fake)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await wait_for(lambda: len(fake.started) == 2)  # both are starting
            tg.cancel_scope.cancel()
        assert sup.status()["state"] == "stopped"

    t = threading.Thread(target=anyio.run, args=(main,), daemon=True)  # a hang must fail the test, not be it
    t.start()
    t.join(10)
    assert not t.is_alive(), "the cancelled group waited on members that were still starting"


def test_serve_starts_exactly_the_specs_of_its_route():
    """What the launcher is handed is the complete argv: nothing is spliced in after build_specs."""
    from arcsplit.decide.specs import build_specs

    fake = FakeLauncher()

    async def main() -> None:
        async with supervisor(fake, mode="hybrid", backend="sycl", indices=(1, 0)) as sup:
            ports = [s.port for s in fake.specs if s.role == "rpc"]
            assert tuple(fake.specs) == build_specs(sup.config, ports)
            assert [c["holder"] for c in sup.status()["route"]["cards"]] == ["server", "rpc0"]

    anyio.run(main)


def test_states_follow_the_one_table_and_an_illegal_transition_raises():
    from arcsplit.proc.states import (GROUP_TRANSITIONS, MEMBER_TRANSITIONS, GroupState, IllegalTransition,
                                     MemberState, advance)

    assert advance(GROUP_TRANSITIONS, GroupState.READY, GroupState.STOPPING) is GroupState.STOPPING
    for table, current, new in ((GROUP_TRANSITIONS, GroupState.STOPPED, GroupState.STARTING),
                                (GROUP_TRANSITIONS, GroupState.BACKOFF, GroupState.READY),
                                (MEMBER_TRANSITIONS, MemberState.EXITED, MemberState.READY),
                                (MEMBER_TRANSITIONS, MemberState.NEW, MemberState.READY)):
        with pytest.raises(IllegalTransition, match=f"{current.value} -> {new.value}"):
            advance(table, current, new)  # type: ignore[arg-type]
    fake = FakeLauncher()
    events: list[Any] = []

    async def main() -> None:
        async with supervisor(fake) as sup, anyio.create_task_group() as tg:
            tg.start_soon(collect, sup, events)
            member = fake.members["rpc0"]
            with pytest.raises(IllegalTransition):
                member.state = MemberState.STARTING  # a ready member never starts again: a new one does
            fake.kill("server")
            await wait_for(lambda: sup.status()["generation"] == 2 and sup.status()["state"] == "ready")
            tg.cancel_scope.cancel()

    anyio.run(main)
    seen = [GroupState(s) for s in group_states(events)]
    assert all(b in GROUP_TRANSITIONS[a] for a, b in zip(seen, seen[1:])), seen
    assert json.dumps({"state": seen[0]}) == '{"state": "stopping"}'  # on the wire: the plain string


def test_no_rpc_server_or_link_is_given_llama_servers_port(monkeypatch):
    """llama-server's port is not bound while the rpc-servers' and links' ports are picked, so a free-port probe
    can return it (a user's --port in the ephemeral range; tests/test_remote_group.py met it): the picks skip it."""
    from arcsplit.run import supervisor as sup_mod

    cfg = config()
    handed: list[int] = [cfg.port, cfg.port, 40001, 40002]  # the probe offers llama-server's port first, twice

    def free_port(host: str = "127.0.0.1") -> int:
        return handed.pop(0) if handed else 40999

    monkeypatch.setattr(sup_mod, "free_port", free_port)
    sup = Supervisor(cfg, launcher=FakeLauncher(), timeouts=FAST, sweep_leftovers=False)
    ports = sup._local_ports()
    assert cfg.port not in ports and ports == [40001, 40002]


# -- issue 43: the failure count decays with time ready ------------------------------------------------------------

def test_the_failure_count_decays_with_time_ready_instead_of_a_cliff():
    """Faults spaced by some time ready each count less than a full failure: with a cap of 2 and a half-life of
    0.1 s, six faults 0.4 s ready apart (count ~1.07 each) never give up, where the old rule (the count starts over
    only after `stable_after` s ready) gave up at the third; failed starts in a row still count 1, 2, 3."""
    fake = FakeLauncher()
    policy = RestartPolicy(base_delay=0.01, max_delay=0.04, max_failures=2, half_life=0.1)
    events: list[Any] = []

    async def main() -> None:
        async with supervisor(fake, policy=policy) as sup, anyio.create_task_group() as tg:
            tg.start_soon(collect, sup, events)
            for n in range(2, 8):
                await anyio.sleep(0.4)  # ready this long between faults
                fake.kill("rpc1")
                await wait_for(lambda n=n: sup.status()["generation"] == n and sup.status()["state"] == "ready")
            assert sup.status()["failures"] < 1.2
            tg.cancel_scope.cancel()

    anyio.run(main)
    counts = [e.data["failures"] for e in events if e.kind == "group" and e.data["state"] == "backoff"]
    assert len(counts) == 6 and all(1.0 <= c < 1.2 for c in counts), counts


def test_the_failure_count_and_backoff_numbers_the_docs_give():
    """docs/multihost.md's table: faults spread over an hour count ~1 (backoff 1 s); a burst compounds."""
    p = RestartPolicy()
    assert [p.count(0.0, 0.0), p.count(1.0, 0.0), p.count(2.0, 0.0)] == [1.0, 2.0, 3.0]  # failed starts in a row
    assert p.count(1.0, 600.0) == pytest.approx(1.0, abs=1e-5)  # 6 an hour: each starts from ~0
    assert p.count(1.0, 30.0) == pytest.approx(1.5)  # one half-life ready
    assert p.delay(1.0) == 1.0 and p.delay(2.0) == 2.0 and p.delay(1.5) == pytest.approx(2 ** 0.5, abs=1e-3)
    assert p.delay(99.0) == p.max_delay
