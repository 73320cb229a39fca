"""Host checks a GPU run needs besides the runtime versions: Resizable BAR, access to the render nodes, the oneAPI
runtime libraries, a card already held by another process, room in /dev/shm for the RPC links of one host, and host
RAM headroom during a load.

The parsers and judgements are pure (they take the text of sysfs/procfs files and ``ldd``); ``host_checks`` reads
the machine, under injectable roots so tests never read the real /sys or /proc. Each check says what it saw and, when
it is not fine, the one command that fixes it.
"""

from __future__ import annotations

import grp
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .. import backends
from .facts import LIB_DIRS, CardFact
from ..errors import BadInput
from .patches import SHM_ENV, SHM_LINK_BYTES, shm_link_on

MiB = 1024 * 1024
GiB = 1024 * MiB
# The libraries a SYCL llama.cpp needs from oneAPI and NEO at run time (what `ldd libggml-sycl.so` resolves).
ONEAPI_LIBS = ("libsycl.so", "libze_loader.so.1", "libze_intel_gpu.so.1")
SETVARS = ("/opt/intel/oneapi/setvars.sh",)
# Without Resizable BAR the CPU sees the card through a 256 MiB window; Intel said at the Arc launch that Arc all but
# requires it (https://hothardware.com/news/dont-bother-with-arc-without-resizable-bar).
SMALL_BAR = 256 * MiB
# Host RAM floor during a load: NEO mirrors device allocations in host memory on some runtimes (llama.cpp PR #21597;
# intel/llvm#22986: pinned host memory invisible to RSS and cgroups, ending in a global OOM). The floor is the one the
# arc-llama 1.0.0 runtime uses: max(512 MiB, min(12 GiB, 40 % of RAM)). ARCSPLIT_MIN_FREE_RAM_MIB overrides it.
RAM_ENV = "ARCSPLIT_MIN_FREE_RAM_MIB"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "warn", "fail" or "skip" (could not tell)
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


# -- Resizable BAR -----------------------------------------------------------------------------------------------


def parse_resource(text: str) -> list[int]:
    """Sizes of the regions in a PCI device's sysfs ``resource`` file ("start end flags" per line, hex)."""
    sizes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            start, end = int(parts[0], 16), int(parts[1], 16)
            sizes.append(end - start + 1 if end > start else 0)
    return sizes


def rebar_check(label: str, resource_text: str, vram_bytes: int | None = None) -> Check:
    """ReBAR is on when the largest BAR covers the card's memory (or, memory unknown, is larger than 256 MiB)."""
    sizes = parse_resource(resource_text)
    largest = max(sizes, default=0)
    if largest == 0:
        return Check("Resizable BAR", "skip", f"{label}: no BAR in its resource file")
    on = largest >= vram_bytes if vram_bytes else largest > SMALL_BAR
    vs = f" for {_size(vram_bytes)} of memory" if vram_bytes else ""
    if on:
        return Check("Resizable BAR", "ok", f"{label}: largest BAR {_size(largest)}{vs}")
    return Check("Resizable BAR", "warn", f"{label}: largest BAR {_size(largest)}{vs}: Resizable BAR is off",
                 "enable Resizable BAR (and Above 4G Decoding) in the firmware setup; Arc cards are slow without it")


# -- render nodes and groups -------------------------------------------------------------------------------------


def groups_check(nodes: Sequence[tuple[str, bool, str | None]], user_groups: Iterable[str]) -> Check:
    """``nodes``: (render node, readable+writable by us, its group). Access is what matters; groups say why not."""
    if not nodes:
        return Check("render nodes", "skip", "no /dev/dri/renderD* (no GPU driver loaded, or a container without them)")
    mine = set(user_groups)
    denied = [(p, g) for p, ok, g in nodes if not ok]
    member = ", ".join(sorted(mine & {"render", "video"})) or "neither render nor video"
    if not denied:
        return Check("render nodes", "ok", f"{len(nodes)} usable ({member})")
    group = next((g for _, g in denied if g), "render")
    return Check("render nodes", "fail",
                 f"no access to {', '.join(p for p, _ in denied)} (group {group}; you are in {member})",
                 f"sudo usermod -aG {group} $USER, then log out and in again")


# -- oneAPI runtime ----------------------------------------------------------------------------------------------

_LDD_MISSING = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.M)


def parse_ldd(text: str) -> list[str]:
    """The libraries ``ldd`` could not resolve."""
    return _LDD_MISSING.findall(text)


def oneapi_check(found: Mapping[str, str | None], setvars: str | None, unresolved: Sequence[str] = ()) -> Check:
    """``found``: where each of ONEAPI_LIBS resolves (None: nowhere); ``unresolved``: what ldd of the build misses."""
    missing = [lib for lib, where in found.items() if where is None]
    if unresolved:
        missing = sorted(set(missing) | set(unresolved))
    if not missing:
        return Check("oneAPI runtime", "ok", ", ".join(f"{lib} -> {where}" for lib, where in found.items()))
    fix = (f"source {setvars} before arcsplit (or run arcsplit from a shell that did)" if setvars else
           "install the Intel oneAPI Base Toolkit (or its runtime) and the GPU driver (libze-intel-gpu1), then "
           "source /opt/intel/oneapi/setvars.sh")
    where = f"; setvars.sh at {setvars}" if setvars else "; no setvars.sh found"
    return Check("oneAPI runtime", "fail", f"not resolvable: {', '.join(missing)}{where}", fix)


