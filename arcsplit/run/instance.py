"""One running arcsplit instance: the supervisor, its bus and the tasks that watch it, in one task group.

The bus starts before the group so a dashboard can watch the load, and stops after the group has stopped
(it forwards the supervisor's events up to the last, "stopped"). Watchers (telemetry) are given by the caller:
they subscribe to the run, the run does not know them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Coroutine, Mapping, Sequence

import anyio
from anyio.abc import TaskStatus

from ..decide.prepare import Prepared, record_observed
from ..decide.routes import RouteEntry
from ..decide.specs import ServeConfig, split_secrets
from ..errors import ArcsplitError
from ..llama.childenv import SERVER_KEY_VAR
from ..proc.rundir import RunDir
from .bus import BusInfo, BusServer
from .canary import Canary, CanaryPolicy
from .fallback import Leave, RouteMove
from .launch import Launcher
from .remote import launcher_for
from .supervisor import RestartPolicy, Supervisor, Timeouts

Watcher = Callable[[Supervisor], Coroutine[Any, Any, None]]
# The API layer's hook that marks a route "computes wrong" in tune's kept results for this rig (run/ cannot import
# tuning/): the route left and the canary's evidence.
MarkWrong = Callable[[RouteEntry, Mapping[str, Any]], None]
BUS_DRAIN_S = 5.0  # after the group stopped, the bus gets this long to pass on its last events


class Instance:
    """Runs a Prepared request until stopped; ``run`` reports started() once the group first answers 200."""

    def __init__(self, prepared: Prepared, *, policy: RestartPolicy = RestartPolicy(),
                 timeouts: Timeouts = Timeouts(), bus: bool = True, bus_tcp: str | None = None,
                 watchers: Sequence[Watcher] = (), say: Callable[[str], None] | None = None,
                 launcher: Launcher | None = None, mark_wrong: MarkWrong | None = None) -> None:
        self.prepared = prepared
        self.run_dir = RunDir.create()
        self.run_id = self.run_dir.path.name
        req = prepared.request
        self.canary = Canary(CanaryPolicy(every=float(req.canary_every)), req.reference, canary_headers(prepared.config)) \
            if req.canary else None
        self._say = say
        self._mark_wrong = mark_wrong
        self.supervisor = Supervisor(prepared.config, run_dir=self.run_dir, policy=policy, timeouts=timeouts,
                                     routes=prepared.route_list, on_move=self._moved, canary=self.canary,
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

    def _moved(self, move: RouteMove) -> None:
        """A move down the route list: said in one line, and what it teaches kept for later runs: a one-context
        failure in the recorded failures (decide/prepare.py), a route that computes wrong in tune's results."""
        if self._say is not None:
            self._say(move.line())
        cfg = move.left.config
        if move.reason is Leave.MULTI_DEVICE:
            record_observed(cfg.backend, cfg.mode, False, move.message)
        if move.reason is Leave.WRONG and self._mark_wrong is not None:
            evidence = self.canary.mismatch.evidence if self.canary and self.canary.mismatch else None
            try:
                self._mark_wrong(move.left, evidence or {"reason": move.message})
            except (ArcsplitError, OSError, ValueError) as exc:  # the move goes on; the user hears what was not kept
                if self._say is not None:
                    self._say(f"could not mark {move.left.label} as computing wrong in tune's results: {exc}")

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


def canary_headers(config: ServeConfig) -> dict[str, str]:
    """The canary's credentials where llama-server wants a key (--api-key after --, --api-key-file, or
    LLAMA_API_KEY in the environment, which the supervisor passes on to it)."""
    args, secrets = split_secrets(config.extra_args)
    key = dict(secrets).get(SERVER_KEY_VAR) or os.environ.get(SERVER_KEY_VAR)
    if not key and "--api-key-file" in args[:-1]:
        try:
            lines = Path(args[args.index("--api-key-file") + 1]).read_text(encoding="utf-8").split()
            key = lines[0] if lines else None
        except OSError:
            key = None
    return {"Authorization": f"Bearer {key}"} if key else {}
