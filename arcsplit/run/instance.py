"""One running arcsplit instance: the supervisor, its bus and its telemetry, in one task group.

The bus starts before the group so a dashboard can watch the load; it stops after the group has stopped.
"""

from __future__ import annotations

from typing import Any, Callable

import anyio
from anyio.abc import TaskStatus

from .bus import BusInfo, BusServer
from .prepare import Prepared, hybrid_fallback
from .rundir import RunDir
from .supervisor import RestartPolicy, Supervisor, Timeouts
from .systemd import run_notify


class Instance:
    """Runs a Prepared request until stopped; ``run`` reports started() once the group first answers 200."""

    def __init__(self, prepared: Prepared, *, policy: RestartPolicy = RestartPolicy(),
                 timeouts: Timeouts = Timeouts(), bus: bool = True, bus_tcp: str | None = None,
                 telemetry: bool = True, metrics_port: int | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.prepared = prepared
        self.run_dir = RunDir.create()
        self.run_id = self.run_dir.path.name
        self.supervisor = Supervisor(prepared.config, run_dir=self.run_dir, policy=policy, timeouts=timeouts,
                                     fallback=hybrid_fallback(prepared, say),
                                     decision={"mode": prepared.decision.mode,
                                               "reasons": list(prepared.decision.reasons)})
        self._bus = bus
        self._bus_tcp = bus_tcp
        self._telemetry = telemetry
        self._metrics_port = metrics_port
        self.bus_info: BusInfo | None = None
        self.metrics_url: str | None = None

    @property
    def url(self) -> str:
        return self.supervisor.url

    def stop(self) -> None:
        self.supervisor.stop()

    async def run(self, *, task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        sup = self.supervisor
        metrics = None
        if self._metrics_port is not None:  # bound first: a taken port fails before any process starts
            from ..telemetry.prometheus import MetricsEndpoint

            metrics = MetricsEndpoint(sup, self.prepared.config.host, self._metrics_port)
            self.metrics_url = metrics.url
        try:
            async with anyio.create_task_group() as tg:
                if metrics is not None:
                    tg.start_soon(metrics.run)
                if self._bus:
                    server = BusServer(sup, self.run_dir.path, self.run_id, tcp=self._bus_tcp, url=sup.url,
                                       model=self.prepared.config.plan.model_path)
                    self.bus_info = await tg.start(server.run)
                if self._telemetry:
                    runner = _telemetry_runner()
                    if runner is not None:
                        tg.start_soon(runner, sup)
                await tg.start(run_notify, sup)  # systemd Type=notify; nothing without $NOTIFY_SOCKET
                try:
                    await sup.run(task_status=task_status)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            if metrics is not None:
                await metrics.aclose()


def _telemetry_runner() -> Any:
    """The telemetry task, when that module is present (it samples cards and processes every few seconds)."""
    try:
        from ..telemetry import run_telemetry
    except ImportError:
        return None
    return run_telemetry