# -- a card already held ----------------------------------------------------------------------------------------


def parse_fdinfo(text: str) -> dict[str, str]:
    """The ``drm-*`` keys of a /proc/PID/fdinfo/FD file (Linux Documentation/gpu/drm-usage-stats.rst)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.startswith("drm-"):
            out[key.strip()] = value.strip()
    return out


_UNITS = {"": 1, "B": 1, "KiB": 1024, "kB": 1024, "MiB": MiB, "GiB": GiB}


def to_bytes(value: str) -> int:
    """``23992 KiB`` / ``16 MiB`` / ``0`` -> bytes (drm-usage-stats: a number with an optional unit); 0 if unreadable."""
    number, _, unit = value.partition(" ")
    return int(number) * _UNITS.get(unit.strip(), 1) if number.isdigit() else 0


def fdinfo_vram(info: Mapping[str, str]) -> int:
    """Device memory a DRM client holds: drm-resident-vram*/drm-total-vram* (xe, amdgpu), drm-memory-vram (older)."""
    for prefix in ("drm-resident-", "drm-total-", "drm-memory-"):
        found = [to_bytes(v) for k, v in info.items() if k.startswith(prefix) and "vram" in k[len(prefix):]]
        if found:
            return sum(found)
    return 0


def holders_check(clients: Sequence[tuple[int, str, str]], slots: Iterable[str]) -> Check:
    """``clients``: (pid, process name, fdinfo text) of other processes with a DRM node open; ``slots``: our cards."""
    ours = {s.lower() for s in slots}
    held: dict[tuple[int, str], int] = {}
    for pid, name, text in clients:
        info = parse_fdinfo(text)
        pdev = info.get("drm-pdev", "").lower()
        if pdev in ours:
            key = (pid, f"{name} on {pdev}")
            held[key] = max(held.get(key, 0), fdinfo_vram(info))
    if not ours:
        return Check("cards in use", "skip", "no card to look for")
    busy = [(pid, what, n) for (pid, what), n in held.items() if n >= 64 * MiB]
    if not busy:
        return Check("cards in use", "ok", "no other process holds device memory on these cards"
                     + (f" ({len(held)} with a node open)" if held else ""))
    text = "; ".join(f"pid {pid} {what} holds {_size(n)}" for pid, what, n in sorted(busy))
    return Check("cards in use", "warn", text, "stop that process first (or pick other cards with --gpus)")


# -- /dev/shm ---------------------------------------------------------------------------------------------------


SHM_FIX = ("give /dev/shm more room: `docker run --shm-size=1g ...` in a container, or "
           "`mount -o remount,size=1G /dev/shm`")


def shm_check(free: int | None, links: int, environ: Mapping[str, str] = os.environ) -> Check:
    """Patch 0008 links llama-server and each rpc-server of this host through rings in /dev/shm (8 MiB a link);
    a link whose rings do not fit stays on loopback TCP, slower, so a small /dev/shm (Docker's 64 MiB) is a warning."""
    name = "shared memory"
    try:
        on = shm_link_on(environ)
    except BadInput as exc:
        return Check(name, "fail", exc.problem, exc.fix)
    if not on:
        return Check(name, "skip", f"{SHM_ENV}=0: the RPC links of this host use loopback TCP")
    need = links * SHM_LINK_BYTES
    if free is None:
        return Check(name, "warn", "no /dev/shm: the RPC links of this host use loopback TCP (slower)", SHM_FIX)
    detail = f"/dev/shm has {_size(free)} free; {links} RPC link(s) on this host need {_size(need)}"
    if free < need:
        return Check(name, "warn", detail + ": those that do not fit use loopback TCP (slower)", SHM_FIX)
    return Check(name, "ok", detail)


# -- host RAM ---------------------------------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def ram_floor(total: int, environ: Mapping[str, str] = os.environ) -> int:
    """The MemAvailable below which a load is stopped."""
    value = environ.get(RAM_ENV)
    if value is not None and value.strip().isdigit():
        return int(value) * MiB
    return max(512 * MiB, min(12 * GiB, int(total * 0.4)))


def low_memory(meminfo_text: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """A one-line reason to stop a load now, or None. Unknown MemAvailable is not a reason."""
    m = parse_meminfo(meminfo_text)
    avail, total = m.get("MemAvailable"), m.get("MemTotal")
    if avail is None or total is None:
        return None
    floor = ram_floor(total, environ)
    if avail >= floor:
        return None
    return (f"host memory is running out during the load ({_size(avail)} available of {_size(total)}, floor "
            f"{_size(floor)}); stopped it before the machine swaps")


def ram_check(meminfo_text: str, backend: str, environ: Mapping[str, str] = os.environ) -> Check:
    m = parse_meminfo(meminfo_text)
    avail, total = m.get("MemAvailable"), m.get("MemTotal")
    if avail is None or total is None:
        return Check("host RAM", "skip", "MemAvailable not in /proc/meminfo")
    if not guard_floor_applies(backend, environ):
        return Check("host RAM", "ok", f"{_size(avail)} available of {_size(total)}")
    floor = ram_floor(total, environ)
    detail = f"{_size(avail)} available of {_size(total)}; a load stops below {_size(floor)}"
    if avail < floor:
        return Check("host RAM", "warn", detail + " (NEO mirrors device allocations in host memory on some runtimes)",
                     f"free memory first, or set {RAM_ENV} lower (0 turns the guard off)")
    return Check("host RAM", "ok", detail)


def guard_floor_applies(backend: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The load guard runs on SYCL (NEO's host mirror), and on any backend once the user sets the floor."""
    return backends.get(backend).intel_runtime or RAM_ENV in environ


def host_ram_short(backend: str, meminfo: str | Path = "/proc/meminfo") -> str | None:
    """The supervisor's load guard: why to stop this load now, or None (checked about once a second)."""
    if not guard_floor_applies(backend):
        return None
    text = _read(Path(meminfo))
    return low_memory(text) if text is not None else None


# -- gathering (I/O) --------------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _resolve(lib: str, root: Path, environ: Mapping[str, str]) -> str | None:
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += [*LIB_DIRS, "/opt/intel/oneapi/compiler/latest/lib", "/opt/intel/oneapi/redist/lib"]
    for d in dirs:
        base = root / d.lstrip("/")
        hits = sorted(base.glob(lib + "*")) if lib.endswith(".so") else [base / lib]
        for hit in hits:
            if hit.exists():
                return str(Path(d) / hit.name)
    return None


def shm_free(dev: Path) -> int | None:
    try:
        st = os.statvfs(dev / "shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def drm_clients(proc: Path, me: int) -> list[tuple[int, str, str]]:
    """(pid, name, fdinfo) of every fd on /dev/dri/* we may read, other processes only."""
    out = []
    for pid_dir in proc.glob("[0-9]*"):
        pid = int(pid_dir.name)
        if pid == me:
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:
            continue
        name = (_read(pid_dir / "comm") or "?").strip()
        for fd in fds:
            try:
                if not os.readlink(fd).startswith("/dev/dri/"):
                    continue
            except OSError:
                continue
            text = _read(pid_dir / "fdinfo" / fd.name)
            if text:
                out.append((pid, name, text))
    return out


def host_checks(backend: str, cards: Sequence[CardFact], bin_dir: Path | None = None, *,
                vram: Mapping[str, int] | None = None, sysfs: str | Path = "/sys", proc: str | Path = "/proc",
                dev: str | Path = "/dev", root: str | Path = "/", environ: Mapping[str, str] = os.environ) -> list[Check]:
    """Every check that applies to ``backend`` on this machine (``cards``: the discrete cards from sysfs)."""
    sysfs, proc, dev, root = Path(sysfs), Path(proc), Path(dev), Path(root)
    checks: list[Check] = []
    be = backends.get(backend)
    gpu = not be.on_cpu
    if gpu:
        for c in cards:
            text = _read(sysfs / "class" / "drm" / c.drm / "device" / "resource")
            label = f"{c.drm} ({c.pci_slot or c.pci_id})"
            checks.append(rebar_check(label, text, (vram or {}).get(c.drm)) if text is not None
                          else Check("Resizable BAR", "skip", f"{label}: resource file not readable"))
        nodes = []
        for node in sorted((dev / "dri").glob("renderD*")):
            try:
                group = grp.getgrgid(node.stat().st_gid).gr_name
            except (KeyError, OSError):
                group = None
            nodes.append((f"/dev/dri/{node.name}", os.access(node, os.R_OK | os.W_OK), group))
        names = []
        for g in os.getgroups():
            try:
                names.append(grp.getgrgid(g).gr_name)
            except KeyError:
                pass
        checks.append(groups_check(nodes, names))
        checks.append(holders_check(drm_clients(proc, os.getpid()), [c.pci_slot for c in cards if c.pci_slot]))
        # all-RPC holds one link per card (an rpc-server each), hybrid one fewer
        checks.append(shm_check(shm_free(dev), max(1, len(cards)), environ))
    if be.intel_runtime:
        found = {lib: _resolve(lib, root, environ) for lib in ONEAPI_LIBS}
        setvars = next((s for s in SETVARS if (root / s.lstrip("/")).exists()), None)
        unresolved: list[str] = []
        lib = bin_dir / be.library if bin_dir and be.library else None
        if lib is not None and lib.exists():
            try:
                out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, timeout=20).stdout
                unresolved = parse_ldd(out)
            except (OSError, subprocess.TimeoutExpired):
                pass
        checks.append(oneapi_check(found, setvars, unresolved))
    text = _read(proc / "meminfo")
    checks.append(ram_check(text, backend, environ) if text is not None else Check("host RAM", "skip", "no /proc/meminfo"))
    return checks
