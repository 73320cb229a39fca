"""What to do about a card whose device keeps getting lost: one line per driver, with the document it comes from.

A single lost device is often transient: the driver resets the engine, the process that held the context dies, and a
fresh process gets a working card (the supervisor's restart). When the same card is lost again after a fresh start,
the fresh context did not help and the card or its driver state is the likely cause. On xe the kernel may then have
declared the device wedged: every call on it fails until userspace recovers it, by rebinding the driver (or a bus
reset) or a reboot. NVIDIA's tool for the same is ``nvidia-smi -r``. Pure text; ``run/faults.py`` decides when.
"""

from __future__ import annotations

from .. import backends

XE_DOC = "https://docs.kernel.org/gpu/xe/xe_device.html"
DRM_WEDGED_DOC = "https://docs.kernel.org/gpu/drm-uapi.html#device-wedging"
NVIDIA_SMI_DOC = "https://docs.nvidia.com/deploy/nvidia-smi/index.html"


def reset_advice(backend: str, driver: str | None = None, pci: str | None = None, index: int | None = None,
                 name: str = "") -> str:
    """How to get a card working again, for the driver it runs on, and where that is documented: one clause for
    "SYCL1 needs a driver reset: ...". ``driver``/``pci``: from sysfs where detection read them; the vendor is
    guessed from the backend and the card's name otherwise."""
    slot = pci or "<its PCI address>"
    vendor = _vendor(backend, driver, name)
    if vendor == "nvidia":
        which = pci or (str(index) if index is not None else "<its index>")
        return (f"reset the GPU once nothing runs on it (`sudo nvidia-smi -r -i {which}`, nvidia-smi's "
                f"--gpu-reset) or reboot; {NVIDIA_SMI_DOC}")
    if vendor == "intel" and driver in (None, "", "xe"):
        return (f"on the xe driver the card may be wedged (declared after a failed GPU reset, or at any hang "
                f"with xe.wedged_mode=2; every call then fails until it is recovered): rebind its driver "
                f"(`echo {slot} | sudo tee /sys/bus/pci/drivers/xe/unbind`, then the same into "
                f"/sys/bus/pci/drivers/xe/bind) or reboot; {XE_DOC}")
    drv = driver or "<its driver>"
    return (f"unbind and rebind its driver (`echo {slot} | sudo tee /sys/bus/pci/drivers/{drv}/unbind`, then "
            f"the same into .../bind) or reboot; {DRM_WEDGED_DOC}")


def _vendor(backend: str, driver: str | None, name: str) -> str:
    """The card's vendor: by its driver, else the backend's only vendor (SYCL: Intel), else its name."""
    by_driver = {"nvidia": "nvidia", "nouveau": "nvidia", "xe": "intel", "i915": "intel"}
    if driver in by_driver:
        return by_driver[driver]
    entry = backends.REGISTRY.get(backend)
    if entry is not None and len(entry.vendors) == 1:
        return entry.vendors[0]
    return next((v for v in ("nvidia", "intel") if v in name.lower()), "other")
