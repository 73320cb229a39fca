"""Telemetry: what each card, process and llama-server is doing now, usable without the dashboard.

    tel = Telemetry()
    data = await tel.sample(sup.status())      # one sample: {"time", "cards", "processes", "server"}
    await run_telemetry(sup, interval=2.0)     # publishes Event("telemetry", "group", data) until cancelled

Sources by card backend: Intel (sycl, vulkan on an Intel card) -> fdinfo/sysfs/hwmon (intel.py), CUDA -> NVML
(nvidia.py, optional), CPU -> psutil of the process that holds the card (cpu.py); a process on another host ->
its node agent's report of CPU seconds, RSS and threads (cpu.RemoteSampler; that host's GPU use is not reported);
llama-server -> /metrics and /slots (server.py). Each sample is a few file reads and two local HTTP GETs: no
subprocess, no root.
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
                and not (p.get("host") and p.get("role") != "link")}
        procs = {**self._procs.sample(pids), **self._remote.sample(procs_status)}  # the others: their agents' word
        cards = (status.get("plan") or {}).get("cards") or []
        rows: list[dict[str, Any]] = []
        intel = nvidia = None
        if any(c.get("backend") in _INTEL_BACKENDS for c in cards):
            sampler = self._intel_sampler()
            if sampler.available:
                intel = sampler.sample(pids.values())
        if any(c.get("backend") == "cuda" for c in cards):
            nv = self._nvidia_sampler()
            if nv is not None and nv.available:
                nvidia = nv.sample([int(c["index"]) for c in cards if c.get("backend") == "cuda"], pids.values())
        intel_order = sorted(intel) if intel else []
        held_by = holders(status)
        for pos, card in enumerate(cards):
            holder = held_by[pos] if pos < len(held_by) else ""
            base = {"pos": pos, "device": card.get("device"), "backend": card.get("backend"), "holder": holder}
            row: dict[str, Any] | None = None
            backend = card.get("backend")
            if backend == "cpu" or card.get("device") == "CPU":
                argv = (procs_status.get(holder) or {}).get("argv")
                row = cpu_card(procs.get(holder), card.get("free"), threads_of(argv))
            elif backend in _INTEL_BACKENDS and intel:
                pdev = card.get("pci")
                if pdev not in intel:
                    idx = int(card.get("index", pos))
                    pdev = intel_order[idx] if idx < len(intel_order) else None
                row = intel.get(pdev) if pdev else None
            elif backend == "cuda" and nvidia:
                row = nvidia.get(int(card.get("index", pos)))
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
