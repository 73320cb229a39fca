"""Durations as flags take them: plain seconds and the usual suffixes; anything else is one BadInput line."""

import argparse
import math

import pytest

from arcsplit import durations
from arcsplit.errors import BadInput


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0),
                                           ("1h30m", 5400.0), ("1.5m", 90.0), ("250ms", 0.25), (" 2 M ", 120.0),
                                           (45, 45.0), (0.5, 0.5)])
def test_parses_seconds_and_suffixes(text, seconds):
    assert durations.parse(text, flag="--budget") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "m5", "-3", "nan", "inf", "1e400", "5m3", float("nan"), -1.0,
                                  math.inf, "0", 0])
def test_bad_values_name_the_flag_and_the_fix(text):
    with pytest.raises(BadInput) as err:
        durations.parse(text, flag="--budget")
    assert "--budget" in str(err.value) and "90s, 5m, 1h" in str(err.value)


def test_zero_only_where_allowed_and_limits():
    assert durations.parse("0", flag="--x", allow_zero=True) == 0.0
    with pytest.raises(BadInput, match="too long"):
        durations.parse("40d", flag="--x")
    with pytest.raises(BadInput, match="at least 10 s"):
        durations.parse("5s", flag="--x", minimum=10)


def test_argparse_type_is_a_usage_error():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=durations.argtype("--budget"))
    assert p.parse_args(["--budget", "5m"]).budget == 300.0
    with pytest.raises(SystemExit):
        p.parse_args(["--budget", "5 parsecs"])
