"""The ggml backends arcsplit runs, one entry each: the single owner of a backend's facts.

Everything that differs between backends is a field here: llama.cpp's device-name prefix, the variable that
confines a process to some cards, the cmake flags, toolchain and shared library of a build, which card vendors it
drives, the modes a probe tries, the telemetry sampler that reads its cards (locally and in the node agent), its
defaults. Code elsewhere reads these fields; it names a backend only for a quirk of that one backend's build or
runtime (docs/extending.md lists them). Adding a backend is one ``Backend`` entry (in REGISTRY, or ``register()``
at run time) plus its tests; docs/extending.md lists what else a new kind of card needs. Pure: no I/O.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .errors import BadInput
from .modes import Mode

if TYPE_CHECKING:
    from .samples import CardSampler

@dataclass(frozen=True)
class Backend:
    """One ggml backend as arcsplit uses it."""

    name: str
    # How messages name it ("a SYCL build", "failed to allocate SYCL0 buffer").
    label: str
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
    # The telemetry sampler that reads this backend's cards, here and in a node agent on another host, as
    # "module:Class" (a telemetry.samples.CardSampler, imported at its first use); None: a CPU card is the process
    # that holds it (psutil).
    sampler: str | None
    # The library a shared llama.cpp build keeps for this backend (beside its binaries or in ../lib): what a build
    # dir we did not make can drive. None: every build runs it (CPU).
    library: str | None = None
    # The modes ``doctor`` and the supervisor probe on two cards or more, fastest first (llama/runtime.py).
    probe_modes: tuple[Mode, ...] = (Mode.MULTI, Mode.HYBRID)
    # Probe without being asked: a known multi-device bug makes the version table alone unsafe to trust.
    probe_by_default: bool = False
    # Whether multi+workaround exists here: one context with the runtime's workaround environment (Intel NEO).
    one_context_workaround: bool = False
    # Whether Intel's compute runtime (NEO, Level Zero, oneAPI) decides if this backend works here: `doctor` and the
    # runtime check read and report their versions (llama/facts.py), and name the one they could not read.
    intel_runtime: bool = False
    # Whether one rpc-server may hold several cards of a host (layout rpc_servers = "per-host"); rig.PER_HOST_SYCL.
    per_host_rpc: bool = True
    # The visibility variable's value for a list of indices ("{ids}": "0,2").
    visibility_format: str = "{ids}"
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
    # Whether a queued copy and graph can wait on the card for a page-locked host word (patch 0009,
    # ggml_backend_wait_host_u32): an rpc-server then launches a graph before its input has come (gated sets).
    host_word_wait: bool = False

    @property
    def on_cpu(self) -> bool:
        """The cards are shares of the host's CPU, each held by an rpc-server: no devices of the backend's own."""
        return self.prefix is None

    def sampler_class(self) -> type[CardSampler] | None:
        """The class ``sampler`` names, imported at its first use (the node agent pays for a sampler only when its
        group's backend has one); None: a CPU card, read from its holder process."""
        if self.sampler is None:
            return None
        if self.sampler not in _SAMPLERS:
            module, _, name = self.sampler.partition(":")
            _SAMPLERS[self.sampler] = getattr(importlib.import_module(module), name)
        return _SAMPLERS[self.sampler]

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
        value = self.visibility_format.format(ids=ids) if indices else self.none_value
        return {self.visibility_var: value, **dict(self.base_env)}


_SAMPLERS: dict[str, type[CardSampler]] = {}  # Backend.sampler -> its class, once imported
# The names code may still need to say (a flag it passes, a file it reads): compare Backend fields instead.
CPU, SYCL, CUDA, VULKAN = "cpu", "sycl", "cuda", "vulkan"
_CMAKE = "apt-get install cmake"
_INTEL_SAMPLER = "arcsplit.telemetry.intel:IntelSampler"
REGISTRY: dict[str, Backend] = {
    b.name: b for b in (
        Backend(
            name=CPU, label="CPU", prefix=None, visibility_var=None,
            cmake_flags=("-DGGML_NATIVE=ON",),
            toolchain=(("cmake", _CMAKE), ("c++", "apt-get install g++")),
            vendors=(), sampler=None, probe_modes=(Mode.RPC,),
        ),
        Backend(
            name=SYCL, label="SYCL", prefix="SYCL", visibility_var="ONEAPI_DEVICE_SELECTOR",
            cmake_flags=("-DGGML_SYCL=ON", "-DGGML_SYCL_F16=ON", "-DGGML_SYCL_TARGET=INTEL",
                         "-DCMAKE_C_COMPILER=icx", "-DCMAKE_CXX_COMPILER=icpx"),
            toolchain=(("cmake", _CMAKE),
                       ("icpx", "install Intel oneAPI and run `source /opt/intel/oneapi/setvars.sh` first")),
            vendors=("intel",), sampler=_INTEL_SAMPLER, library="libggml-sycl.so",
            # ggml-org/llama.cpp#22885: one context over several Arc cards fails on some NEO versions.
            probe_modes=(Mode.MULTI, Mode.MULTI_WORKAROUND, Mode.HYBRID), probe_by_default=True,
            one_context_workaround=True, intel_runtime=True, per_host_rpc=False, visibility_format="level_zero:{ids}",
            # Sysman makes free memory readable (llama.cpp docs/backend/SYCL.md: ZES_ENABLE_SYSMAN).
            base_env=(("ZES_ENABLE_SYSMAN", "1"),),
            # Level Zero has no CPU devices, so this selects nothing; ggml-sycl then has no devices and stays
            # out of the way ("Do not hard crash when there exists no SYCL devices"). Not run on an Arc here.
            none_value="level_zero:cpu",
            flash_attn=False, stop_grace_s=30.0,
        ),
        Backend(
            name=CUDA, label="CUDA", prefix="CUDA", visibility_var="CUDA_VISIBLE_DEVICES",
            cmake_flags=("-DGGML_NATIVE=ON", "-DGGML_CUDA=ON"),
            toolchain=(("cmake", _CMAKE), ("nvcc", "install the CUDA toolkit and put nvcc on PATH")),
            vendors=("nvidia",), sampler="arcsplit.telemetry.nvidia:NvidiaSampler", library="libggml-cuda.so",
            host_word_wait=True,
        ),
        Backend(
            name=VULKAN, label="Vulkan", prefix="Vulkan", visibility_var="GGML_VK_VISIBLE_DEVICES",
            cmake_flags=("-DGGML_NATIVE=ON", "-DGGML_VULKAN=ON"),
            toolchain=(("cmake", _CMAKE), ("glslc", "apt-get install glslc libvulkan-dev spirv-headers")),
            # Mesa's Vulkan drivers (not NEO) on Intel; the Vulkan route also drives AMD and NVIDIA cards.
            vendors=("intel", "amd", "nvidia"), sampler=_INTEL_SAMPLER, library="libggml-vulkan.so",
        ),
    )
}
AUTO = "auto"  # --backend: let llama/detect.py pick from the cards and builds here


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry (after the others: auto-detection prefers earlier entries), or replace the
    entry of that name. Every part of arcsplit reads the registry when it runs (detection, builds, the CLI's
    choices, telemetry, the node agent), so a backend registered before them is one they use. Returns it."""
    if not backend.name or backend.name == AUTO:
        raise BadInput(f"a backend cannot be called {backend.name!r}", "pick another name")
    REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend ``register`` added (an unknown name is ignored)."""
    REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every backend's name, in the registry's order (auto-detection's preference)."""
    return tuple(REGISTRY)


def gpu_names() -> tuple[str, ...]:
    """The backends with devices of their own (every one but the CPU's)."""
    return tuple(n for n, b in REGISTRY.items() if not b.on_cpu)


def choices() -> tuple[str, ...]:
    """--backend's choices: auto, then every backend."""
    return (AUTO, *REGISTRY)


def get(name: str) -> Backend:
    """The backend called ``name``; an unknown name is a one-line error listing the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise BadInput(f"unknown backend {name!r}", f"use one of {', '.join(REGISTRY)}") from None


def flash_attn_default(backend: str, cache_type_v: str = "f16") -> bool:
    """-fa when the user does not choose: the backend's default, but always on for a quantized V cache, which
    llama.cpp refuses without flash attention."""
    return get(backend).flash_attn or cache_type_v not in ("f16", "f32", "bf16")
