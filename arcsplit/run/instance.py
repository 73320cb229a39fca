"""One running arcsplit instance: the supervisor, its bus and the tasks that watch it, in one task group.

The bus starts before the group so a dashboard can watch the load, and stops after the group has stopped
(it forwards the supervisor's events up to the last, "stopped"). Watchers (telemetry) are given by the caller:
they subscribe to the run, the run does not know them.
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine, Sequence

import anyio
from anyio.abc import TaskStatus

from ..decide.prepare import Prepared, hybrid_fallback
from ..errors import ArcsplitError
from ..proc.rundir import RunDir
from .bus import BusInfo, BusServer
from .launch import Launcher
from .remote import launcher_for
from .supervisor import RestartPolicy, Supervisor, Timeouts

Watcher = Callable[[Supervisor], Coroutine[Any, Any, None]]
BUS_DRAIN_S = 5.0  # after the group stopped, the bus gets this long to pass on its last events


class Instance:
    """Runs a Prepared request until stopped; ``run`` reports started() once the group first answers 200."""

    def __init__(self, prepared: Prepared, *, policy: RestartPolicy = RestartPolicy(),
                 timeouts: Timeouts = Timeouts(), bus: bool = True, bus_tcp: str | None = None,
                 watchers: Sequence[Watcher] = (), say: Callable[[str], None] | None = None,
                 launcher: Launcher | None = None) -> None:
        self.prepared = prepared
        self.run_dir = RunDir.create()
        self.run_id = self.run_dir.path.name
        self.supervisor = Supervisor(prepared.config, run_dir=self.run_dir, policy=policy, timeouts=timeouts,
                                     fallback=hybrid_fallback(prepared, say),
                                     decision={"mode": prepared.decision.mode,
                                               "reasons": list(prepared.decision.reasons)},
                                     choice=prepared.choice,
                                     launcher=launcher or launcher_for(prepared.config))
        self._bus = bus
        self._bus_tcp = bus_tcp
        self._watchers = tuple(watchers)
        self._say = say
        self.bus_info: BusInfo | None = None
        self._failure: ArcsplitError | None = None

    @property
    def url(self) -> str:
        return self.supervisor.url

    def stop(self) -> None:
        self.supervisor.stop()

    async def _supervise(self, task_status: TaskStatus[Any]) -> None:
        """The supervisor's run beside the watchers; its ArcsplitError kept for after the bus has said "stopped"."""
        async with anyio.create_task_group() as side:
            for watch in self._watchers:
                side.start_soon(watch, self.supervisor)
            try:
                await self.supervisor.run(task_status=task_status)
            except ArcsplitError as exc:
                self._failure = exc
            finally:
                side.cancel_scope.cancel()

    async def run(self, *, task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        sup = self.supervisor
        failure: ArcsplitError | None = None
        async with anyio.create_task_group() as tg:
            if self._bus:
                server = BusServer(sup, self.run_dir.path, self.run_id, tcp=self._bus_tcp, url=sup.url,
                                   model=self.prepared.config.plan.model_path, say=self._say)
                try:
                    self.bus_info = await tg.start(server.run)
                except ArcsplitError as exc:  # a bus that cannot bind: its one line, as itself, nothing started
                    failure = exc
            if failure is None:
                await self._supervise(task_status)
            # The supervisor has closed its event stream: the bus ends by itself once it has sent the rest.
            tg.cancel_scope.deadline = anyio.current_time() + BUS_DRAIN_S
        failure = failure or self._failure
        if failure is not None:
            raise failure
