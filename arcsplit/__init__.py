"""arcsplit: run one llama.cpp model across several GPUs and keep it running.

The public API::

    plan = arcsplit.plan("model.gguf", gpus=[0, 1], ctx=8192)          # -> Plan (pure, no processes)
    with arcsplit.serve("model.gguf", gpus=[0, 1]) as server:            # -> Server (url, plan, status(), ...)
        ...
    async with arcsplit.aserve("model.gguf", gpus=[0, 1]) as server:     # the anyio twin -> AsyncServer
        ...
    client = arcsplit.attach()                                          # a running instance -> Client
    result = arcsplit.tune("model.gguf", gpus=[0, 1], budget_s=300)      # -> TuneResult; `arcsplit serve` runs its pick
    llm = arcsplit.load("model.gguf", gpus=[0, 1])                      # llama_cpp.Llama on rpc-servers (extra)

Every failure a user can act on is an ``arcsplit.ArcsplitError`` with a one-line message.
Names are imported on first use, so ``import arcsplit`` (and the CLI) stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the package version (pyproject reads it): cheap to read, unlike importlib.metadata

from .errors import ArcsplitError, BadInput, DoesNotFit, LlamaError, ModelError, NotRunning, PortBusy, RunError

if TYPE_CHECKING:  # pragma: no cover
    from ._api import AsyncServer, Client, Server, aserve, attach, plan, serve
    from .tuning.api import tune
    from .decide.choice import Measured
    from .tuning.result import TuneResult
    from .inproc import load
    from .model import ModelProfile
    from .planner import CardPlan, Plan, PlanOptions
    from .rig import Card, Rig

_LAZY = {
    "plan": "._api", "serve": "._api", "tune": ".tuning.api", "aserve": "._api", "attach": "._api",
    "Server": "._api", "AsyncServer": "._api", "Client": "._api",
    "TuneResult": ".tuning.result", "Measured": ".decide.choice",
    "load": ".inproc",
    "Plan": ".planner", "CardPlan": ".planner", "PlanOptions": ".planner",
    "Card": ".rig", "Rig": ".rig",
    "ModelProfile": ".model",
}

__all__ = [
    "plan", "serve", "aserve", "attach", "load", "tune",
    "Plan", "CardPlan", "PlanOptions", "Card", "Rig", "ModelProfile", "Server", "AsyncServer", "Client",
    "TuneResult", "Measured",
    "ArcsplitError", "BadInput", "DoesNotFit", "LlamaError", "ModelError", "NotRunning", "PortBusy", "RunError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'arcsplit' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
