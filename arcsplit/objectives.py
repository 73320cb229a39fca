"""What ``arcsplit tune`` picks a route by, and which way each figure is better: rates in tokens/s (decode, prefill,
all slots busy) the higher, time to first token in ms the lower. Pure: the CLI's flag, the tune runner's ranking and
second round, and every surface's table read it here."""

from __future__ import annotations

OBJECTIVES = ("decode", "prefill", "streams", "ttft")
LOWER_IS_BETTER = frozenset({"ttft"})


def unit(objective: str) -> str:
    """The unit a figure by ``objective`` is kept and shown in: ms for time to first token, else tokens/s."""
    return "ms" if objective in LOWER_IS_BETTER else "t/s"


def better_first(objective: str, value: float) -> float:
    """A sort key that puts the better figure by ``objective`` first: the shorter time, the higher rate."""
    return value if objective in LOWER_IS_BETTER else -value


def gain(objective: str, mine: float, theirs: float) -> float:
    """How much better ``mine`` is than ``theirs`` by ``objective``, above 1 a gain either way: the rate over theirs,
    or their time over mine."""
    return theirs / mine if objective in LOWER_IS_BETTER else mine / theirs
