"""NVIDIA telemetry through NVML (``nvidia-ml-py``, optional): no package or no driver -> not available, no error."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

from ..samples import CardSample


class NvidiaSampler:
    """A samples.CardSampler of CUDA cards, by CUDA index."""

    kind: ClassVar[str] = "cuda"

    def __init__(self, enabled: bool = True) -> None:
        self._nvml: Any = None
        self.reason: str | None = None
        if not enabled:
            self.reason = "NVML is off"
            return
        try:
            import pynvml  # type: ignore[import-not-found]  # optional: only a CUDA host installs it
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML: {exc}"
            return
        self._nvml = pynvml

    @classmethod
    def create(cls, sys_root: Path, proc_root: Path, nvml: bool) -> "NvidiaSampler":
        return cls(enabled=nvml)

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

    def sample(self, indices: Sequence[int] | None, pids: Iterable[int]) -> dict[str, CardSample]:
        """CUDA index (a string, as JSON keys are) -> reading, memory counted for ``pids``; a failed read leaves
        that field None. ``indices`` None: every card NVML sees."""
        if self._nvml is None:
            return {}
        ours = set(pids)
        out: dict[str, CardSample] = {}
        for index in range(self.count()) if indices is None else indices:
            try:
                h = self._nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception:
                continue
            out[str(index)] = self._read(h, ours)
        return out

    def _read(self, h: Any, ours: set[int]) -> CardSample:
        nv = self._nvml
        used = total = None
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            total = int(mem.total)
            used = sum(int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h) if p.pid in ours)
        except Exception:
            pass

        def read(call: Callable[[], float]) -> float | None:
            try:
                return call()
            except Exception:
                return None

        return CardSample(source="nvml", used=used, total=total,
                          util=read(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                          temp=read(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                          power=read(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0))

    @staticmethod
    def match(card: Mapping[str, Any], pos: int, rows: Mapping[str, CardSample]) -> CardSample | None:
        """By the plan card's CUDA index."""
        return rows.get(str(int(card.get("index", pos))))

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
