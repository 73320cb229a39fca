"""What `arcsplit serve` says when another host's session opens (cli/serve_run.host_line): the login and the agent's
start, of which the agent's own start there, and a hint when that is slow (a login shell rc runs on every start)."""

from __future__ import annotations

from arcsplit.cli.serve_run import SLOW_AGENT_START_S, host_line


def test_the_agents_start_is_shown_and_a_slow_one_points_at_the_login_shell():
    base = {"ssh": "me@b", "opened_s": 0.56, "generation": 1}
    assert host_line("b", {**base, "started_s": None}) == "host b (me@b): ssh login and node agent in 0.56 s"
    quick = host_line("b", {**base, "started_s": 0.12})
    assert quick.endswith("of which the agent's start there 0.12 s") and "slow" not in quick
    slow = host_line("b", {**base, "started_s": SLOW_AGENT_START_S + 0.2})
    assert "slow: the login shell's rc on b" in slow and "`time ssh me@b true`" in slow


def test_a_slow_login_is_named_apart_from_the_agents_start():
    from arcsplit.cli.serve_run import SLOW_LOGIN_S

    slow_login = host_line("b", {"ssh": "me@b", "opened_s": 0.15 + SLOW_LOGIN_S + 0.2, "started_s": 0.15})
    assert "the login itself took 0.70 s" in slow_login and "`ssh -v me@b true`" in slow_login
    assert "rc on b" not in slow_login
    quick = host_line("b", {"ssh": "me@b", "opened_s": 0.45, "started_s": 0.15})
    assert "login itself" not in quick and "slow" not in quick
