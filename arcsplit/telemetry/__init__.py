"""Telemetry: what each card, process and llama-server is doing now, usable without the dashboard.

    tel = Telemetry()
    data = await tel.sample(sup.status())      # one sample (TelemetryData): {"time", "cards", "processes", "server"}
    await run_telemetry(sup, interval=2.0)     # publishes Event("telemetry", "group", data) until cancelled

Sources by card backend (its Backend.sampler): Intel (sycl, vulkan on an Intel card) -> fdinfo/sysfs/hwmon
(intel.py), CUDA -> NVML (nvidia.py, optional), CPU -> psutil of the process that holds the card (cpu.py); a process on another host ->
its node agent's report of CPU seconds, RSS and threads (cpu.RemoteSampler), and a GPU card held there -> that
agent's rows of its host's cards, sampled there by these same samplers (one report a second; older than
STALE_AFTER: no reading); llama-server -> /metrics and /slots (server.py). Each sample is a few file reads and two
local HTTP GETs: no subprocess, no root.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import anyio

from .. import backends
from ..route import HOST_DEVICE, holders
from ..run.events import Event, TelemetryData, TelemetryError
from ..proc.states import GroupState, MemberState
from ..roles import Role
from ..samples import CardRow, CardSample, CardSampler, GpuReport
from .cpu import ProcessSampler, RemoteSampler, cpu_card, threads_of
from .server import ServerSampler

__all__ = ["Telemetry", "sample", "run_telemetry"]

STALE_AFTER = 5.0  # s: a remote card's report older than this (its agent sends one a second) is no reading
_RUNNING = (MemberState.STARTING, MemberState.READY, MemberState.STOPPING)  # states with a process to sample


def _elsewhere(proc: dict[str, Any]) -> bool:
    """Whether a status process runs on another host (a link names its host but runs here)."""
    return bool(proc.get("host")) and proc.get("role") != Role.LINK


def _is_cpu(card: dict[str, Any]) -> bool:
    """A CPU card (its holder's share of the CPU), or llama-server's own CPU in a hybrid group."""
    be = backends.REGISTRY.get(str(card.get("backend")))
    return card.get("device") == HOST_DEVICE or (be is not None and be.sampler is None)


def _sampler_of(card: dict[str, Any]) -> backends.Backend | None:
    """A plan card's backend, if a sampler reads its cards (Backend.sampler); None: none does."""
    be = backends.REGISTRY.get(str(card.get("backend")))
    return None if be is None or _is_cpu(card) else be


class Telemetry:
    """Samplers with their previous counters; one instance per watched group."""

    def __init__(self, *, sys_root: Path = Path("/sys/class/drm"), proc_root: Path = Path("/proc"),
                 nvml: bool = True) -> None:
        self._sys_root, self._proc_root, self._want_nvml = sys_root, proc_root, nvml
        self._cards: dict[str, CardSampler] = {}  # by Backend.sampler
        self._procs = ProcessSampler()
        self._remote = RemoteSampler()
        self._server: ServerSampler | None = None

    def _sampler(self, be: backends.Backend) -> CardSampler:
        """This machine's sampler of ``be``'s cards (one per sampler: sycl and vulkan share Intel's)."""
        key, cls = str(be.sampler), be.sampler_class()
        if key not in self._cards and cls is not None:
            self._cards[key] = cls.create(self._sys_root, self._proc_root, self._want_nvml)
        return self._cards[key]

    def _local_rows(self, here: Sequence[dict[str, Any]], pids: list[int]) -> dict[str, dict[str, CardSample]]:
        """This machine's readings by Backend.sampler, of the samplers the plan's cards here need."""
        wanted: dict[str, tuple[backends.Backend, list[int]]] = {}
        for card in here:
            be = _sampler_of(card)
            if be is not None:
                wanted.setdefault(str(be.sampler), (be, []))[1].append(int(card.get("index", 0)))
        out: dict[str, dict[str, CardSample]] = {}
        for key, (be, indices) in wanted.items():
            sampler = self._sampler(be)
            if sampler.available:
                out[key] = sampler.sample(indices, pids)
        return out

    def _card(self, card: dict[str, Any], pos: int, by: dict[str, Any], proc: dict[str, Any] | None,
              local: dict[str, dict[str, CardSample]], now: float) -> CardSample | None:
        """One plan card's reading: its holder's use (CPU), its host agent's report, or this machine's sampler."""
        if _is_cpu(card):
            return cpu_card(proc, card.get("free"), threads_of(by.get("argv")))
        be = _sampler_of(card)
        cls = be.sampler_class() if be is not None else None
        if be is None or cls is None:
            return None
        if _elsewhere(by):  # held on another host: its agent's report of that host's cards, if fresh
            raw = by.get("gpus")
            report = GpuReport.from_dict(raw) if raw else None
            if report is None or now - report.at > STALE_AFTER:
                return None
            return cls.match(card, pos, report.rows.get(cls.kind) or {})
        rows = local.get(str(be.sampler))
        return cls.match(card, pos, rows) if rows else None

    async def sample(self, status: dict[str, Any]) -> TelemetryData:
        """One sample of a group's status: each plan card's reading, each process's use, llama-server's metrics."""
        procs_status: dict[str, dict[str, Any]] = status.get("processes") or {}
        pids = {name: p["pid"] for name, p in procs_status.items()  # another host's pid is not one of ours
                if p.get("pid") and p.get("state") in _RUNNING and not _elsewhere(p)}
        procs = {**self._procs.sample(pids), **self._remote.sample(procs_status)}  # the others: their agents' word
        cards = (status.get("plan") or {}).get("cards") or []
        held_by = holders(status)
        held = [procs_status.get(held_by[pos] if pos < len(held_by) else "") or {} for pos in range(len(cards))]
        local = self._local_rows([c for c, h in zip(cards, held) if not _elsewhere(h)], list(pids.values()))
        now = time.time()
        rows = []
        for pos, (card, by) in enumerate(zip(cards, held)):
            holder = held_by[pos] if pos < len(held_by) else ""
            reading = self._card(card, pos, by, procs.get(holder), local, now)
            rows.append(CardRow(pos, card.get("device"), card.get("backend"), holder, reading or CardSample(None)))
        server = None
        if status.get("state") == GroupState.READY and status.get("url"):
            if self._server is None or self._server.base_url != status["url"].rstrip("/"):
                if self._server is not None:
                    await self._server.aclose()
                self._server = ServerSampler(status["url"])
            server = await self._server.sample()
        return TelemetryData(time=time.time(), cards=tuple(rows), processes=procs, server=server)

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        for sampler in self._cards.values():
            sampler.close()


async def sample(status: dict[str, Any], telemetry: Telemetry | None = None) -> TelemetryData:
    """One sample of a group's status (rates need two samples from one Telemetry, so pass it to keep them)."""
    tel = telemetry or Telemetry()
    try:
        return await tel.sample(status)
    finally:
        if telemetry is None:
            await tel.aclose()


async def run_telemetry(sup: Any, interval: float = 2.0, telemetry: Telemetry | None = None) -> None:
    """Sample ``sup.status()`` every ``interval`` s and publish ``Event("telemetry", "group", data)``.

    Runs beside the supervisor until cancelled; nothing it reads can raise out of it.
    """
    tel = telemetry or Telemetry()
    try:
        while True:
            started = time.monotonic()
            data: TelemetryData | TelemetryError
            try:
                data = await tel.sample(sup.status())
            except Exception as exc:  # telemetry must never take supervision down
                data = TelemetryError(time=time.time(), error=f"{type(exc).__name__}: {exc}")
            sup.events.publish(Event("telemetry", "group", data))
            await anyio.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        with anyio.CancelScope(shield=True):
            await tel.aclose()
