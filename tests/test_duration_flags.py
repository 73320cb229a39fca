"""Every CLI flag that takes a duration reads plain seconds and 90s/5m/1h (arcsplit/durations.py), and says so in
--help. The bad values themselves are tests/test_bad_cli.py's cases, through the real CLI."""

from __future__ import annotations

import argparse

import pytest

from arcsplit import durations
from arcsplit.cli import build_parser

# (command's argv before the flag, flag, a value with a unit, its seconds)
FLAGS = [
    (["tune", "m.gguf"], "--budget", "5m", 300.0),
    (["tune", "m.gguf"], "--per-candidate", "1m30s", 90.0),
    (["serve", "m.gguf"], "--budget", "1h", 3600.0),
    (["serve", "m.gguf"], "--per-candidate", "20s", 20.0),
    (["serve", "m.gguf"], "--stall-timeout", "5m", 300.0),
    (["serve", "m.gguf"], "--stop-grace", "90s", 90.0),
    (["node", "--stdio"], "--heartbeat", "1m", 60.0),
    (["stop"], "--wait", "2m", 120.0),
    (["doctor"], "--timeout", "3m", 180.0),
]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("before, flag, text, seconds", FLAGS,
                         ids=[f"{f[0][0]} {f[1]}" for f in FLAGS])
def test_each_duration_flag_takes_units_and_plain_seconds(before, flag, text, seconds):
    args = build_parser().parse_args([*before, flag, text])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == pytest.approx(seconds)
    plain = build_parser().parse_args([*before, flag, "42"])
    assert getattr(plain, flag.lstrip("-").replace("-", "_")) == 42.0


def test_help_says_each_takes_units_and_no_flag_is_a_bare_float():
    """No option of any command parses a bare float: a duration goes through durations.argtype, whose help says
    what it takes; a new one that forgets shows up here."""
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            assert action.type is not float, f"{name} {action.option_strings} parses a bare float"
            if getattr(action.type, "__name__", "") == "duration":
                assert durations.HELP in (action.help or ""), f"{name} {action.option_strings}: help without units"
                assert action.metavar == "TIME"
    flags = {(f[0][0], f[1]) for f in FLAGS}
    found = {(name, a.option_strings[-1]) for name, sub in _subparsers(build_parser()).items() for a in sub._actions
             if getattr(a.type, "__name__", "") == "duration"}
    assert flags <= found
