"""One exception hierarchy: every failure a user can act on is an ArcsplitError.

The CLI prints ``str(error)`` as a single line and exits with ``error.exit_code``;
nothing else escapes as a traceback.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator


class ArcsplitError(Exception):
    """A failure with a one-line message naming the problem and, where known, the fix."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = " ".join(str(problem).split())
        self.fix = " ".join(fix.split()) if fix else None
        super().__init__(self.problem)

    def __str__(self) -> str:
        return f"{self.problem}; {self.fix}" if self.fix else self.problem


class BadInput(ArcsplitError):
    """The user asked for something malformed: a flag, a list of cards, a layout file."""


class ModelError(BadInput):
    """The GGUF file cannot be read: not a GGUF, truncated, a shard missing, absurd counts."""


class UnknownCard(BadInput):
    """A card index or name that the backend does not report."""


class DoesNotFit(ArcsplitError):
    """The model (at the asked context) does not fit the cards' free memory."""


class LlamaError(ArcsplitError):
    """The llama.cpp binaries are missing, mismatched, or could not be built."""


class BuildError(LlamaError):
    """Building llama.cpp failed; the message names the step and its log file."""


class PortBusy(ArcsplitError):
    """A port the user named is already taken."""


class HostError(ArcsplitError):
    """Another host of a layout cannot be used: ssh fails, its node agent refuses, its build differs."""


class RunError(ArcsplitError):
    """A supervised process failed to start or kept dying."""

    exit_code = 1


class NotRunning(ArcsplitError):
    """No running arcsplit instance matches the request."""


# -- naming what the user typed: a flag on the command line, an argument from Python --------------------------------
_PYTHON = contextvars.ContextVar("arcsplit_python_spelling", default=False)
_PYTHON_NAMES = {"--cpu-memory": "cpu_memory_mib", "--host-memory": "host_memory_mib", "--np": "parallel",
                 "--parallel (--np)": "parallel", "--budget": "budget_s", "--per-candidate": "per_candidate_s"}


@contextmanager
def python_spelling() -> Iterator[None]:
    """Errors raised inside name the Python API's arguments (``gpus=[0, 0]``), not the CLI's flags
    (``--gpus 0,0``): the public API's entry points (arcsplit.plan, serve, aserve, tune) run their checks in it."""
    token = _PYTHON.set(True)
    try:
        yield
    finally:
        _PYTHON.reset(token)


def arg(flag: str) -> str:
    """``--cpu-memory`` on the command line, ``cpu_memory_mib`` from Python."""
    if not _PYTHON.get():
        return flag
    return _PYTHON_NAMES.get(flag, flag.lstrip("-").replace("-", "_"))


def given(flag: str, value: object, typed: str | None = None) -> str:
    """A value as the user gave it: ``--gpus '0,0'`` (``typed``, else the value) or, from Python, ``gpus=[0, 0]``."""
    if _PYTHON.get():
        return f"{arg(flag)}={value!r}"
    return f"{flag} {value if typed is None else typed}"


def example(cli: str, python: str) -> str:
    """A fix's example in the caller's spelling: ``--gpus 0,1`` or ``gpus=[0, 1]``."""
    return python if _PYTHON.get() else cli
