"""The progress watchdog's decision core and the pure parts around it, without llama.cpp: what llama-server's task
loop answers (fixtures captured from the pinned build), when a stall is a hang and when it is slow work, who is named,
and how the verdict shows (the flag, the metric, the dashboard and `arcsplit ps` line). The real hangs, with frozen
processes: tests/test_hang.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arcsplit import _api
from arcsplit.cli import build_parser
from arcsplit.errors import BadInput
from arcsplit.llama.work import Work, from_metrics, from_slots
from arcsplit.proc import stuck
from arcsplit.proc.spec import ProcessSpec
from arcsplit.roles import Role
from arcsplit.run.events import failure_line
from arcsplit.run.watchdog import (DEFAULT_HANG_AFTER, HangPolicy, Look, ProgressCore, Seen, Verdict, name_stalled,
                                   server_key, sleeps_when_idle)
from arcsplit.telemetry.prometheus import render
from arcsplit.tui.state import DashState

sys.path.insert(0, str(Path(__file__).parent))
FIX = Path(__file__).parent / "fixtures" / "work"
POLICY = HangPolicy(after=20.0, factor=3.0, cap=600.0, probe_every=25.0, busy_every=2.0, idle_every=5.0,
                    work_rate=0.1, work_window=10.0)

IDLE = Work(busy=0, done=(1.0,))


def busy(n: float) -> Work:
    return Work(busy=1, done=(n,))


def run(core: ProgressCore, looks: list[Look]) -> list[Verdict]:
    return [core.observe(look).verdict for look in looks]


# -- what the task loop answers ----------------------------------------------------------------------------------


def test_slots_of_the_pinned_build_read_as_work():
    b = from_slots(json.loads((FIX / "slots_busy.json").read_text()))
    i = from_slots(json.loads((FIX / "slots_idle.json").read_text()))
    assert b is not None and i is not None
    assert b.busy == 1 and i.busy == 0
    assert b.done != i.done  # slot 1's tokens moved (27 decoded, then the task ended)
    assert from_slots({"error": "x"}) is None and from_slots([1, 2]) is None


def test_metrics_of_the_pinned_build_read_as_work():
    m = from_metrics((FIX / "metrics_busy.txt").read_text())
    assert m == Work(busy=1, done=(28.0, 5.0, 0.0))
    assert from_metrics("# nothing here\n") is None


# -- the decision ------------------------------------------------------------------------------------------------


def test_a_request_that_stops_progressing_is_a_hang_after_the_bound_and_not_before():
    core = ProgressCore(POLICY, 0.0)
    assert run(core, [Look(0, IDLE), Look(2, busy(1)), Look(4, busy(2)), Look(6, busy(3))]) == [Verdict.OK] * 4
    # the counters stop at t=6: no verdict until 20 s of no progress
    assert run(core, [Look(6 + t, busy(3)) for t in range(2, 20, 2)]) == [Verdict.OK] * 9
    d = core.observe(Look(27, busy(3)))
    assert d.verdict is Verdict.HANG and d.stalled == pytest.approx(21) and d.bound == 20


def test_the_task_loop_not_answering_counts_as_no_progress():
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, IDLE))
    assert core.observe(Look(5, None)).verdict is Verdict.OK
    assert core.observe(Look(24, None)).verdict is Verdict.OK
    assert core.observe(Look(25.5, None)).verdict is Verdict.HANG


def test_idle_is_checked_with_a_probe_whose_stall_counts_from_its_start():
    core = ProgressCore(POLICY, 0.0)
    assert run(core, [Look(t, IDLE) for t in (0, 5, 10, 15, 20)]) == [Verdict.OK] * 5
    assert core.observe(Look(25, IDLE)).verdict is Verdict.PROBE
    core.probe_sent(25.0)
    assert core.next_look() == POLICY.busy_every  # work is due: read at the busy pace
    # the slot has not taken the probe yet (idle), then it sits in a slot whose counters never move
    assert run(core, [Look(26, IDLE), Look(28, busy(1)), Look(44, busy(1))]) == [Verdict.OK] * 3
    d = core.observe(Look(45.5, busy(1)))
    assert d.verdict is Verdict.HANG and d.stalled == pytest.approx(20.5)
    assert core.probing  # the verdict says it was the idle check that stopped


def test_a_probe_the_loop_took_is_still_the_idle_check():
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, IDLE))
    assert core.observe(Look(25, IDLE)).verdict is Verdict.PROBE
    core.probe_sent(25)
    core.observe(Look(26, Work(busy=1, done=(5.0,))))  # the slot took it (a new task): the counters moved once
    assert core.probing
    assert core.observe(Look(47, Work(busy=1, done=(5.0,)))).verdict is Verdict.HANG and core.probing
    core.probe_answered(48)
    assert not core.probing


def test_an_answered_probe_is_the_proof_and_the_next_comes_an_interval_later():
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, IDLE))
    assert core.observe(Look(25, IDLE)).verdict is Verdict.PROBE
    core.probe_sent(25)
    core.observe(Look(26, Work(busy=0, done=(2.0,))))  # it ran: the counters moved
    core.probe_answered(26.2)
    assert run(core, [Look(t, Work(0, (2.0,))) for t in (30, 40, 50)]) == [Verdict.OK] * 3
    assert core.observe(Look(51.5, Work(0, (2.0,)))).verdict is Verdict.PROBE


def test_no_probe_when_work_proves_the_route_computes():
    core = ProgressCore(POLICY, 0.0)
    verdicts = run(core, [Look(t, busy(t)) for t in range(0, 100, 2)])
    verdicts += run(core, [Look(100 + t, Work(0, (98.0,))) for t in range(0, 25, 5)])
    assert set(verdicts) == {Verdict.OK}


def test_members_at_work_hold_the_verdict_off_up_to_the_cap():
    """One ubatch of a big model on a CPU card: the counters stand still for minutes while the main threads compute."""
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, busy(0), cpu=0.0))
    verdicts = run(core, [Look(t, busy(0), cpu=0.9 * t) for t in range(2, 600, 2)])
    assert set(verdicts) == {Verdict.OK}
    assert core.observe(Look(600, busy(0), cpu=540.0)).verdict is Verdict.HANG


def test_cpu_before_the_stall_does_not_hold_the_verdict_off():
    core = ProgressCore(POLICY, 0.0)
    cpu = 0.0
    for t in range(0, 40, 2):  # computing, progressing
        cpu += 1.8
        core.observe(Look(t, busy(t), cpu=cpu))
    verdicts = run(core, [Look(38 + t, busy(38), cpu=cpu + 0.001 * t) for t in range(2, 24, 2)])
    assert verdicts[-1] is Verdict.HANG and Verdict.HANG not in verdicts[:-2]


def test_busy_waiting_noise_below_the_rate_is_not_work():
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, busy(0), cpu=0.0))
    verdicts = run(core, [Look(t, busy(0), cpu=0.05 * t) for t in range(2, 24, 2)])
    assert Verdict.HANG in verdicts


def test_the_bound_grows_with_the_longest_pause_the_route_showed():
    """Prompt batches of 10 s each: the bound becomes 3 x 10 s, so a 25 s batch is not a hang, a 31 s stall is."""
    core = ProgressCore(POLICY, 0.0)
    core.observe(Look(0, IDLE))
    for k in range(1, 5):
        assert core.observe(Look(10 * k, busy(k))).verdict is Verdict.OK
    assert core.longest == pytest.approx(10) and core.bound == pytest.approx(30)
    assert run(core, [Look(40 + t, busy(4)) for t in (5, 15, 25)]) == [Verdict.OK] * 3
    assert core.observe(Look(71, busy(4))).verdict is Verdict.HANG
    # what was learned carries over to the next generation of the route, and never past the cap
    assert ProgressCore(POLICY, 0.0, longest=core.longest).bound == pytest.approx(30)
    assert ProgressCore(POLICY, 0.0, longest=1e6).bound == POLICY.cap


def test_off_never_decides():
    assert not HangPolicy(after=0).on and HangPolicy().on and HangPolicy().after == DEFAULT_HANG_AFTER


# -- naming the member -------------------------------------------------------------------------------------------


def frozen_stuck(pid: int, threads: int = 4, frozen: int = 4) -> stuck.Stuck:
    return stuck.Stuck(pid=pid, state="S", frozen="the cgroup v2 freezer (/sys/fs/cgroup/x)", frozen_threads=frozen,
                       threads=threads, blocked=(), waits_on=(), io=None)


def waiting(pid: int, *peers: tuple[str, int]) -> stuck.Stuck:
    """llama-server with a thread (its RPC dispatcher for that rpc-server) blocked reading from each of ``peers``."""
    return stuck.Stuck(pid=pid, state="S", frozen=None, frozen_threads=0, threads=8, blocked=(), waits_on=peers,
                       io="recvfrom")


def idle(pid: int) -> stuck.Stuck:
    return stuck.Stuck(pid, "S", None, 0, 3, (), (), None)


def test_the_rpc_server_llama_server_waits_on_is_named_with_its_card_and_host():
    seen = [Seen("rpc0", Role.RPC, "card CPU0", "127.0.0.1:5000", idle(11)),
            Seen("rpc1", Role.RPC, "card CPU1, host b", "127.0.0.1:5001", None, cpu=0.0),
            Seen("server", Role.SERVER, "", stuck=waiting(10, ("127.0.0.1", 5001)))]
    hang = name_stalled(seen, 24.2, "on the requests in flight")
    assert hang.who == "rpc1"
    assert hang.message.startswith("rpc1 (card CPU1, host b) stopped computing: no progress for 24 s on the "
                                   "requests in flight, with every process alive")
    assert "llama-server waits on its answer (recvfrom on 127.0.0.1:5001)" in hang.message
    assert "0.0 s CPU" in hang.message


def test_of_several_awaited_rpc_servers_the_one_that_shows_why_is_named():
    seen = [Seen("rpc0", Role.RPC, "card RPC0", "127.0.0.1:5000", idle(11)),
            Seen("rpc1", Role.RPC, "card RPC1", "127.0.0.1:5001", frozen_stuck(12)),
            Seen("server", Role.SERVER, "", stuck=waiting(10, ("127.0.0.1", 5000), ("127.0.0.1", 5001)))]
    hang = name_stalled(seen, 21, "on the requests in flight")
    assert hang.who == "rpc1" and "frozen by" in hang.message and "it waits on rpc0 too" in hang.message


def test_a_frozen_member_is_named_with_how_it_is_frozen():
    seen = [Seen("rpc0", Role.RPC, "card CPU0", "127.0.0.1:5000", frozen_stuck(11)),
            Seen("rpc1", Role.RPC, "card CPU1", "127.0.0.1:5001", idle(12)),
            Seen("server", Role.SERVER, "", stuck=waiting(10, ("127.0.0.1", 5000)))]
    hang = name_stalled(seen, 21, "on the requests in flight")
    assert hang.who == "rpc0" and "(llama-server waits on its answer (recvfrom on 127.0.0.1:5000); frozen by the " \
        "cgroup v2 freezer" in hang.message


def test_llama_servers_own_frozen_main_thread_is_named():
    seen = [Seen("server", Role.SERVER, "card CPU0", stuck=frozen_stuck(10, threads=9, frozen=1))]
    hang = name_stalled(seen, 22, "while idle (llama-server's task loop does not answer /slots)")
    assert hang.who == "server"
    assert hang.message.startswith("llama-server (card CPU0) stopped computing")
    assert "its main thread frozen by the cgroup v2 freezer" in hang.message


def test_a_thread_in_uninterruptible_sleep_is_named_with_where_it_waits():
    d = stuck.Stuck(pid=11, state="D", frozen=None, frozen_threads=0, threads=5, blocked=((11, "xe_wait_user_fence"),),
                    waits_on=(), io=None)
    seen = [Seen("server", Role.SERVER, "card SYCL0", stuck=d)]
    hang = name_stalled(seen, 30, "on the requests in flight")
    assert hang.who == "server" and "state D, in xe_wait_user_fence" in hang.message


def test_when_no_member_can_be_told_the_line_says_what_is_known():
    seen = [Seen("rpc0", Role.RPC, "card CPU0", "127.0.0.1:5000", idle(11),
                 cpu=0.0),
            Seen("server", Role.SERVER, "", stuck=idle(10), cpu=0.01)]
    hang = name_stalled(seen, 20, "on the requests in flight")
    assert hang.who == "group"
    assert "which member stopped cannot be told" in hang.message and "rpc0 main thread S" in hang.message


# -- /proc readings (a real process, no llama.cpp) ---------------------------------------------------------------


def test_a_process_blocked_reading_a_socket_names_that_socket_s_peer():
    """What names the rpc-server llama-server waits on: a child blocked in recv() on a connection to us."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    code = f"import socket; s = socket.create_connection(('127.0.0.1', {port})); s.recv(1)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = srv.accept()
        deadline = time.monotonic() + 10
        seen = stuck.inspect(child.pid)
        while (seen is None or not seen.waits_on) and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = stuck.inspect(child.pid)
        assert seen is not None and seen.waits_on == (("127.0.0.1", port),) and seen.io in ("recvfrom", "read")
        assert seen.frozen is None and seen.state == "S"
        conn.close()
    finally:
        child.kill()
        child.wait()
        srv.close()


