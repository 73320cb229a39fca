"""The Python API behind ``arcsplit/__init__.py``: plan, serve, aserve, attach (tune is tuning/api.py, load
inproc.py).

The surfaces (the CLI, the dashboard) reach the running side only through this module: ``prepare`` and
``instance`` are the two steps of ``aserve`` for a caller that reports the load itself (``arcsplit serve``),
``runs`` and ``attach`` find and drive instances started elsewhere.
"""

from __future__ import annotations

import os
import warnings
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence

import anyio
from anyio.from_thread import start_blocking_portal

from .decide.choice import RouteChoice
from . import durations
from .errors import ArcsplitError, RunError, python_spelling
from .planner import Plan
from .rig import Rig, load_layout
from .proc.states import GroupState
from .run.bus import BusInfo, Client, attach, list_runs
from .run.events import Event, Status, failure_line
from .decide.routes import RouteEntry
from .run.fallback import route_lines
from .run.instance import Instance, MarkWrong, Watcher
from .run.launch import Launcher
from .decide.prepare import (MODE_CHOICES, OUTPUT_LAYER_CHOICES, Prepared, ServeRequest, planned_specs, prepare,
                          preview)
from .run.supervisor import RestartPolicy, Timeouts
from .run.watchdog import HangPolicy
from .run.systemd import run_notify
from .modes import AUTO
from .tuning import picks
from .tuning.fingerprint import anything_kept

__all__ = ["AsyncServer", "BusInfo", "Client", "Instance", "MODE_CHOICES", "OUTPUT_LAYER_CHOICES", "Prepared",
           "RouteChoice", "Server", "ServeRequest", "aserve", "attach", "instance", "plan", "planned_specs", "prepare", "preview",
           "failure_line", "route_lines", "runs", "serve", "wrong_marker"]


def plan(model: str | os.PathLike[str], gpus: Sequence[int] | str | None = None, *, backend: str = "auto",
         ctx: int | None = None, parallel: int = 1, cache_type: str = "f16", ubatch: int | None = None,
         layout: str | os.PathLike[str] | None = None, cpu_memory_mib: int | None = None,
         mode: str = "auto", llama_dir: str | None = None, build: str | None = None,
         moe_offload: int | None = None, host_memory_mib: int | None = None, measure: bool = False) -> Plan:
    """Where every layer goes and what each card must hold; ``layout`` plans for a rig you do not have.

    The plan of the mode ``serve`` would run (``mode="auto"``, as ``arcsplit plan``): its device names, ubatch
    and output placement come from that mode's Route. ``backend`` "auto" picks what ``serve`` would on this
    machine (the cards and the builds present). ``moe_offload``: routed experts of the first N layers in host RAM;
    None (auto): as few as make the model fit, 0: never. Starts nothing and probes nothing, unless ``measure``:
    then llama.cpp's own dry run sizes each card's compute buffer (on the cards, or CPU rpc-servers on 127.0.0.1
    standing in for a layout's; seconds) and is cached for later plans and serve.
    """
    req = ServeRequest(model=str(model), gpus=gpus, backend=backend, mode=mode, ctx=ctx, parallel=parallel,
                       ubatch=ubatch, cache_type=cache_type, cpu_memory_mib=cpu_memory_mib, llama_dir=llama_dir,
                       build=build, moe_offload=moe_offload, host_memory_mib=host_memory_mib, measure=measure)
    with python_spelling():  # an error names plan()'s arguments, not the CLI's flags
        return preview(req, load_layout(os.fspath(layout)) if layout is not None else None).config.plan


