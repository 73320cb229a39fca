"""NVIDIA telemetry through NVML (``nvidia-ml-py``, optional): no package or no driver -> not available, no error."""

from __future__ import annotations

from typing import Any, Iterable


class NvidiaSampler:
    def __init__(self) -> None:
        self._nvml: Any = None
        self.reason: str | None = None
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML: {exc}"
            return
        self._nvml = pynvml

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def count(self) -> int:
        """How many cards NVML sees (0 when it cannot say)."""
        if self._nvml is None:
            return 0
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except Exception:
            return 0

    def sample(self, indices: Iterable[int], pids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """CUDA index -> {used (by our pids), total, util, temp, power}; a failed read leaves that field None."""
        if self._nvml is None:
            return {}
        nv = self._nvml
        ours = set(pids)
        out: dict[int, dict[str, Any]] = {}
        for index in indices:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(index)
            except Exception:
                continue
            row: dict[str, Any] = {"source": "nvml", "used": None, "total": None, "util": None, "temp": None,
                                   "power": None}
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                row["total"] = int(mem.total)
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
                row["used"] = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in ours)
            except Exception:
                pass
            for key, call in (("util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                              ("temp", lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                              ("power", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)):
                try:
                    row[key] = call()
                except Exception:
                    pass
            out[index] = row
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
