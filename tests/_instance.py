"""A real running arcsplit instance for dashboard and telemetry tests: the Instance `arcsplit serve` runs
(supervisor, bus, telemetry watching it), on an event-loop thread of its own as the Python API runs it, with
the real llama-server / ggml-rpc-server CPU build and the demo model, a quick restart policy and a fast
telemetry interval. Dirs (run dirs, sockets, caches) are pointed at a temp dir by ``isolated_env``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from anyio.from_thread import BlockingPortal, start_blocking_portal

from arcsplit._api import prepare
from arcsplit.cli import build_parser
from arcsplit.cli.serve_run import request_from_args
from arcsplit.run.bus import BusInfo
from arcsplit.run.events import Event, Payload
from arcsplit.run.instance import Instance as RunInstance
from arcsplit.proc.ports import free_port
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

    def publish(self, name: str, data: Payload) -> None:
        """Publish an event from the supervisor's own loop (EventBus is not thread-safe)."""
        self.portal.call(self.sup.events.publish, Event.of(name, data))


def serve_args(model: Path, gpus: str = "0,1", mode: str = "auto", ctx: int = 1024, *more: str) -> Any:
    return build_parser().parse_args(["serve", str(model), "--backend", "cpu", "--gpus", gpus, "--ctx", str(ctx),
                                      "--threads", "1", "--mode", mode, "--port", str(free_port()), *more])


@contextlib.contextmanager
def running_instance(model: Path, *, gpus: str = "0,1", mode: str = "auto",
                     telemetry_interval: float | None = 0.5, canary: bool = True) -> Iterator[Instance]:
    """Start the group and its bus; yield once it serves; stop everything on exit. ``canary`` False: no output
    canary (its checks add to llama-server's own token counters)."""
    prepared = prepare(request_from_args(serve_args(model, gpus, mode, 1024, *(() if canary else ("--no-canary",)))))
    watchers = (functools.partial(run_telemetry, interval=telemetry_interval),) if telemetry_interval else ()
    inst = RunInstance(prepared, policy=RestartPolicy(base_delay=0.2, max_delay=1.0, max_failures=3),
                       watchers=watchers)
    with start_blocking_portal() as portal:
        future, _url = portal.start_task(inst.run)
        try:
            assert inst.bus_info is not None
            yield Instance(inst.supervisor, inst.bus_info, portal)
        finally:
            portal.call(inst.stop)
            future.result(timeout=60)
