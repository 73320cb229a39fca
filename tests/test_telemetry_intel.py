"""Intel telemetry against recorded sysfs / fdinfo trees (no Arc card here).

The trees are built in a temp dir from the documented formats:
- fdinfo keys and units: the kernel's Documentation/gpu/drm-usage-stats.rst and the xe example in
  Documentation/gpu/xe/xe-drm-usage-stats.rst (drm-pdev, drm-client-id, drm-total-vram0 "... KiB",
  drm-cycles-<cls>, drm-total-cycles-<cls>, drm-engine-capacity-<cls>); i915's drm-engine-<cls> "N ns" and
  local0 region from the same drm-usage-stats.rst;
- sysfs paths: the xe driver's sysfs and hwmon ABI (tile0/physical_vram_size_bytes, tile0/gt0/freq0/act_freq,
  hwmon temp2 = pkg, temp3 = vram in m°C, energy1_input in µJ).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from arcsplit.telemetry import Telemetry
from arcsplit.telemetry.intel import IntelSampler, drm_clients, intel_cards, parse_fdinfo, to_bytes

MiB = 1024**2


def xe_fdinfo(pdev: str, client: int, vram_kib: int, rcs: int, ccs: int, total: int) -> str:
    return "\n".join([
        "pos:\t0", "flags:\t0100002", "mnt_id:\t26", "ino:\t685",
        "drm-driver:\txe", f"drm-client-id:\t{client}", f"drm-pdev:\t{pdev}",
        "drm-total-system:\t0", "drm-total-gtt:\t192 KiB", "drm-resident-gtt:\t192 KiB",
        f"drm-total-vram0:\t{vram_kib} KiB", "drm-shared-vram0:\t16 MiB", "drm-active-vram0:\t0",
        f"drm-resident-vram0:\t{vram_kib - 1024} KiB",
        f"drm-cycles-rcs:\t{rcs}", f"drm-total-cycles-rcs:\t{total}",
        "drm-cycles-bcs:\t0", f"drm-total-cycles-bcs:\t{total}",
        f"drm-cycles-ccs:\t{ccs}", f"drm-total-cycles-ccs:\t{total}", "drm-engine-capacity-ccs:\t4", ""])


class Rig:
    """/sys/class/drm and /proc as files in a temp dir."""

    def __init__(self, root: Path) -> None:
        self.sys = root / "sys" / "class" / "drm"
        self.proc = root / "proc"
        self.devices = root / "sys" / "devices" / "pci0000:00"
        self.drivers = root / "sys" / "bus" / "pci" / "drivers"
        self.sys.mkdir(parents=True)
        self.proc.mkdir()

    def card(self, n: int, bdf: str, *, vendor: str = "0x8086", driver: str = "xe", vram: int = 16 * 1024 * MiB,
             hwmon: bool = True) -> Path:
        dev = self.devices / bdf
        (dev / "tile0" / "gt0" / "freq0").mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
        (self.drivers / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(self.drivers / driver, dev / "driver")
        (dev / "tile0" / "physical_vram_size_bytes").write_text(f"{vram}\n")
        (dev / "tile0" / "gt0" / "freq0" / "act_freq").write_text("2400\n")
        (dev / "tile0" / "gt0" / "freq0" / "max_freq").write_text("2800\n")
        if hwmon:
            hw = dev / "hwmon" / "hwmon4"
            hw.mkdir(parents=True)
            (hw / "temp2_input").write_text("61000\n")
            (hw / "temp3_input").write_text("72000\n")
            (hw / "energy1_input").write_text("1000000000\n")
        card = self.sys / f"card{n}"
        card.mkdir()
        os.symlink(dev, card / "device")
        (self.sys / f"card{n}-DP-1").mkdir()  # a connector, not a card
        return dev

    def fd(self, pid: int, fd: int, target: str, info: str | None) -> None:
        (self.proc / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "fdinfo").mkdir(parents=True, exist_ok=True)
        os.symlink(target, self.proc / str(pid) / "fd" / str(fd))
        if info is not None:
            (self.proc / str(pid) / "fdinfo" / str(fd)).write_text(info)


def test_fdinfo_values_and_units():
    kv = parse_fdinfo(xe_fdinfo("0000:03:00.0", 3, 23992, 1, 2, 3))
    assert kv["drm-pdev"] == "0000:03:00.0" and "pos" not in kv
    assert to_bytes(kv["drm-total-vram0"]) == 23992 * 1024
    assert to_bytes(kv["drm-shared-vram0"]) == 16 * MiB
    assert to_bytes("0") == 0


def test_cards_are_intel_only_and_sorted_by_pci_address(tmp_path):
    rig = Rig(tmp_path)
    rig.card(1, "0000:08:00.0")
    rig.card(0, "0000:03:00.0", driver="i915")
    rig.card(2, "0000:0a:00.0", vendor="0x1002", driver="amdgpu")
    cards = intel_cards(rig.sys)
    assert [(c.card, c.pdev, c.driver) for c in cards] == [("card0", "0000:03:00.0", "i915"),
                                                           ("card1", "0000:08:00.0", "xe")]


def test_vram_of_our_clients_counted_once_per_client(tmp_path):
    rig = Rig(tmp_path)
    rig.card(0, "0000:03:00.0")
    same = xe_fdinfo("0000:03:00.0", 7, 4 * 1024 * 1024, 10, 20, 1000)
    rig.fd(100, 5, "/dev/dri/renderD128", same)
    rig.fd(100, 6, "/dev/dri/renderD128", same)  # a dup of the same client
    rig.fd(100, 7, "/tmp/model.gguf", None)  # not a DRM fd
    rig.fd(200, 4, "/dev/dri/renderD128", xe_fdinfo("0000:03:00.0", 9, 1024 * 1024, 0, 0, 1000))
    clients = drm_clients([100, 200, 999], rig.proc)  # 999: gone
    assert sorted((c.pid, c.client_id) for c in clients) == [(100, "7"), (200, "9")]
    out = IntelSampler(rig.sys, rig.proc).sample(None, [100, 200])
    card = out["0000:03:00.0"]
    assert card.used == 5 * 1024 * MiB and card.drm is not None
    assert card.drm.resident == (4 * 1024 * 1024 - 1024 + 1024 * 1024 - 1024) * 1024
    assert card.total == 16 * 1024 * MiB
    assert card.drm.clients == 2


def test_utilisation_power_temperature_frequency(tmp_path):
    rig = Rig(tmp_path)
    dev = rig.card(0, "0000:03:00.0")
    fdinfo = rig.proc / "100" / "fdinfo" / "5"
    rig.fd(100, 5, "/dev/dri/renderD128", xe_fdinfo("0000:03:00.0", 3, 1024, 0, 0, 1_000_000))
    now = [50.0]
    s = IntelSampler(rig.sys, rig.proc, clock=lambda: now[0])
    first = s.sample(None, [100])["0000:03:00.0"]
    assert first.util is None and first.power is None  # rates need two samples
    assert first.drm is not None and first.temp == 61.0 and first.drm.temps == {"pkg": 61.0, "vram": 72.0}
    assert (first.drm.freq, first.drm.freq_max) == (2400, 2800)
    # 2 s later: ccs busy 2.0e6 of 4.0e6 cycles on 4 engines (12.5 %), rcs 1.0e6 of 4.0e6 on 1 (25 %)
    fdinfo.write_text(xe_fdinfo("0000:03:00.0", 3, 1024, 1_000_000, 2_000_000, 5_000_000))
    (dev / "hwmon" / "hwmon4" / "energy1_input").write_text(str(1_000_000_000 + 2 * 95_000_000) + "\n")
    now[0] += 2.0
    second = s.sample(None, [100])["0000:03:00.0"]
    assert second.util == pytest.approx(0.25)
    assert second.power == pytest.approx(95.0)


def test_i915_engine_time_and_local_memory(tmp_path):
    rig = Rig(tmp_path)
    rig.card(0, "0000:03:00.0", driver="i915", hwmon=False)

    def info(ns: int) -> str:
        return ("drm-driver:\ti915\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t12\n"
                f"drm-total-local0:\t2048 MiB\ndrm-resident-local0:\t2000 MiB\ndrm-engine-render:\t{ns} ns\n"
                "drm-engine-compute:\t0 ns\n")

    rig.fd(100, 3, "/dev/dri/card0", info(10**9))
    now = [10.0]
    s = IntelSampler(rig.sys, rig.proc, clock=lambda: now[0])
    assert s.sample(None, [100])["0000:03:00.0"].used == 2048 * MiB
    (rig.proc / "100" / "fdinfo" / "3").write_text(info(10**9 + 5 * 10**8))
    now[0] += 1.0
    card = s.sample(None, [100])["0000:03:00.0"]
    assert card.util == pytest.approx(0.5)
    assert card.temp is None and card.power is None  # no hwmon: not readable, not an error


def test_plan_cards_get_their_intel_card(tmp_path):
    """A SYCL plan's card i is the i-th Intel card by PCI address; each gets only its own memory."""
    rig = Rig(tmp_path)
    rig.card(1, "0000:08:00.0")
    rig.card(0, "0000:03:00.0")
    rig.fd(300, 5, "/dev/dri/renderD128", xe_fdinfo("0000:03:00.0", 1, 3 * 1024 * 1024, 0, 0, 1))
    rig.fd(301, 5, "/dev/dri/renderD129", xe_fdinfo("0000:08:00.0", 1, 1024 * 1024, 0, 0, 1))
    status = {"state": "starting", "processes": {"rpc0": {"pid": 300, "state": "ready"},
                                                 "rpc1": {"pid": 301, "state": "ready"}},
              "plan": {"cards": [{"device": "RPC0", "backend": "sycl", "index": 0, "free": 1},
                                 {"device": "RPC1", "backend": "sycl", "index": 1, "free": 1}]}}
    tel = Telemetry(sys_root=rig.sys, proc_root=rig.proc, nvml=False)
    data = asyncio.run(tel.sample(status))
    assert [(c["device"], c["source"], c["used"]) for c in data["cards"]] == [
        ("RPC0", "xe", 3 * 1024 * MiB), ("RPC1", "xe", 1024 * MiB)]