def test_a_frozen_thread_is_seen_frozen():
    from _freeze import frozen, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        time.sleep(0.2)
        with frozen(child.pid, thread=child.pid) as f:
            seen = stuck.inspect(child.pid)
            assert seen is not None and seen.frozen is not None and f"cgroup {f.kind} freezer" in seen.frozen
            assert "frozen by" in seen.summary()
        after = stuck.inspect(child.pid)
        assert after is not None and after.frozen is None
        assert stuck.main_cpu(child.pid) is not None
    finally:
        child.kill()
        child.wait()


def test_socket_addresses_of_proc_net_tcp():
    assert stuck.parse_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert stuck.parse_address("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)
    assert stuck.parse_address("00000000000000000000000001000000:0050") == ("::1", 80)
    assert stuck.parse_address("zz:1") is None


# -- settings and what shows -------------------------------------------------------------------------------------


def spec(argv: tuple[str, ...] = ("llama-server",), env: tuple[tuple[str, str], ...] = ()) -> ProcessSpec:
    return ProcessSpec(name="server", role=Role.SERVER, argv=argv, env=env, host="127.0.0.1", port=8080, cards=())


def test_the_api_key_comes_from_the_spec_the_environment_or_the_key_file(tmp_path):
    assert server_key(spec(env=(("LLAMA_API_KEY", "k1,k2"),)), {}) == "k1"
    assert server_key(spec(), {"LLAMA_API_KEY": "k3"}) == "k3"
    keys = tmp_path / "keys"
    keys.write_text("\nk4\nk5\n")
    assert server_key(spec(("llama-server", "--api-key-file", str(keys))), {}) == "k4"
    assert server_key(spec(), {}) is None


def test_a_server_that_sleeps_when_idle_is_read_without_waking_it():
    assert sleeps_when_idle(("llama-server", "--sleep-idle-seconds", "300"))
    assert not sleeps_when_idle(("llama-server", "--sleep-idle-seconds", "-1"))
    assert not sleeps_when_idle(("llama-server",))


@pytest.mark.parametrize("text,want", [("20s", 20.0), ("1m", 60.0), ("45", 45.0), ("0", 0.0), ("off", 0.0)])
def test_hang_after_flag(text, want):
    args = build_parser().parse_args(["serve", "m.gguf", "--hang-after", text])
    assert args.hang_after == want


@pytest.mark.parametrize("text", ["2", "nan", "-5", "1x", "2d"])
def test_hang_after_refuses_bad_values_in_one_line(text, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "m.gguf", f"--hang-after={text}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--hang-after" in err[-1] and "Traceback" not in "".join(err)


def test_the_help_names_the_default_the_watchdog_uses(capsys):
    assert build_parser().parse_args(["serve", "m.gguf"]).hang_after is None  # the API's default applies
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert f"(default: {DEFAULT_HANG_AFTER:g}s;" in " ".join(capsys.readouterr().out.split())


def test_the_api_checks_hang_after_as_the_flag_does():
    assert _api._hang_policy(None, None) == HangPolicy()
    assert _api._hang_policy(None, 45).after == 45 and _api._hang_policy(None, 0).after == 0
    assert _api._hang_policy(HangPolicy(probe_every=3), 6).probe_every == 3
    with pytest.raises(BadInput):
        _api._hang_policy(None, float("nan"))
    with pytest.raises(BadInput):
        _api._hang_policy(None, 1)


LAST = {"cause": "hang", "who": "rpc1", "message": "rpc1 (card CPU1, host b) stopped computing: ...", "host": "b",
        "card": "CPU1", "count": 1, "time": 1000.0}


def test_the_last_failure_in_one_line():
    assert failure_line(LAST, {"hang": 1, "exit": 2}, now=1130.0) == \
        "hang: rpc1 (card CPU1, host b), 2 min ago; this run: exit 2, hang 1"
    assert failure_line(LAST, now=1045.2).endswith("45 s ago")
    assert failure_line({"cause": "exit", "who": "group"}) == "exit: group"


def test_prometheus_counts_failures_by_cause_and_names_the_last_member():
    from prometheus_client.parser import text_string_to_metric_families

    status = {"state": "ready", "causes": {"hang": 2, "exit": 1}, "last_error": LAST["message"], "last_failure": LAST}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(render(status)) for s in fam.samples}
    assert samples[("arcsplit_failures_total", (("cause", "hang"),))] == 2
    assert samples[("arcsplit_failures_total", (("cause", "exit"),))] == 1
    info = [dict(labels) for (name, labels) in samples if name == "arcsplit_last_failure_info"]
    assert info == [{"error": LAST["message"], "cause": "hang", "member": "rpc1", "card": "CPU1", "host": "b"}]


def test_the_dashboard_keeps_the_last_failure_from_its_event():
    from arcsplit.tui.widgets import render_plan

    state = DashState(clock=lambda: 0.0)
    state.apply({"kind": "snapshot", "data": {"status": {"state": "ready", "plan": {}}}})
    changed = state.apply({"kind": "failure", "name": "group", "time": time.time(),
                           "data": {k: v for k, v in LAST.items() if k != "time"}})
    assert "plan" in changed
    assert state.status["causes"] == {"hang": 1} and state.status["last_failure"]["who"] == "rpc1"
    assert "last failure:" in render_plan(state) and "hang: rpc1 (card CPU1, host b)" in render_plan(state)
