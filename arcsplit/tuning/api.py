"""``arcsplit.tune()``: the Python API's tune, beside the runner it calls (arcsplit/__init__.py imports it on first
use). It lives here, not in arcsplit/_api.py, because the runner serves each candidate through that module: the
dependency runs one way, tune -> runner -> API.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from ..decide.prepare import ServeRequest
from ..errors import python_spelling
from .result import TuneResult
from .runner import run_from


def tune(model: str | os.PathLike[str], gpus: Sequence[int] | str | None = None, *, objective: str = "decode",
         budget_s: float = 300.0, per_candidate_s: float = 15.0, settings: bool = True, fresh: bool = False,
         progress: Callable[[str], None] | None = None, **options: Any) -> TuneResult:
    """Serve every route this build and these cards allow (then a few settings on the best), check each one's
    output against a reference, measure it, and keep the best correct one by ``objective`` (decode, prefill,
    streams: all ``parallel`` slots busy, or ttft: the shortest time to first token) for this rig's fingerprint,
    where ``arcsplit serve`` then finds it.

    As ``arcsplit tune`` (docs/tune.md): within ``budget_s`` seconds, each started candidate measured for
    ``per_candidate_s``; ``settings`` False tries the routes only; ``fresh`` measures again what an earlier run
    kept. ``progress`` hears each step as one line. ``options`` are ServeRequest's fields (backend, ctx, parallel,
    llama_dir, build, cache_type, ...; not mode: tune tries every mode). Bad input is a BadInput, as on the CLI.
    """
    with python_spelling():  # an error names tune()'s arguments, not the CLI's flags
        return run_from(ServeRequest.of(model, gpus, options), objective, budget_s, per_candidate_s,
                        settings=settings, fresh=fresh, say=progress or (lambda line: None)).result()
