"""The ggml backends arcsplit runs, one entry each: the single owner of a backend's facts.

Everything that differs between backends — llama.cpp's device-name prefix, the variable that confines a process
to some cards, the cmake flags and toolchain of a build, which card vendors it drives, whether one process can
hold several cards in one context, which telemetry sampler reads its cards — is read from here. Adding a backend
is one entry plus its tests. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import BadInput


@dataclass(frozen=True)
class Backend:
    """One ggml backend as arcsplit uses it."""

    name: str
    # llama.cpp's device name is prefix + index among the devices the process sees ("SYCL0", "CUDA1", "Vulkan0").
    # None: the CPU backend has no devices of its own; its cards are rpc-servers.
    prefix: str | None
    # The variable that limits which cards one process sees, and its value for a list of card indices.
    visibility_var: str | None
    cmake_flags: tuple[str, ...]
    # (program that must be on PATH, how to get it) before a build starts.
    toolchain: tuple[tuple[str, str], ...]
    # PCI vendors (sysfs names) whose cards this backend drives, in the order auto-detection prefers backends.
    vendors: tuple[str, ...]
    # Whether one process can build one context over several cards (multi mode). CPU cards are rpc-servers.
    multi_context: bool
    # Which telemetry sampler reads this backend's cards: "intel", "nvidia" or "process" (psutil of the holder).
    sampler: str
    # Extra environment for listing devices and for every process on this backend (e.g. free-memory reporting).
    base_env: tuple[tuple[str, str], ...] = ()
    # What a process that must see none of this backend's cards gets.
    none_value: str = ""
    # llama-server's -fa when the user does not choose: on where it saves memory and time. Off on SYCL: a B60 report
    # measured generation faster without it (docs/runtime.md, "Flash attention"); a quantized V cache needs it anyway.
    flash_attn: bool = True
    # Seconds between SIGTERM and SIGKILL when arcsplit stops or restarts a group (`serve --stop-grace`). Longer on
    # SYCL: a peer tool claims a SIGKILL while an Arc card releases memory can wedge it (unsourced; docs/runtime.md).
    # A process that exits on SIGTERM ends the wait at once, so a longer grace costs nothing then.
    stop_grace_s: float = 10.0

    def device_name(self, position: int) -> str:
        """The name llama.cpp gives the ``position``-th card a process sees."""
        return f"{self.prefix or 'CPU'}{position}"

    def own_name(self, position: int) -> str:
        """The name ggml gives the ``position``-th card a process sees, as rpc-server's -d takes it: the CPU
        backend has one device, "CPU", which a per-host rpc-server names once per CPU card."""
        return "CPU" if self.prefix is None else self.device_name(position)

    def visibility(self, indices: Sequence[int]) -> dict[str, str]:
        """Environment that shows exactly these card indices (ascending) to one process; {} on the CPU backend."""
        if self.visibility_var is None:
            return {}
        ids = ",".join(str(i) for i in sorted(indices))
        if self.name == "sycl":
            value = f"level_zero:{ids}" if indices else self.none_value
        else:
            value = ids if indices else self.none_value
        return {self.visibility_var: value, **dict(self.base_env)}


_CMAKE = "apt-get install cmake"
REGISTRY: dict[str, Backend] = {
    b.name: b for b in (
        Backend(
            name="cpu", prefix=None, visibility_var=None,
            cmake_flags=("-DGGML_NATIVE=ON",),
            toolchain=(("cmake", _CMAKE), ("c++", "apt-get install g++")),
            vendors=(), multi_context=False, sampler="process",
        ),
        Backend(
            name="sycl", prefix="SYCL", visibility_var="ONEAPI_DEVICE_SELECTOR",
            cmake_flags=("-DGGML_SYCL=ON", "-DGGML_SYCL_F16=ON", "-DGGML_SYCL_TARGET=INTEL",
                         "-DCMAKE_C_COMPILER=icx", "-DCMAKE_CXX_COMPILER=icpx"),
            toolchain=(("cmake", _CMAKE),
                       ("icpx", "install Intel oneAPI and run `source /opt/intel/oneapi/setvars.sh` first")),
            vendors=("intel",), multi_context=True, sampler="intel",
            # Sysman makes free memory readable (llama.cpp docs/backend/SYCL.md: ZES_ENABLE_SYSMAN).
            base_env=(("ZES_ENABLE_SYSMAN", "1"),),
            # Level Zero has no CPU devices, so this selects nothing; ggml-sycl then has no devices and stays
            # out of the way ("Do not hard crash when there exists no SYCL devices"). Not run on an Arc here.
            none_value="level_zero:cpu",
            flash_attn=False, stop_grace_s=30.0,
        ),
        Backend(
            name="cuda", prefix="CUDA", visibility_var="CUDA_VISIBLE_DEVICES",
            cmake_flags=("-DGGML_NATIVE=ON", "-DGGML_CUDA=ON"),
            toolchain=(("cmake", _CMAKE), ("nvcc", "install the CUDA toolkit and put nvcc on PATH")),
            vendors=("nvidia",), multi_context=True, sampler="nvidia",
        ),
        Backend(
            name="vulkan", prefix="Vulkan", visibility_var="GGML_VK_VISIBLE_DEVICES",
            cmake_flags=("-DGGML_NATIVE=ON", "-DGGML_VULKAN=ON"),
            toolchain=(("cmake", _CMAKE), ("glslc", "apt-get install glslc libvulkan-dev spirv-headers")),
            # Mesa's Vulkan drivers (not NEO) on Intel; the Vulkan route also drives AMD and NVIDIA cards.
            vendors=("intel", "amd", "nvidia"), multi_context=True, sampler="intel",
        ),
    )
}
NAMES: tuple[str, ...] = tuple(REGISTRY)
GPU_NAMES: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.prefix is not None)
AUTO = "auto"  # --backend: let llama/detect.py pick from the cards and builds here
CHOICES: tuple[str, ...] = (AUTO, *NAMES)


def get(name: str) -> Backend:
    """The backend called ``name``; an unknown name is a one-line error listing the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise BadInput(f"unknown backend {name!r}", f"use one of {', '.join(NAMES)}") from None


def by_prefix(device: str) -> Backend | None:
    """The backend of a llama.cpp device name ("SYCL1" -> sycl); None for RPC/CPU/unknown names."""
    head = device.rstrip("0123456789")
    for b in REGISTRY.values():
        if b.prefix is not None and b.prefix.lower() == head.lower():
            return b
    return None


def flash_attn_default(backend: str, cache_type_v: str = "f16") -> bool:
    """-fa when the user does not choose: the backend's default, but always on for a quantized V cache, which
    llama.cpp refuses without flash attention."""
    return get(backend).flash_attn or cache_type_v not in ("f16", "f32", "bf16")
