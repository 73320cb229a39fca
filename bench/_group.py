"""How bench/ runs a serving group in its own process: through arcsplit._api's ``prepare`` and ``instance``, the two
steps of ``arcsplit.aserve`` (the internal seam docs/architecture.md names), without the bus or telemetry, so what
is timed is the supervisor and its processes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio

from arcsplit._api import Instance, Prepared, ServeRequest, instance, prepare


def prepared(model: str, **request: Any) -> Prepared:
    """``arcsplit serve MODEL`` with ServeRequest's fields (the CLI's flags, same defaults), checked and planned."""
    return prepare(ServeRequest(model=model, **request))


@asynccontextmanager
async def group(p: Prepared) -> AsyncIterator[Instance]:
    """The group of ``p``, entered once it answers /health 200, stopped (in order) when the block ends."""
    inst = instance(p, bus=False, telemetry=False)
    async with anyio.create_task_group() as tg:
        await tg.start(inst.run)
        try:
            yield inst
        finally:
            inst.stop()
