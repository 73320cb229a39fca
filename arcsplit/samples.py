"""One card's telemetry reading, as every sampler makes it and every reader takes it. Pure: no I/O.

``CardSample`` is the row the local samplers (telemetry/cpu.py, intel.py, nvidia.py) return, a node agent sends
for its host's cards (node/agent.py, inside its ``stats`` line), the supervisor keeps in a remote member's status
(``GpuReport``), telemetry publishes per plan card (``CardRow``), and the dashboard and Prometheus read back from
the bus. On the wire it is a flat JSON object ({"source", "used", "total", "util", "temp", "power"}, Intel's DRM
details beside them); ``to_dict``/``from_dict`` are the only places that know that shape.

``CardSampler`` is what a backend's sampler (``Backend.sampler``, "module:Class") implements;
``Backend.sampler_class()`` imports it at its first use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Protocol, Sequence

__all__ = ["NO_READING", "CardRow", "CardSample", "CardSampler", "DrmDetail", "GpuReport"]


@dataclass(frozen=True)
class DrmDetail:
    """What Intel's DRM interfaces add to a reading (telemetry/intel.py): the card, its memory resident in VRAM,
    clocks, every temperature channel, how many of our clients use it."""

    card: str  # "card1"
    pdev: str  # PCI address, as fdinfo's drm-pdev
    resident: int
    freq: int | None
    freq_max: int | None
    temps: dict[str, float]
    clients: int


@dataclass(frozen=True)
class CardSample:
    """One card's reading now. ``source`` names the sampler ("xe", "i915", "nvml", "psutil"); None: no reading.
    A field a sampler cannot read is None. Adding a metric: a field here (and in ``to_dict``/``from_dict``), the
    samplers that read it, then the dashboard (tui/widgets.py) and Prometheus (telemetry/prometheus.py)."""

    source: str | None
    used: int | None = None  # bytes our processes use on it (a CPU card: its holder's RSS)
    total: int | None = None  # bytes of card memory (a CPU card: its budget)
    util: float | None = None  # busiest engine, 0..1
    temp: float | None = None  # °C
    power: float | None = None  # W
    drm: DrmDetail | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire row: {"source": None} alone when there is no reading."""
        if self.source is None:
            return {"source": None}
        row: dict[str, Any] = {"source": self.source, "used": self.used, "total": self.total, "util": self.util,
                               "temp": self.temp, "power": self.power}
        if self.drm is not None:
            row.update(asdict(self.drm))
        return row

    @classmethod
    def from_dict(cls, row: Mapping[str, Any] | None) -> "CardSample":
        """A wire row back (another version's extra keys are ignored; a missing one is None)."""
        row = row or {}
        drm = None
        if row.get("pdev") is not None:
            drm = DrmDetail(card=str(row.get("card") or ""), pdev=str(row["pdev"]), resident=int(row.get("resident") or 0),
                            freq=row.get("freq"), freq_max=row.get("freq_max"), temps=dict(row.get("temps") or {}),
                            clients=int(row.get("clients") or 0))
        return cls(source=row.get("source"), used=row.get("used"), total=row.get("total"), util=row.get("util"),
                   temp=row.get("temp"), power=row.get("power"), drm=drm)


NO_READING = CardSample(source=None)


@dataclass(frozen=True)
class CardRow:
    """One plan card in a telemetry sample: where it is in the plan, who holds it, and its reading."""

    pos: int
    device: str | None
    backend: str | None
    holder: str
    sample: CardSample = NO_READING

    def to_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "device": self.device, "backend": self.backend, "holder": self.holder,
                **self.sample.to_dict()}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> "CardRow":
        return cls(int(row.get("pos") or 0), row.get("device"), row.get("backend"), str(row.get("holder") or ""),
                   CardSample.from_dict(row))


# Keys every report carries, empty or not: the two sampler kinds arcsplit shipped with (docs/multihost.md).
_REPORT_KINDS = ("intel", "cuda")


@dataclass(frozen=True)
class GpuReport:
    """Another host's cards as its node agent last sampled them (this machine cannot read them): per sampler kind
    (``CardSampler.kind``: "intel" by PCI address, "cuda" by index), each card's row, memory counted for that
    agent's processes only; ``at``: when the report arrived here (time.time()), one a second."""

    rows: Mapping[str, Mapping[str, CardSample]]
    at: float

    def to_dict(self) -> dict[str, Any]:
        """The ``gpus`` of a remote member's status: {"intel": {...}, "cuda": {...}, <other kinds>, "at"}."""
        kinds: dict[str, Mapping[str, CardSample]] = {k: {} for k in _REPORT_KINDS}
        kinds.update(self.rows)
        return {**{k: {key: r.to_dict() for key, r in v.items()} for k, v in kinds.items()}, "at": self.at}

    @classmethod
    def from_dict(cls, report: Mapping[str, Any], at: float | None = None) -> "GpuReport":
        """An agent's ``gpus`` (``at``: when it arrived) or a status's (its own ``at``)."""
        rows = {str(k): {str(key): CardSample.from_dict(r) for key, r in v.items()}
                for k, v in report.items() if k != "at" and isinstance(v, Mapping)}
        return cls(rows, float(report.get("at", 0.0)) if at is None else at)


class CardSampler(Protocol):
    """Reads one kind of card on this host. Made once per watched group (it keeps counters for rates)."""

    kind: ClassVar[str]  # its rows' key in a node agent's report

    @classmethod
    def create(cls, sys_root: Path, proc_root: Path, nvml: bool) -> "CardSampler":
        """A sampler of this host's cards (``sys_root``: /sys/class/drm; ``nvml``: False keeps NVML closed)."""
        ...

    @property
    def available(self) -> bool: ...

    def sample(self, indices: Sequence[int] | None, pids: Iterable[int]) -> dict[str, CardSample]:
        """Card key -> reading, memory counted for ``pids`` only; ``indices``: the backend's card indices wanted
        (None: every card of its kind here)."""
        ...

    @staticmethod
    def match(card: Mapping[str, Any], pos: int, rows: Mapping[str, CardSample]) -> CardSample | None:
        """The reading of plan card ``card`` (at ``pos``) among one host's rows; None: not among them."""
        ...

    def close(self) -> None: ...