class AsyncServer:
    """A served model, in the caller's event loop: ``url``, ``plan``, ``status()``, ``restart()``, ``events()``."""

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    @property
    def url(self) -> str:
        return self._instance.url

    @property
    def plan(self) -> Plan:
        return self._instance.supervisor.config.plan

    @property
    def mode(self) -> str:
        return self._instance.supervisor.config.mode

    @property
    def run_id(self) -> str:
        return self._instance.run_id

    def status(self) -> Status:
        return self._instance.supervisor.status()

    def logs(self, name: str | None = None, n: int = 100) -> list[str]:
        return self._instance.supervisor.logs(name, n)

    async def restart(self) -> None:
        """Stop the group in order and start it again; returns once it answers again."""
        sup = self._instance.supervisor
        generation = sup.status()["generation"]
        await sup.restart()
        while not (sup.status()["generation"] > generation and sup.status()["state"] is GroupState.READY):
            if sup.status()["state"] is GroupState.STOPPED:
                raise RunError("the group stopped instead of restarting", "see server.status()['last_error']")
            await anyio.sleep(0.05)

    async def events(self, max_buffer: int = 1000) -> AsyncIterator[Event]:
        """Every event from now on; a consumer that falls behind loses events rather than slowing the group."""
        async with self._instance.supervisor.subscribe(max_buffer) as stream:
            async for ev in stream:
                yield ev

    def stop(self) -> None:
        self._instance.stop()


def _tuned(req: ServeRequest) -> ServeRequest:
    """``req`` as tune's kept pick for its rig runs it (mode auto only, with the next-best routes after it), else
    with what tune kept for the rig: the routes it found wrong and its answer for the output canary."""
    got = picks.tuned(req)
    return picks.remembered(req) if got is None else got[0]


def wrong_marker(req: ServeRequest, rig: Rig | None = None) -> MarkWrong | None:
    """The hook a run calls when its output canary finds a route computing wrong: the route is marked so in tune's
    results for the rig ``req`` names (the user's request, before a tuned pick changed its cards), so that neither
    serve nor tune picks it again. None for a layout with other hosts: tune measures this machine's cards only."""
    if rig is not None and rig.hosts:
        return None

    def mark(route: RouteEntry, evidence: Mapping[str, Any]) -> None:
        picks.mark_wrong(req, route.key, route.config.mode, dict(evidence))

    return mark


def runs() -> list[BusInfo]:
    """The running instances of this user, newest first."""
    return list_runs()


def instance(prepared: Prepared, *, max_restarts: int = 5, stall_timeout: float = 120.0, bus: bool = True,
             bus_tcp: str | None = None, telemetry: bool = True, systemd: bool = False,
             watchers: Sequence[Watcher] = (), say: Callable[[str], None] | None = None,
             launcher: Launcher | None = None, mark_wrong: MarkWrong | None = None, hang_after: float | None = None,
             hang: HangPolicy | None = None) -> Instance:
    """A checked request ready to run (``await inst.run()``); telemetry, when asked, and ``watchers`` watch it.
    ``systemd``: tell systemd about the run (Type=notify, watchdog) when started by it (``arcsplit serve`` is).
    ``launcher``: how members start (default: run/remote.launcher_for, local or with the layout's hosts).
    ``mark_wrong``: what a route the output canary finds computing wrong is marked in (``wrong_marker``).
    ``hang_after``: the progress watchdog's bound in seconds (0: off; None: its default, docs/watchdog.md);
    ``hang``: all of its settings (tests and bench tune its timings)."""
    if systemd:
        watchers = (run_notify, *watchers)
    if telemetry:
        from .telemetry import run_telemetry  # start-up: route, HTTP and samplers, for a run that asks for them

        watchers = (run_telemetry, *watchers)
    return Instance(prepared, policy=RestartPolicy(max_failures=max_restarts),
                    timeouts=Timeouts(stall=stall_timeout, stop_grace=prepared.stop_grace,
                                      hang=_hang_policy(hang, hang_after)),
                    bus=bus, bus_tcp=bus_tcp, watchers=watchers, say=say, launcher=launcher, mark_wrong=mark_wrong)


def _hang_policy(hang: HangPolicy | None, hang_after: float | None) -> HangPolicy:
    """The watchdog's settings: ``hang`` (or the defaults) with ``hang_after`` as its bound, checked as the flag is."""
    policy = hang or HangPolicy()
    if hang_after is None:
        return policy
    after = durations.parse(hang_after, flag="hang_after", allow_zero=True, minimum=5.0, maximum=86400.0)
    return replace(policy, after=after)


