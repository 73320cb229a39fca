"""A real running arcsplit instance for dashboard and telemetry tests: Supervisor + BusServer + telemetry.

The serving command will wire these three together; until then tests run them here, on an event-loop
thread of their own (as the Python API will), with the real llama-server / ggml-rpc-server CPU build and the
demo model. Dirs (run dirs, sockets, caches) are pointed at a temp dir by ``isolated_env``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from arcsplit.cli import build_parser
from arcsplit.cli.serve import build_config
from arcsplit.run.bus import BusInfo, BusServer
from arcsplit.run.ports import free_port
from arcsplit.run.rundir import RunDir, new_run_id
from arcsplit.run.supervisor import RestartPolicy, Supervisor
from arcsplit.telemetry import run_telemetry

ENV_KEYS = ("ARCSPLIT_STATE_DIR", "ARCSPLIT_CACHE_DIR", "ARCSPLIT_RUNTIME_DIR", "ARCSPLIT_LLAMA_DIR")


@contextlib.contextmanager
def isolated_env(root: Path, llama_dir: Path) -> Iterator[Path]:
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ["ARCSPLIT_STATE_DIR"] = str(root / "state")
    os.environ["ARCSPLIT_CACHE_DIR"] = str(root / "cache")
    os.environ["ARCSPLIT_RUNTIME_DIR"] = str(root / "rt")
    os.environ["ARCSPLIT_LLAMA_DIR"] = str(llama_dir)
    try:
        yield root
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Instance:
    sup: Supervisor
    info: BusInfo
    portal: BlockingPortal

    @property
    def url(self) -> str:
        return self.sup.url

    def publish(self, kind: str, name: str, data: dict[str, Any]) -> None:
        """Publish an event from the supervisor's own loop (EventBus is not thread-safe)."""
        from arcsplit.run.events import Event

        self.portal.call(self.sup.events.publish, Event(kind, name, data))


def config_for(model: Path, gpus: str = "0,1", mode: str = "auto", ctx: int = 1024) -> Any:
    args = build_parser().parse_args(["serve", str(model), "--backend", "cpu", "--gpus", gpus, "--ctx", str(ctx),
                                      "--threads", "1", "--mode", mode, "--port", str(free_port())])
    config, _decision, _profile, _rig = build_config(args)
    return config


@contextlib.contextmanager
def running_instance(model: Path, *, gpus: str = "0,1", mode: str = "auto",
                     telemetry_interval: float | None = 0.5) -> Iterator[Instance]:
    """Start the group and its bus; yield once it serves; stop everything on exit."""
    config = config_for(model, gpus, mode)
    run_id = new_run_id() + "-" + os.urandom(2).hex()
    run_dir = RunDir.create(run_id)
    sup = Supervisor(config, run_dir=run_dir, policy=RestartPolicy(base_delay=0.2, max_delay=1.0, max_failures=3))
    bus = BusServer(sup, run_dir.path, run_id, url=config.url, model=str(model))

    async def main(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            info = await tg.start(bus.run)
            if telemetry_interval:
                tg.start_soon(run_telemetry, sup, telemetry_interval)
            await tg.start(sup.run)
            task_status.started(info)
            await sup.wait_stopped()
            tg.cancel_scope.cancel()

    with start_blocking_portal() as portal:
        future, info = portal.start_task(main)
        try:
            yield Instance(sup, info, portal)
        finally:
            portal.call(sup.stop)
            future.result(timeout=60)
