"""How the cards share one model: the modes, one owner. Pure: no I/O.

``Mode`` is a ``StrEnum``: a member compares and serialises as its value ("multi"), so argv, the bus, state files
and the Python API (which still takes plain strings) see the same text as before. Which mode runs is chosen in
llama/mode.py; what each mode means for the processes is in route.py. Adding a mode: a member here (with its
facts below), its process layout in ``Route.build``, its rule in ``choose_mode``.
"""

from __future__ import annotations

from enum import StrEnum

from .errors import BadInput


class Mode(StrEnum):
    SINGLE = "single"  # one card, llama-server alone
    MULTI = "multi"  # one llama-server context over this machine's cards
    MULTI_WORKAROUND = "multi+workaround"  # multi with a runtime workaround (Backend.one_context_workaround)
    HYBRID = "hybrid"  # llama-server holds the first card, an rpc-server each other card
    RPC = "rpc"  # every card behind its own rpc-server

    @property
    def one_context(self) -> bool:
        """llama-server holds every card of this machine in one context (the multi-device failures' route)."""
        return self in (Mode.MULTI, Mode.MULTI_WORKAROUND)

    @property
    def needs_local_server_card(self) -> bool:
        """llama-server itself holds a card of this machine, and the mode needs two cards or more."""
        return self in (Mode.MULTI, Mode.MULTI_WORKAROUND, Mode.HYBRID)

    @property
    def speed(self) -> str:
        """What the mode costs against native, as ``choose_mode`` explains a choice (bench/results)."""
        return _SPEED[self]


_SPEED = {Mode.SINGLE: "native speed", Mode.MULTI: "native speed",
          Mode.MULTI_WORKAROUND: "one context, no peer access", Mode.HYBRID: "~0.87x native decode",
          Mode.RPC: "~0.75x native decode"}

# Every mode, fastest first where they work.
MODES: tuple[Mode, ...] = tuple(Mode)
# What ``auto`` tries on two cards or more (and what a probe may load), fastest first.
AUTO_ORDER: tuple[Mode, ...] = (Mode.MULTI, Mode.MULTI_WORKAROUND, Mode.HYBRID, Mode.RPC)
AUTO = "auto"  # --mode: let llama/mode.py choose
CHOICES: tuple[str, ...] = (AUTO, *MODES)


def parse(value: str) -> Mode:
    """``value`` as a Mode; an unknown name is a one-line error listing the known ones."""
    try:
        return Mode(value)
    except ValueError:
        raise BadInput(f"unknown mode {value!r}", f"use one of {', '.join(MODES)}") from None


def parse_choice(value: str) -> Mode | None:
    """--mode's value: None for ``auto``, else the Mode (an unknown name is a one-line error listing the choices)."""
    if value == AUTO:
        return None
    if value not in CHOICES:
        raise BadInput(f"unknown mode {value!r}", f"use one of {', '.join(CHOICES)}")
    return Mode(value)
