"""The cards llama.cpp will see, as a Rig: parsed from ``llama-server --list-devices``.

On the CPU backend there are no devices to list: ``--gpus 0,1`` means two rpc-servers on the CPU, each
with a memory budget (default: an even share of available RAM), so everything downstream runs without a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import psutil

from .. import backends
from .childenv import child_environ
from ..errors import BadInput, LlamaError, UnknownCard, example, given
from ..rig import MiB, Card, Rig
from .locate import LlamaBinaries, find_llama

# "  SYCL0: Intel(R) Graphics [0xe223] (32656 MiB, 32611 MiB free)"; newer logs may carry a
# "[pid] " or "0.01.121.994 I " prefix. The description may itself contain parentheses.
_DEVICE_LINE = re.compile(
    r"^(?:\[\d+\]\s*)?(?:[\d.]+\s+[A-Z]\s+)?\s*(?P<name>[A-Za-z][A-Za-z_-]*?)(?P<index>\d+): "
    r"(?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)


@dataclass(frozen=True)
class DeviceInfo:
    """One line of ``--list-devices``."""

    name: str
    backend: str
    index: int
    description: str
    total_mib: int
    free_mib: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_list_devices(text: str) -> list[DeviceInfo]:
    """Devices after the ``Available devices:`` header; ``(none)`` or no header gives an empty list."""
    devices: list[DeviceInfo] = []
    in_list = False
    for line in text.splitlines():
        if line.strip().endswith("Available devices:"):
            in_list = True
            devices = []
            continue
        if not in_list:
            continue
        m = _DEVICE_LINE.match(line)
        if not m:
            continue
        prefix = m.group("name")
        devices.append(DeviceInfo(
            name=f"{prefix}{m.group('index')}",
            backend=prefix.lower(),
            index=int(m.group("index")),
            description=m.group("desc").strip(),
            total_mib=int(m.group("total")),
            free_mib=int(m.group("free")),
        ))
    return devices


def list_devices(binaries: LlamaBinaries, env: dict[str, str] | None = None, timeout: float = 60.0) -> str:
    """Run ``llama-server --list-devices`` and return everything it printed."""
    full_env = child_environ(os.environ)  # no credentials for a llama.cpp tool (childenv.py)
    full_env.update(env or {})
    try:
        out = subprocess.run([str(binaries.server), "--list-devices"], capture_output=True, text=True,
                             timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        raise LlamaError(f"`{binaries.server.name} --list-devices` did not finish in {timeout:.0f} s",
                         "run `arcsplit doctor` to check the GPU runtime") from None
    except OSError as exc:
        raise LlamaError(f"cannot run {binaries.server}: {exc.strerror}", "rebuild with `arcsplit llama build`") from None
    return out.stdout + "\n" + out.stderr


def parse_gpus(spec: str | Sequence[int] | None) -> list[int] | None:
    """``"0,1"`` -> [0, 1]; duplicates, negatives and junk are errors that name the fix."""
    if spec is None:
        return None
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if not spec.strip() or any(not p for p in parts):
            raise BadInput(f"{given('--gpus', spec, repr(spec))} is not a list of card numbers",
                           f"write it like {example('--gpus 0,1', 'gpus=[0, 1]')}")
        try:
            gpus = [int(p) for p in parts]
        except ValueError:
            raise BadInput(f"{given('--gpus', spec, repr(spec))} is not a list of card numbers",
                           f"write it like {example('--gpus 0,1', 'gpus=[0, 1]')}") from None
    else:
        gpus = [int(g) for g in spec]
    if any(g < 0 for g in gpus):
        raise BadInput(f"{given('--gpus', spec, repr(spec))} has a negative card number", "card numbers start at 0")
    if len(set(gpus)) != len(gpus):
        raise BadInput(f"{given('--gpus', spec, repr(spec))} names a card twice", "list each card once")
    return gpus


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _refuse_missing(backend: str, wanted: Sequence[int], known: Sequence[int], where: str) -> None:
    """One refusal for a card the backend does not have, on a GPU backend and on the CPU alike."""
    for g in wanted:
        if g not in known:
            listed = ", ".join(str(i) for i in sorted(known))
            raise UnknownCard(f"there is no {backend} card {g}", f"pick from {where}: {listed}")


def cpu_rig(gpus: list[int] | None, cpu_memory_mib: int | None = None) -> Rig:
    """CPU "cards": one rpc-server each, budgeted an even share of available RAM unless told otherwise. They are
    numbered from 0 in the number asked for, so ``--gpus 9`` names a card that is not there, as on a GPU."""
    indices = gpus if gpus else [0]
    _refuse_missing(backends.CPU, indices, range(len(indices)),
                    "the CPU cards (one rpc-server each, numbered from 0: --gpus 0,1 makes two)")
    if cpu_memory_mib is not None and cpu_memory_mib <= 0:
        raise BadInput(f"{given('--cpu-memory', cpu_memory_mib)} must be positive", "give each CPU card's budget in MiB")
    budget = (cpu_memory_mib * MiB if cpu_memory_mib is not None
              else psutil.virtual_memory().available // len(indices))
    name = cpu_model()
    cards = tuple(Card(backend=backends.CPU, index=i, name=name, total_bytes=budget, free_bytes=budget)
                  for i in indices)
    return Rig(cards=cards, name=f"{len(cards)} CPU card(s)")


# ggml-vulkan lists only GPUs unless GGML_VK_VISIBLE_DEVICES names devices, which it then takes by their
# Vulkan (loader) index whatever their type: a CPU device such as Mesa's llvmpipe is seen only that way.
_VK_MAX_PROBE = 8


def _vulkan_named_devices(binaries: LlamaBinaries, gpus: list[int] | None) -> list[DeviceInfo]:
    """The cards of a machine whose Vulkan devices are not GPUs, one listing per index (as each process of a
    group will see it): the ``gpus`` asked for, else 0, 1, ... until an index llama.cpp rejects."""
    found = []
    for g in (gpus if gpus is not None else range(_VK_MAX_PROBE)):
        listed = [d for d in parse_list_devices(list_devices(binaries, {"GGML_VK_VISIBLE_DEVICES": str(g)}))
                  if d.backend == backends.VULKAN]
        if not listed:
            if gpus is None:
                break
            continue
        found.append(DeviceInfo(backends.get(backends.VULKAN).device_name(g), backends.VULKAN, g, listed[0].description, listed[0].total_mib,
                                listed[0].free_mib))
    return found


def host_budget(rig: Rig, host_memory_mib: int | None = None, live: bool = True) -> int | None:
    """Host RAM that routed experts kept there (--n-cpu-moe) may use: the user's figure, else on a live rig
    available RAM less the CPU cards' budgets; None (unchecked) for a layout's rig, whose host is unknown."""
    if host_memory_mib is not None:
        return host_memory_mib * MiB
    if not live:
        return None
    cpu_cards = sum(c.free_bytes for c in rig.cards if backends.get(c.backend).on_cpu)
    return max(0, psutil.virtual_memory().available - cpu_cards)


def card_rows(rig: Rig) -> list[dict[str, Any]]:
    """The cards as ``arcsplit devices --json`` and a node agent's hello report them."""
    return [{"backend": c.backend, "index": c.index, "device": c.device, "name": c.name,
             "total_mib": c.total_bytes // MiB, "free_mib": c.free_bytes // MiB, "pci": c.pci, "driver": c.driver}
            for c in rig.cards]


def discover_rig(backend: str, gpus: list[int] | None, binaries: LlamaBinaries | None = None,
                 cpu_memory_mib: int | None = None) -> Rig:
    """The live rig: cards in the order of ``gpus`` (all the backend's cards when None)."""
    be = backends.get(backend)
    if be.on_cpu:
        return cpu_rig(gpus, cpu_memory_mib)
    binaries = binaries or find_llama(backend=backend)
    devices = [d for d in parse_list_devices(list_devices(binaries, dict(be.base_env) or None))
               if d.backend == backend]
    if not devices and backend == backends.SYCL and gpus:
        # A runtime whose multi-device context is broken may fail to list all cards at once;
        # one single-device context per card still works (ggml-org/llama.cpp#22885).
        for g in gpus:
            env = be.visibility([g])
            for d in parse_list_devices(list_devices(binaries, env)):
                if d.backend == backend:
                    devices.append(DeviceInfo(be.device_name(g), backend, g, d.description, d.total_mib, d.free_mib))
    if not devices and backend == backends.VULKAN:
        devices = _vulkan_named_devices(binaries, gpus)
    if not devices:
        raise UnknownCard(f"llama.cpp reports no {backend} devices",
                          f"check the driver (`arcsplit doctor --backend {backend}`) or use --backend cpu")
    by_index = {d.index: d for d in devices}
    wanted = gpus if gpus is not None else sorted(by_index)
    _refuse_missing(backend, wanted, sorted(by_index), "the cards llama.cpp reports")
    cards = []
    for g in wanted:
        found = by_index[g]
        cards.append(Card(backend=backend, index=g, name=found.description,
                          total_bytes=found.total_mib * MiB, free_bytes=max(1, found.free_mib) * MiB))
    return Rig(cards=tuple(cards), name=f"{len(cards)} {backend} card(s)")
