"""The states of a member and of the group, and the one table of allowed transitions for each. Pure.

Values are strings on the wire (status, events, state.json): ``StrEnum`` members compare and serialise as their
value, so the bus, dashboard and telemetry read them unchanged. A transition the table does not allow is a bug
in arcsplit, so it raises instead of being published.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Mapping, TypeVar


class MemberState(StrEnum):
    NEW = "new"  # not started in this generation
    STARTING = "starting"  # spawned, not yet ready (rpc-server: no connect yet; llama-server: /health not 200)
    READY = "ready"
    STOPPING = "stopping"  # asked to exit (SIGTERM sent), exit not yet observed
    EXITED = "exited"  # exit observed; a restart makes a new member


class GroupState(StrEnum):
    NEW = "new"
    STARTING = "starting"  # rpc-servers, then llama-server
    READY = "ready"  # serving: /health 200
    STOPPING = "stopping"  # tearing down in order (llama-server first)
    BACKOFF = "backoff"  # waiting before the next start after a failure
    STOPPED = "stopped"  # final


class Cause(StrEnum):
    """Why a generation ended, as counted and shown (events, metrics by cause, ``arcsplit ps``): one name each."""

    EXIT = "exit"  # a member exited (crashed, killed, or its host went away)
    LOAD = "load"  # the group never got ready: a member failed or stalled while starting
    UNHEALTHY = "unhealthy"  # llama-server stopped answering /health while its process is alive
    HANG = "hang"  # compute stopped making progress while every process is alive (run/watchdog.py)
    WRONG = "wrong"  # the output canary found the route computing something else than its reference
    DEVICE_LOST = "device_lost"  # a member's log says its card was lost (driver reset, GPU hang)
    OUT_OF_MEMORY = "out_of_memory"  # a member's log says its card ran out of memory
    RESTART = "restart"  # asked: arcsplit restart, the dashboard, the API


_M, _G = MemberState, GroupState
MEMBER_TRANSITIONS: Mapping[MemberState, frozenset[MemberState]] = {
    _M.NEW: frozenset({_M.STARTING}),
    _M.STARTING: frozenset({_M.READY, _M.STOPPING, _M.EXITED}),  # EXITED: crashed while loading, or not found
    _M.READY: frozenset({_M.STOPPING, _M.EXITED}),
    _M.STOPPING: frozenset({_M.EXITED}),
    _M.EXITED: frozenset(),
}
GROUP_TRANSITIONS: Mapping[GroupState, frozenset[GroupState]] = {
    _G.NEW: frozenset({_G.STARTING, _G.STOPPED}),
    # STARTING -> STARTING/BACKOFF/READY->BACKOFF: the failed or restarted generation had nothing left to stop.
    _G.STARTING: frozenset({_G.READY, _G.STOPPING, _G.BACKOFF, _G.STARTING, _G.STOPPED}),
    _G.READY: frozenset({_G.STOPPING, _G.BACKOFF, _G.STARTING, _G.STOPPED}),
    _G.STOPPING: frozenset({_G.BACKOFF, _G.STARTING, _G.STOPPED}),
    _G.BACKOFF: frozenset({_G.STARTING, _G.STOPPED}),
    _G.STOPPED: frozenset(),
}

S = TypeVar("S", MemberState, GroupState)


class IllegalTransition(RuntimeError):
    """A state change the table forbids: a bug in arcsplit, never a user's mistake."""


def advance(table: Mapping[S, frozenset[S]], current: S, new: S) -> S:
    """``new`` if the table allows ``current -> new``; raises IllegalTransition otherwise."""
    if new not in table[current]:
        raise IllegalTransition(f"{type(current).__name__} {current.value} -> {new.value} is not allowed")
    return new


class Tracked:
    """A member's ``state``, changed only along MEMBER_TRANSITIONS: the one implementation every kind of member
    (a local child, a remote rpc-server, the tests' fake) shares."""

    _state: MemberState = MemberState.NEW

    @property
    def state(self) -> MemberState:
        return self._state

    @state.setter
    def state(self, new: MemberState) -> None:
        self._state = advance(MEMBER_TRANSITIONS, self._state, new)
