"""Intel Arc telemetry without root: fdinfo for our own processes, sysfs for the card, hwmon for heat and power.

Formats (the kernel's Documentation/gpu/drm-usage-stats.rst, Documentation/gpu/xe/xe-drm-usage-stats.rst and
the xe driver's sysfs and hwmon ABI, Documentation/ABI/testing/sysfs-driver-intel-xe-hwmon):

- ``/proc/PID/fdinfo/FD`` of a DRM fd: ``drm-pdev``, ``drm-client-id``, ``drm-total-vram0: 23992 KiB``,
  ``drm-resident-vram0``, ``drm-cycles-<cls>``/``drm-total-cycles-<cls>``/``drm-engine-capacity-<cls>`` (xe);
  i915 names its VRAM region ``local0`` and reports ``drm-engine-<cls>: N ns`` instead of cycles.
  One client may be reachable through several fds: count each (pdev, client-id) once.
- ``/sys/class/drm/cardN/device`` -> the PCI device (its name is the BDF); ``vendor`` 0x8086; ``driver`` link;
  ``tile*/physical_vram_size_bytes``; ``tile0/gt0/freq0/act_freq`` (MHz; i915: ``cardN/gt_act_freq_mhz``).
- ``device/hwmon/hwmon*/``: ``tempN_input`` (m°C; ``tempN_label`` pkg/vram, else temp2=pkg, temp3=vram),
  ``energy1_input`` (card) / ``energy2_input`` (pkg) in µJ: watts come from the change between samples.

Every read is a plain file read (no subprocess), and a missing file is "not readable here", never an error.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from ..llama.hostcheck import parse_fdinfo, to_bytes
from ..samples import CardSample, DrmDetail

INTEL_VENDOR = "0x8086"
_CARD_RE = re.compile(r"^card(\d+)$")


def _int(value: str) -> int:
    return int(value.split()[0])


@dataclass(frozen=True)
class Client:
    """One DRM client (one open device context) of one of our processes."""

    pdev: str
    client_id: str
    pid: int
    vram_total: int  # bytes allocated in VRAM by this client
    vram_resident: int
    cycles: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # cls -> (busy, total, capacity)
    engine_ns: dict[str, tuple[int, int]] = field(default_factory=dict)  # i915: cls -> (busy ns, capacity)


def client_from_fdinfo(kv: dict[str, str], pid: int) -> Client | None:
    pdev, cid = kv.get("drm-pdev"), kv.get("drm-client-id")
    if not pdev or not cid:
        return None
    vram_total = vram_resident = 0
    for region in ("vram0", "vram1", "local0", "local1"):  # xe: vramN; i915: localN
        if f"drm-total-{region}" in kv:
            vram_total += to_bytes(kv[f"drm-total-{region}"])
            vram_resident += to_bytes(kv.get(f"drm-resident-{region}", "0"))
    cycles: dict[str, tuple[int, int, int]] = {}
    engine_ns: dict[str, tuple[int, int]] = {}
    for key, value in kv.items():
        if key.startswith("drm-cycles-"):
            cls = key[len("drm-cycles-"):]
            total = kv.get(f"drm-total-cycles-{cls}")
            if total is not None:
                cycles[cls] = (_int(value), _int(total), _int(kv.get(f"drm-engine-capacity-{cls}", "1")))
        elif key.startswith("drm-engine-") and not key.startswith("drm-engine-capacity-"):
            cls = key[len("drm-engine-"):]
            engine_ns[cls] = (_int(value), _int(kv.get(f"drm-engine-capacity-{cls}", "1")))
    return Client(pdev, cid, pid, vram_total, vram_resident, cycles, engine_ns)


def drm_clients(pids: Iterable[int], proc_root: Path = Path("/proc")) -> list[Client]:
    """The DRM clients of ``pids``, each (pdev, client-id) once. Unreadable pids are skipped."""
    seen: dict[tuple[str, str], Client] = {}
    for pid in pids:
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if not target.startswith("/dev/dri/"):
                continue
            try:
                text = (proc_root / str(pid) / "fdinfo" / fd).read_text()
            except OSError:
                continue
            client = client_from_fdinfo(parse_fdinfo(text), pid)
            if client is not None:
                seen.setdefault((client.pdev, client.client_id), client)
    return list(seen.values())


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class DrmCard:
    """One Intel GPU as sysfs shows it."""

    card: str  # "card1"
    pdev: str  # PCI BDF, as fdinfo's drm-pdev
    driver: str | None  # "xe" | "i915"
    path: Path  # /sys/class/drm/cardN


def intel_cards(sys_root: Path = Path("/sys/class/drm")) -> list[DrmCard]:
    """Intel DRM cards sorted by PCI address (Level Zero enumerates in the same order)."""
    found = []
    try:
        names = os.listdir(sys_root)
    except OSError:
        return []
    for name in names:
        if not _CARD_RE.match(name):
            continue
        dev = sys_root / name / "device"
        if _read(dev / "vendor") != INTEL_VENDOR:
            continue
        try:
            pdev = Path(os.path.realpath(dev)).name
            driver = Path(os.readlink(dev / "driver")).name
        except OSError:
            driver = None
        found.append(DrmCard(name, pdev, driver, sys_root / name))
    return sorted(found, key=lambda c: c.pdev)


def vram_total(card: DrmCard) -> int | None:
    dev = card.path / "device"
    sizes = [_read_int(t / "physical_vram_size_bytes") for t in sorted(dev.glob("tile*"))]
    known = [s for s in sizes if s]
    return sum(known) if known else None


def frequency_mhz(card: DrmCard) -> tuple[int | None, int | None]:
    """(actual, max) MHz: xe ``tile0/gt0/freq0``, i915 ``gt_act_freq_mhz``."""
    freq0 = card.path / "device" / "tile0" / "gt0" / "freq0"
    act = _read_int(freq0 / "act_freq")
    if act is not None:
        return act, _read_int(freq0 / "max_freq")
    return _read_int(card.path / "gt_act_freq_mhz"), _read_int(card.path / "gt_max_freq_mhz")


def _hwmon(card: DrmCard) -> Path | None:
    dirs = sorted((card.path / "device" / "hwmon").glob("hwmon*"))
    return dirs[0] if dirs else None


def temperatures(card: DrmCard) -> dict[str, float]:
    """°C by channel label (pkg, vram, ...); unlabelled xe channels: temp2 = pkg, temp3 = vram."""
    hw = _hwmon(card)
    if hw is None:
        return {}
    default = {"temp2": "pkg", "temp3": "vram", "temp1": "card"}
    out: dict[str, float] = {}
    for f in sorted(hw.glob("temp*_input")):
        chan = f.name[: -len("_input")]
        milli = _read_int(f)
        if milli is None:
            continue
        label = (_read(hw / f"{chan}_label") or default.get(chan, chan)).lower()
        out[label] = milli / 1000.0
    return out


def energy_uj(card: DrmCard) -> int | None:
    """Card energy counter in µJ (energy1 = card; DG2 on xe often has only energy2 = pkg)."""
    hw = _hwmon(card)
    if hw is None:
        return None
    for name in ("energy1_input", "energy2_input"):
        value = _read_int(hw / name)
        if value is not None:
            return value
    return None


class IntelSampler:
    """Keeps the previous counters so utilisation and power are rates over the last interval. A
    samples.CardSampler: Level Zero (sycl) and Mesa (vulkan) on Intel cards."""

    kind: ClassVar[str] = "intel"

    def __init__(self, sys_root: Path = Path("/sys/class/drm"), proc_root: Path = Path("/proc"),
                 clock: Any = time.monotonic) -> None:
        self.sys_root = sys_root
        self.proc_root = proc_root
        self.clock = clock
        self.cards = intel_cards(sys_root)
        self._energy: dict[str, tuple[float, int]] = {}
        self._cycles: dict[tuple[str, str, str], tuple[int, int]] = {}
        self._engine_ns: dict[tuple[str, str, str], tuple[float, int]] = {}

    @classmethod
    def create(cls, sys_root: Path, proc_root: Path, nvml: bool) -> "IntelSampler":
        return cls(sys_root, proc_root)

    @property
    def available(self) -> bool:
        return bool(self.cards)

    def sample(self, indices: Sequence[int] | None, pids: Iterable[int]) -> dict[str, CardSample]:
        """pdev -> reading of every Intel card here (``indices`` are Level Zero's, not sysfs's: all are read)."""
        now = self.clock()
        clients = drm_clients(pids, self.proc_root)
        out: dict[str, CardSample] = {}
        for card in self.cards:
            mine = [c for c in clients if c.pdev == card.pdev]
            act, fmax = frequency_mhz(card)
            temps = temperatures(card)
            drm = DrmDetail(card=card.card, pdev=card.pdev, resident=sum(c.vram_resident for c in mine),
                            freq=act, freq_max=fmax, temps=temps, clients=len(mine))
            out[card.pdev] = CardSample(
                source=card.driver or "intel", used=sum(c.vram_total for c in mine), total=vram_total(card),
                util=self._util(card.pdev, mine, now), temp=temps.get("pkg", next(iter(temps.values()), None)),
                power=self._power(card, now), drm=drm)
        return out

    @staticmethod
    def match(card: Mapping[str, Any], pos: int, rows: Mapping[str, CardSample]) -> CardSample | None:
        """By the plan card's PCI address, else the i-th card of that host by PCI address (Level Zero's order)."""
        pdev = card.get("pci")
        if pdev not in rows:
            order = sorted(rows)
            idx = int(card.get("index", pos))
            pdev = order[idx] if idx < len(order) else None
        return rows.get(pdev) if pdev else None

    def close(self) -> None:
        pass

    def _power(self, card: DrmCard, now: float) -> float | None:
        e = energy_uj(card)
        if e is None:
            return None
        prev = self._energy.get(card.pdev)
        self._energy[card.pdev] = (now, e)
        if prev is None or now <= prev[0] or e < prev[1]:
            return None
        return (e - prev[1]) / 1e6 / (now - prev[0])

    def _util(self, pdev: str, clients: list[Client], now: float) -> float | None:
        """Busiest engine class: sum over our clients of Δbusy / Δtotal / capacity (xe) or Δns / Δt (i915)."""
        per_class: dict[str, float] = {}
        any_delta = False
        for c in clients:
            for cls, (busy, total, cap) in c.cycles.items():
                key = (pdev, c.client_id, cls)
                prev = self._cycles.get(key)
                self._cycles[key] = (busy, total)
                if prev and total > prev[1] and busy >= prev[0]:
                    any_delta = True
                    per_class[cls] = per_class.get(cls, 0.0) + (busy - prev[0]) / (total - prev[1]) / max(cap, 1)
            for cls, (ns, cap) in c.engine_ns.items():
                key = (pdev, c.client_id, cls)
                prevt = self._engine_ns.get(key)
                self._engine_ns[key] = (now, ns)
                if prevt and now > prevt[0] and ns >= prevt[1]:
                    any_delta = True
                    per_class[cls] = per_class.get(cls, 0.0) + (ns - prevt[1]) / 1e9 / (now - prevt[0]) / max(cap, 1)
        if not any_delta:
            return None
        return min(1.0, max(per_class.values(), default=0.0))
