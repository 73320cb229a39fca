"""What ``--backend auto`` means on this machine: the cards in sysfs, the llama.cpp builds present, sycl-ls.

``decide`` is pure (facts in, a ``BackendChoice`` with its one-line reason out); ``gather`` reads the machine, with
its sysfs root, tool runner and build lookup injectable so tests simulate an Arc machine without one. The headline
command (``arcsplit serve model.gguf --gpus 0,1``) goes through here, so on two Arc cards it runs SYCL (or Vulkan)
without a flag; the CPU demo names ``--backend cpu`` itself.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Sequence

from .. import backends
from ..errors import ArcsplitError, BadInput
from .build import managed_builds
from .facts import CardFact, _run, discover_cards, parse_sycl_ls

AUTO = backends.AUTO
ENV = "ARCSPLIT_BACKEND"  # what auto means when set: a machine's standing choice (the test suite pins cpu with it)
SYSFS_ROOT = "/sys"  # read at call time: tests point it at a recorded tree
_VENDOR_LABEL = {"intel": "Intel", "nvidia": "NVIDIA", "amd": "AMD"}


@dataclass(frozen=True)
class DetectFacts:
    """What the choice rests on. ``usable``: backends with a build here (or, for ``llama build``, a toolchain)."""

    cards: tuple[CardFact, ...]
    usable: tuple[str, ...]
    # Level Zero GPUs that sycl-ls lists; None when sycl-ls is absent or was not run.
    sycl_gpus: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str  # one line: "backend sycl: 2 Intel cards (8086:e223) and a SYCL build"
    notes: tuple[str, ...] = ()


def is_integrated(card: CardFact) -> bool:
    """An iGPU sits on PCI bus 0 (Intel's at 0000:00:02.0); a PCIe card sits behind a root port, on a bus > 0."""
    return (card.pci_slot or "").lower().startswith("0000:00:")


def _describe(cards: Sequence[CardFact]) -> str:
    by_vendor = Counter(c.vendor for c in cards)
    parts = []
    for vendor, n in by_vendor.most_common():
        ids = sorted({c.pci_id for c in cards if c.vendor == vendor and c.pci_id})
        parts.append(f"{n} {_VENDOR_LABEL.get(vendor or '', vendor)} card{'s' if n > 1 else ''}"
                     + (f" ({', '.join(ids)})" if ids else ""))
    return " and ".join(parts)


def candidates(vendors: Collection[str]) -> list[str]:
    """Backends that drive every vendor present, in the registry's order of preference (sycl before vulkan)."""
    return [b.name for b in backends.REGISTRY.values() if b.vendors and set(vendors) <= set(b.vendors)]


def decide(facts: DetectFacts, purpose: str = "run") -> BackendChoice:
    """The backend for these cards. ``purpose``: "run" needs a build, "build" a toolchain, "check" (doctor) neither."""
    gpus = [c for c in facts.cards if c.vendor in _VENDOR_LABEL and not is_integrated(c)]
    igpus = [c for c in facts.cards if c.vendor in _VENDOR_LABEL and is_integrated(c)]
    if not gpus and facts.sycl_gpus:  # no sysfs (a container without /sys/class/drm), but Level Zero sees GPUs
        gpus = [CardFact(f"level_zero:{i}", None, None, None, "intel", None) for i in range(facts.sycl_gpus)]
    notes = list(facts.notes)
    if not gpus:
        why = "no GPU in sysfs" if not igpus else f"only an integrated GPU ({_describe(igpus)})"
        hint = "" if not igpus else "; --backend sycl or vulkan uses it"
        return BackendChoice(backends.CPU, f"backend cpu: {why}; each card is an rpc-server on the CPU{hint}", tuple(notes))
    what = _describe(gpus)
    cands = candidates({c.vendor for c in gpus if c.vendor})
    if not cands:
        raise BadInput(f"no backend drives {what} together", "pass --gpus and --backend for one vendor's cards")
    if purpose == "check":
        return BackendChoice(cands[0], f"backend {cands[0]}: {what}", tuple(notes))
    usable = [b for b in cands if b in facts.usable]
    if backends.SYCL in usable and facts.sycl_gpus == 0 and len(usable) > 1:
        usable.remove(backends.SYCL)
        notes.append("sycl-ls lists no Level Zero GPU, so the SYCL build could not use these cards")
    if not usable:
        raise _missing(what + "".join(f" ({n})" for n in facts.notes), cands, purpose)
    chosen = usable[0]
    thing = "build" if purpose == "run" else "toolchain"
    reason = f"backend {chosen}: {what} and a {backends.get(chosen).label} {thing}"
    others = usable[1:]
    if others:
        notes.append(f"also usable: {', '.join(others)} (--backend {others[0]})")
    return BackendChoice(chosen, reason, tuple(notes))


def _missing(what: str, cands: Sequence[str], purpose: str) -> ArcsplitError:
    names = " or ".join(backends.get(b).label for b in cands)
    if purpose == "build":
        tools = ", ".join(f"{prog} ({b})" for b in cands for prog, _ in backends.get(b).toolchain[1:])
        return BadInput(f"{what} found, but none of {tools} is on PATH to build a {names} llama.cpp",
                        "; ".join(f"--backend {b}: {backends.get(b).toolchain[-1][1]}" for b in cands)
                        + "; or --backend cpu")
    how = " or ".join(f"`arcsplit llama build --backend {b}`" + (" (needs Intel oneAPI)" if backends.get(b).intel_runtime else "")
                      for b in cands)
    return BadInput(f"{what} found, but no {names} build of llama.cpp", f"run {how}, or pass --backend cpu")


# ----------------------------------------------------------------------------------------------------------
# Gathering (I/O)


def build_backends(bin_dir: Path) -> tuple[str, ...]:
    """The GPU backends a build dir's libraries provide (Backend.library: a build made with BUILD_SHARED_LIBS,
    arcsplit's and most distributions', keeps one per ggml backend beside its binaries or in ../lib); () for a
    CPU-only (or a static) build."""
    dirs = (bin_dir, bin_dir.parent / "lib")
    return tuple(b.name for b in backends.REGISTRY.values()
                 if b.library and any((d / b.library).exists() for d in dirs))


def _located(llama_dir: str | None, environ: dict[str, str] | os._Environ[str]) -> Path | None:
    """A build the user named (--llama-dir, $ARCSPLIT_LLAMA_DIR) or put on PATH: it runs whatever we pick."""
    for d in (llama_dir, environ.get("ARCSPLIT_LLAMA_DIR")):
        if d:
            p = Path(d)
            found = next((x for x in (p, p / "bin") if (x / "llama-server").exists()), None)
            return found  # a named dir without a build: find_llama says so
    on_path = shutil.which("llama-server", path=environ.get("PATH"))
    return Path(on_path).resolve().parent if on_path else None


def managed_backends() -> tuple[str, ...]:
    """GPU backends with a finished managed build (``arcsplit llama build --backend B``, any flags or patch set)."""
    have = {b.backend for b in managed_builds()}
    return tuple(b for b in backends.gpu_names() if b in have)


def toolchain_backends(which: Callable[[str], str | None] = shutil.which) -> tuple[str, ...]:
    """GPU backends whose compilers are on PATH (what ``llama build --backend auto`` can make)."""
    return tuple(b for b in backends.gpu_names() if all(which(p) for p, _ in backends.get(b).toolchain))


RunTool = Callable[[Sequence[str]], "tuple[str | None, str]"]


def gather(purpose: str = "run", llama_dir: str | None = None, sysfs_root: str | Path | None = None,
           run: RunTool | None = None, managed: Callable[[], tuple[str, ...]] = managed_backends,
           environ: dict[str, str] | os._Environ[str] = os.environ) -> DetectFacts:
    """Read the cards, the builds (or toolchains) and, when Intel cards may be present, sycl-ls."""
    run = run or (lambda argv: _run(argv))
    cards, _why = discover_cards(sysfs_root or SYSFS_ROOT)
    notes: list[str] = []
    if purpose == "build":
        usable = toolchain_backends()
    else:
        located = _located(llama_dir, environ)
        if located is not None:
            usable = build_backends(located)
            if not usable:
                notes.append(f"the llama.cpp build in {located} has no libggml-sycl/cuda/vulkan.so: a CPU build")
        else:
            usable = managed()
    sycl_gpus = None
    if purpose != "build" and backends.SYCL in usable and (not cards or any(c.vendor == "intel" for c in cards)):
        out, _ = run(["sycl-ls"])
        if out is not None:
            sycl_gpus = sum(1 for d in parse_sycl_ls(out) if d.backend == "level_zero" and d.type == "gpu")
    return DetectFacts(tuple(cards), tuple(usable), sycl_gpus, tuple(notes))


def resolve(backend: str, llama_dir: str | None = None, purpose: str = "run",
            sysfs_root: str | Path | None = None) -> tuple[str, BackendChoice | None]:
    """``backend`` as given, or what auto means here (with why). An unknown name is a one-line error.

    ``purpose``: "run" (serve, plan, devices: a build must exist), "build" (a toolchain must), "check" (doctor)."""
    if backend != AUTO:
        backends.get(backend)
        return backend, None
    pinned = os.environ.get(ENV)
    if pinned and pinned != AUTO:
        if pinned not in backends.REGISTRY:
            raise BadInput(f"{ENV}={pinned!r} is not a backend", f"set it to one of {', '.join(backends.choices())}, or unset it")
        return pinned, None  # the user's standing choice, as good as --backend: nothing to explain
    facts = gather("run" if purpose == "check" else purpose, llama_dir, sysfs_root)
    if purpose == "check":  # doctor: what serve would pick, else (no build yet) what the cards want
        try:
            choice = decide(facts, "run")
        except ArcsplitError:
            choice = decide(facts, "check")
    else:
        choice = decide(facts, purpose)
    return choice.backend, choice
