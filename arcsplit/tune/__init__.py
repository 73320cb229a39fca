"""``arcsplit tune``: measure every route on this machine's cards and keep the fastest correct one (docs/tune.md).

This package is also the Python API's ``arcsplit.tune(model, gpus=..., objective=..., budget_s=...)`` (arcsplit/
_api.py's ``tune``, which returns a TuneResult): the name can only be one object, and an import of a submodule
(``arcsplit.tune.runner``) binds the package to it, so the package is callable and calling it runs the function.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


class _Callable(ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``arcsplit.tune(model, ...)``: see arcsplit/_api.py's tune."""
        from .._api import tune  # start-up: the API imports this package (its TuneResult), so not at the top

        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