@asynccontextmanager
async def aserve(model: str | os.PathLike[str], gpus: Sequence[int] | str | None = (0, 1), *,
                 bus: bool = True, bus_tcp: str | None = None, max_restarts: int = 5, stall_timeout: float = 120.0,
                 tuned: bool = True, hang_after: float | None = None, **options: Any) -> AsyncIterator[AsyncServer]:
    """Serve ``model`` across ``gpus`` until the block ends; entered once llama-server answers /health 200.

    ``options`` are ServeRequest's fields: backend, mode, ctx, parallel, host, port, rpc_host, rpc_ports, threads,
    cpu_memory_mib, llama_dir, build, output_layer, rpc_cache, rpc_seed, ubatch, extra_args, stop_grace, canary
    (False: no output canary), canary_every (seconds between its checks while idle; docs/usage.md); and
    ``layout``: a layout TOML whose cards (other hosts' included) are served instead of ``gpus``. With mode auto
    (the default), ``arcsplit tune``'s pick for this rig runs where one is kept, as ``arcsplit serve`` does
    (``status()["choice"]`` says so); ``tuned=False`` or a ``mode`` leaves it out. ``hang_after``: seconds without
    progress, every process alive, before the group is restarted (0: never; None: the default, docs/watchdog.md).
    """
    layout = options.pop("layout", None)
    if layout is not None:
        gpus = None
    asked = req = ServeRequest.of(model, gpus, options)
    with python_spelling():  # an error names aserve()'s arguments, not the CLI's flags
        if tuned and layout is None and req.mode == AUTO and anything_kept():  # tune's own candidates name a mode
            req = _tuned(req)
        rig = load_layout(os.fspath(layout)) if layout is not None else None
        prepared = prepare(req, rig)
    for text in prepared.warnings:
        warnings.warn(text, stacklevel=3)
    inst = instance(prepared, max_restarts=max_restarts, stall_timeout=stall_timeout, bus=bus, bus_tcp=bus_tcp,
                    mark_wrong=wrong_marker(asked, rig), hang_after=hang_after)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(inst.run)
            try:
                yield AsyncServer(inst)
            finally:
                inst.stop()
    except BaseExceptionGroup as group:
        raise _unwrapped(group) from None


def _unwrapped(group: BaseExceptionGroup) -> BaseException:
    """What a caller catches: the one error inside the task group's wrapper (a group that could not start raises
    its RunError, the block's own exception comes out as itself), an ArcsplitError among several, else the group."""
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e)

    walk(group)
    if len(leaves) == 1:
        return leaves[0]
    return next((e for e in leaves if isinstance(e, ArcsplitError)), group)


class Server:
    """A served model for synchronous code; the group runs on a private event-loop thread."""

    def __init__(self, portal: Any, inner: AsyncServer) -> None:
        self._portal = portal
        self._inner = inner

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def plan(self) -> Plan:
        return self._inner.plan

    @property
    def mode(self) -> str:
        return self._inner.mode

    @property
    def run_id(self) -> str:
        return self._inner.run_id

    def status(self) -> dict[str, Any]:
        return self._portal.call(self._inner.status)

    def logs(self, name: str | None = None, n: int = 100) -> list[str]:
        return self._portal.call(self._inner.logs, name, n)

    def restart(self) -> None:
        self._portal.call(self._inner.restart)

    def events(self, kinds: tuple[str, ...] | None = None, timeout: float | None = None,
               idle: float | None = None) -> Iterator[dict[str, Any]]:
        """A snapshot, then every later event as a bus message dict (see docs/bus.md), for ``timeout`` s in all
        (None: until the group stops), or until ``idle`` s pass without an event of ``kinds``."""
        with attach(self.run_id) as client:
            yield from client.events(kinds=kinds, timeout=timeout, idle=idle)

    def client(self) -> Client:
        return attach(self.run_id)


@contextmanager
def serve(model: str | os.PathLike[str], gpus: Sequence[int] | str | None = (0, 1), **options: Any) -> Iterator[Server]:
    """``with arcsplit.serve("model.gguf", gpus=[0, 1]) as server:`` — the sync twin of ``aserve``."""
    with start_blocking_portal() as portal:
        cm = aserve(model, gpus, **options)
        with portal.wrap_async_context_manager(cm) as inner:
            yield Server(portal, inner)

