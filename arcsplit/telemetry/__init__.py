"""Telemetry: what each card, process and llama-server is doing now, usable without the dashboard.

    tel = Telemetry()
    data = await tel.sample(sup.status())      # one sample: {"time", "cards", "processes", "server"}
    await run_telemetry(sup, interval=2.0)     # publishes Event("telemetry", "group", data) until cancelled

Sources by card backend: Intel (sycl, vulkan on an Intel card) -> fdinfo/sysfs/hwmon (intel.py), CUDA -> NVML
(nvidia.py, optional), CPU -> psutil of the process that holds the card (cpu.py); a process on another host ->
its node agent's report of CPU seconds, RSS and threads (cpu.RemoteSampler), and a GPU card held there -> that
agent's rows of its host's cards, sampled there by these same samplers (one report a second; older than
STALE_AFTER: no reading); llama-server -> /metrics and /slots (server.py). Each sample is a few file reads and two
local HTTP GETs: no subprocess, no root.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio

from .. import backends
from ..route import holders
from .cpu import ProcessSampler, RemoteSampler, cpu_card, threads_of
from .intel import IntelSampler
from .nvidia import NvidiaSampler
from .server import ServerSampler

__all__ = ["Telemetry", "sample", "run_telemetry"]

_INTEL_BACKENDS = tuple(n for n, b in backends.REGISTRY.items() if b.sampler == "intel")
STALE_AFTER = 5.0  # s: a remote card's report older than this (its agent sends one a second) is no reading


def _elsewhere(proc: dict[str, Any]) -> bool:
    """Whether a status process runs on another host (a link names its host but runs here)."""
    return bool(proc.get("host")) and proc.get("role") != "link"


def card_row(card: dict[str, Any], pos: int, intel: dict[str, dict[str, Any]] | None,
             nvidia: dict[int, dict[str, Any]] | None) -> dict[str, Any] | None:
    """A GPU plan card's row among one host's sampled cards: Intel by the card's PCI address, else the i-th Intel
    card of that host by PCI address (Level Zero's order); CUDA by index. None: no reading of it."""
    backend = card.get("backend")
    if backend in _INTEL_BACKENDS and intel:
        pdev = card.get("pci")
        if pdev not in intel:
            order = sorted(intel)
            idx = int(card.get("index", pos))
            pdev = order[idx] if idx < len(order) else None
        return intel.get(pdev) if pdev else None
    if backend == "cuda" and nvidia:
        return nvidia.get(int(card.get("index", pos)))
    return None


class Telemetry:
    """Samplers with their previous counters; one instance per watched group."""

    def __init__(self, *, sys_root: Path = Path("/sys/class/drm"), proc_root: Path = Path("/proc"),
                 nvml: bool = True) -> None:
        self._sys_root, self._proc_root, self._want_nvml = sys_root, proc_root, nvml
        self._intel: IntelSampler | None = None
        self._nvidia: NvidiaSampler | None = None
        self._procs = ProcessSampler()
        self._remote = RemoteSampler()
        self._server: ServerSampler | None = None

    def _intel_sampler(self) -> IntelSampler:
        if self._intel is None:
            self._intel = IntelSampler(self._sys_root, self._proc_root)
        return self._intel

    def _nvidia_sampler(self) -> NvidiaSampler | None:
        if self._nvidia is None and self._want_nvml:
            self._nvidia = NvidiaSampler()
        return self._nvidia

    async def sample(self, status: dict[str, Any]) -> dict[str, Any]:
        procs_status: dict[str, dict[str, Any]] = status.get("processes") or {}
        pids = {name: p["pid"] for name, p in procs_status.items()  # another host's pid is not one of ours
                if p.get("pid") and p.get("state") not in ("exited", "stopped", "failed", "new")
                and not _elsewhere(p)}
        procs = {**self._procs.sample(pids), **self._remote.sample(procs_status)}  # the others: their agents' word
        cards = (status.get("plan") or {}).get("cards") or []
        held_by = holders(status)
        held = [procs_status.get(held_by[pos] if pos < len(held_by) else "") or {} for pos in range(len(cards))]
        here = [c for c, h in zip(cards, held) if not _elsewhere(h)]
        rows: list[dict[str, Any]] = []
        intel = nvidia = None
        if any(c.get("backend") in _INTEL_BACKENDS for c in here):
            sampler = self._intel_sampler()
            if sampler.available:
                intel = sampler.sample(pids.values())
        if any(c.get("backend") == "cuda" for c in here):
            nv = self._nvidia_sampler()
            if nv is not None and nv.available:
                nvidia = nv.sample([int(c["index"]) for c in here if c.get("backend") == "cuda"], pids.values())
        now = time.time()
        for pos, (card, by) in enumerate(zip(cards, held)):
            holder = held_by[pos] if pos < len(held_by) else ""
            base = {"pos": pos, "device": card.get("device"), "backend": card.get("backend"), "holder": holder}
            row: dict[str, Any] | None = None
            if card.get("backend") == "cpu" or card.get("device") == "CPU":
                row = cpu_card(procs.get(holder), card.get("free"), threads_of(by.get("argv")))
            elif _elsewhere(by):  # held on another host: its agent's report of that host's cards, if fresh
                report = by.get("gpus")
                if report and now - report["at"] <= STALE_AFTER:
                    row = card_row(card, pos, report["intel"], {int(i): r for i, r in report["cuda"].items()})
            else:
                row = card_row(card, pos, intel, nvidia)
            rows.append({**base, **(row or {"source": None})})
        server = None
        if status.get("state") == "ready" and status.get("url"):
            if self._server is None or self._server.base_url != status["url"].rstrip("/"):
                if self._server is not None:
                    await self._server.aclose()
                self._server = ServerSampler(status["url"])
            server = await self._server.sample()
        return {"time": time.time(), "cards": rows, "processes": procs, "server": server}

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        if self._nvidia is not None:
            self._nvidia.close()


async def sample(status: dict[str, Any], telemetry: Telemetry | None = None) -> dict[str, Any]:
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
    from ..run.events import Event

    tel = telemetry or Telemetry()
    try:
        while True:
            started = time.monotonic()
            try:
                data = await tel.sample(sup.status())
            except Exception as exc:  # telemetry must never take supervision down
                data = {"time": time.time(), "error": f"{type(exc).__name__}: {exc}"}
            sup.events.publish(Event("telemetry", "group", data))
            await anyio.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        with anyio.CancelScope(shield=True):
            await tel.aclose()
