"""What the GPU runtime under llama.cpp is: NEO, Level Zero loader, oneAPI, kernel, cards, llama.cpp build.

Gathered without root, every source optional: each reading names its source, and each source that could
not be read is listed with the reason, because a diagnosis that silently skips a source misleads. The
parsers are pure (they take the text users paste into bug reports); ``gather_facts`` does the I/O.
Formats: sycl-ls as intel/llvm's sycl/tools/sycl-ls/sycl-ls.cpp prints it; clinfo, dpctl, package lists, sysfs and
ggml-sycl's device table as users pasted them (verbatim samples and their sources: tests/fixtures/runtime/SOURCES.md).
"""

from __future__ import annotations

import gzip
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..backends import REGISTRY, SYCL
from ..errors import BadInput
from .source import build_line

TIMEOUT_S = 20.0

# NEO release form YY.WW.BUILD[.HOTFIX] (packages, OpenCL "NEO  [26.18.38308.1]", clinfo, dpctl OpenCL).
_NEO_RELEASE = re.compile(r"(?<![\d.])(\d{2})\.(\d{2})\.(\d{5})(?:\.(\d+))?(?![\d])")
# Level Zero driver form 1.API.BUILD[+HOTFIX | .HOTFIX] (sycl-ls L0 line, ggml-sycl table, dpctl L0).
_NEO_L0 = re.compile(r"(?<![\d.])1\.(\d{1,2})\.(\d{5})(?:[+.](\d+))?(?![\d])")
_SONAME = re.compile(r"libze_intel_gpu\.so\.1\.(\d+)\.(\d{5})")

# Packages that carry NEO's version, per distro (Intel's GitHub debs and the kobuk-team PPA, Fedora, openSUSE, Arch);
# the loader and legacy names separately.
NEO_PACKAGES = ("libze-intel-gpu1", "libze_intel_gpu1", "intel-opencl-icd", "intel-compute-runtime",
                "intel-level-zero-gpu", "intel-level-zero", "intel-opencl")
LOADER_PACKAGES = ("libze1", "level-zero", "oneapi-level-zero", "level-zero-loader")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/opt/intel/oneapi/redist/lib")

# PCI ids seen in users' reports and lspci (e.g. ggml-org/llama.cpp#22885); unknown ids still count as cards, unnamed.
PCI_NAMES = {
    "8086:e223": "Intel Arc Pro B70/B65 (Battlemage G31)",
    "8086:e211": "Intel Arc Pro B60 (Battlemage G21)",
    "8086:e212": "Intel Arc Pro B50 (Battlemage G21)",
    "8086:e20b": "Intel Arc B580 (Battlemage G21)",
    "8086:56a0": "Intel Arc A770 (Alchemist DG2)",
}
VENDORS = {"8086": "intel", "10de": "nvidia", "1002": "amd"}


@dataclass(frozen=True)
class NeoVersion:
    """One reading of the NEO (intel compute-runtime) version; ``build`` is what the rules compare."""

    build: int
    release: str | None  # "26.05.37020.3" when the source shows the full release, else None
    raw: str
    source: str

    @property
    def label(self) -> str:
        return self.release or f"build {self.build} ({self.raw})"


@dataclass(frozen=True)
class SyclDevice:
    """One device line of ``sycl-ls`` (or one Device block of ``sycl-ls --verbose``)."""

    backend: str
    type: str
    index: int | None
    platform: str
    name: str
    version: str
    driver: str


@dataclass(frozen=True)
class KernelFacts:
    release: str | None
    version: tuple[int, ...] | None
    move_notify: bool | None  # CONFIG_DMABUF_MOVE_NOTIFY: True set, False "is not set", None unknown
    config_source: str | None
    # The loaded xe module: its version (or srcversion) from sysfs, and whether it is an out-of-tree (DKMS) build,
    # as Intel's backport of a newer xe to older kernels is (intel-gpu/xekmd-backports#451): `uname -r` then
    # understates the driver. None: not read (no xe loaded, or another machine's files).
    xe_module: str | None = None
    xe_backport: bool | None = None


@dataclass(frozen=True)
class CardFact:
    """A DRM card in sysfs. ``cardN`` numbers are not Level Zero's order (an iGPU can sit between two cards)."""

    drm: str
    pci_id: str | None
    pci_slot: str | None
    driver: str | None
    vendor: str | None
    name: str | None


@dataclass(frozen=True)
class Facts:
    neo: NeoVersion | None
    neo_readings: tuple[NeoVersion, ...]
    level_zero_loader: str | None
    oneapi: str | None
    kernel: KernelFacts
    cards: tuple[CardFact, ...]
    sycl_devices: tuple[SyclDevice, ...]
    llama_build: str | None
    unread: tuple[str, ...] = ()  # "source: why it could not be read"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["neo"] = None if self.neo is None else {**asdict(self.neo), "label": self.neo.label}
        return d


# ----------------------------------------------------------------------------------------------------------
# Parsers (pure)


def parse_neo_version(text: str, source: str) -> NeoVersion | None:
    """The NEO build from a release string (26.05.37020.3) or an L0 driver string (1.14.37020+3)."""
    text = text.strip()
    m = _NEO_RELEASE.search(text)
    if m and 18 <= int(m.group(1)) <= 40:
        rel = ".".join(g for g in m.groups() if g is not None)
        return NeoVersion(int(m.group(3)), rel, text, source)
    m = _NEO_L0.search(text)
    if m:
        return NeoVersion(int(m.group(2)), None, text, source)
    m = _SONAME.search(text)
    if m:
        return NeoVersion(int(m.group(2)), None, text, source)
    return None


_SYCL_LS_LINE = re.compile(
    r"^\[(?P<backend>[\w]+):(?P<type>\w+)\](?:\[\w+:(?P<index>\d+)\])?\s+(?P<platform>[^,]+),\s+(?P<rest>.*?)"
    r"\s*\[(?P<driver>[^\]]*)\]\s*$")


def parse_sycl_ls(text: str) -> list[SyclDevice]:
    """Concise ``sycl-ls`` lines and, if present, the ``--verbose`` Device blocks (deduplicated)."""
    devices: list[SyclDevice] = []
    for line in text.splitlines():
        m = _SYCL_LS_LINE.match(line.strip())
        if not m:
            continue
        rest = m.group("rest").strip()
        if " OpenCL " in f" {rest}":
            cut = f" {rest}".index(" OpenCL ")
            name, version = rest[:max(cut - 1, 0)].strip(), rest[cut:].strip()
        else:
            name, _, version = rest.rpartition(" ")
        devices.append(SyclDevice(m.group("backend").replace("ext_oneapi_", ""), m.group("type"),
                                  int(m.group("index")) if m.group("index") else None,
                                  m.group("platform").strip(), name.strip(), version, m.group("driver").strip()))
    if not devices:
        devices.extend(_parse_sycl_ls_verbose(text))
    return devices


def _parse_sycl_ls_verbose(text: str) -> list[SyclDevice]:
    platform_name, out = "", []
    current: dict[str, str] | None = None
    counters: dict[str, int] = {}

    def flush() -> None:
        if current is not None and current.get("Driver"):
            backend = "level_zero" if "Level-Zero" in platform_name else "opencl" if "OpenCL" in platform_name else "?"
            kind = current.get("Type", "?")
            idx = counters.get(backend, 0)
            counters[backend] = idx + 1
            out.append(SyclDevice(backend, kind, idx, platform_name, current.get("Name", ""),
                                  current.get("Version", ""), current["Driver"]))

    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Platform [#"):
            flush()
            current = None
            platform_name = ""
        elif s.startswith("Device [#"):
            flush()
            current = {}
        elif ":" in s:
            key, _, value = s.partition(":")
            key, value = key.strip(), value.strip()
            if current is None and key == "Name":
                platform_name = value
            elif current is not None and key in ("Type", "Version", "Name", "Driver"):
                current[key] = value
    flush()
    return out


def neo_from_sycl(devices: Iterable[SyclDevice], source: str) -> list[NeoVersion]:
    """GPU devices only: a CPU OpenCL runtime's version is not NEO's."""
    readings = []
    for d in devices:
        if d.type != "gpu":
            continue
        v = parse_neo_version(d.driver, f"{source} ({d.backend}: {d.name})")
        if v:
            readings.append(v)
    return readings


_GGML_ROW = re.compile(r"^\|\s*(\d+)\|\s*\[([\w]+):(\w+):(\d+)\]\|\s*(.*?)\|\s*([\d.]+)\|.*\|\s*(\d+)M\|\s*(\S+)\|\s*$")


def parse_ggml_sycl_table(text: str) -> list[SyclDevice]:
    """The ``Found N SYCL devices:`` table that ggml-sycl prints at init (ggml-org/llama.cpp#21747)."""
    out = []
    for line in text.splitlines():
        s = re.sub(r"^(?:\[\d+\]\s*|[\d.]+\s+[A-Z]\s+)", "", line.strip())
        m = _GGML_ROW.match(s)
        if m:
            out.append(SyclDevice(m.group(2), m.group(3), int(m.group(4)), "ggml-sycl", m.group(5).strip(),
                                  m.group(6), m.group(8)))
    return out


def parse_clinfo(text: str) -> list[NeoVersion]:
    """``clinfo``: ``Driver Version   26.05.37020.3`` per device; only NEO-shaped versions count."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*Driver Version\s+(\S+)", line)
        if m:
            v = parse_neo_version(m.group(1), "clinfo")
            if v and v.release:
                out.append(v)
    return out


def parse_dpctl(text: str) -> list[NeoVersion]:
    """``python -m dpctl -f``: the device ``Version`` under a level_zero or GPU OpenCL platform."""
    out, backend, plat = [], "", ""
    in_device = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Platform") and s.endswith("::"):
            backend, plat, in_device = "", "", False
            continue
        if s.startswith("# "):
            in_device = True
            continue
        key, _, value = s.partition(" ")
        value = value.strip()
        if key == "Name" and not in_device:
            plat = value
        elif key == "Backend" and not in_device:
            backend = value
        elif key == "Version" and in_device and (backend == "level_zero" or "Graphics" in plat):
            v = parse_neo_version(value, f"dpctl ({plat})")
            if v:
                out.append(v)
    return out


def parse_packages(text: str) -> dict[str, str]:
    """``name<TAB or space>version`` lines (dpkg-query -f, rpm --qf, pacman -Q)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and re.match(r"^\d", parts[1]):
            out[parts[0]] = parts[1]
    return out


def neo_from_packages(packages: dict[str, str], manager: str) -> list[NeoVersion]:
    out = []
    for name in NEO_PACKAGES:
        if name in packages:
            version = packages[name]
            v = parse_neo_version(version.split("-")[0] if name != "intel-level-zero-gpu" else version,
                                  f"{manager} {name}")
            if v:
                out.append(v)
    return out


def loader_from_packages(packages: dict[str, str]) -> str | None:
    for name in LOADER_PACKAGES:
        if name in packages:
            return packages[name].split("-")[0]
    return None


def parse_uevent(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_kernel_release(release: str) -> tuple[int, ...] | None:
    """``6.19.10-300.fc44.x86_64`` -> (6, 19, 10); ``7.1-rc1`` -> (7, 1)."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", release)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def parse_kernel_config(text: str) -> bool | None:
    """CONFIG_DMABUF_MOVE_NOTIFY: True if =y, False if "is not set"; None if the file does not mention it."""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("CONFIG_DMABUF_MOVE_NOTIFY="):
            return s.split("=", 1)[1].strip() in ("y", "m")
        if s == "# CONFIG_DMABUF_MOVE_NOTIFY is not set":
            return False
    return None


# ----------------------------------------------------------------------------------------------------------
# Gathering (I/O; every call bounded by a timeout, no shell)


def _run(argv: Sequence[str], timeout: float = TIMEOUT_S, env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(output, why-not): output None when the tool is missing, timed out or failed."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None, f"{argv[0]} not found"
    try:
        p = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return None, f"{argv[0]} did not finish in {timeout:.0f} s"
    except OSError as exc:
        return None, f"{argv[0]}: {exc.strerror}"
    if p.returncode != 0 and not p.stdout.strip():
        return None, f"{argv[0]} exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:120]}"
    return p.stdout + ("\n" + p.stderr if p.stderr else ""), ""


def read_text(path: str | Path, what: str) -> str:
    """A file the user named: missing or unreadable is bad input, not a silent gap."""
    p = Path(path)
    try:
        if p.suffix == ".gz":
            return gzip.decompress(p.read_bytes()).decode("utf-8", "replace")
        return p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise BadInput(f"{what} file {p} does not exist", "check the path") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise BadInput(f"cannot read {what} file {p}: {exc}", "pass a readable text file") from None


def _on_host(root: Path, path: str | Path) -> Path:
    """``path`` of this machine, seen under ``root`` (``/`` on a real machine; a temp tree in tests)."""
    return root / str(path).lstrip("/")


def _resolve_soname(name: str, root: Path = Path("/")) -> Path | None:
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(LIB_DIRS)
    for d in dirs:
        p = _on_host(root, d) / name
        if p.exists():
            return p.resolve()
    return None


def discover_cards(sysfs_root: str | Path = "/sys") -> tuple[list[CardFact], str | None]:
    """DRM cards from ``<root>/class/drm/card*/device`` (connectors like card0-DP-1 skipped)."""
    base = Path(sysfs_root) / "class" / "drm"
    if not base.is_dir():
        return [], f"{base} does not exist (no DRM driver loaded)"
    cards = []
    for entry in sorted(base.iterdir(), key=lambda p: (len(p.name), p.name)):
        if not re.fullmatch(r"card\d+", entry.name):
            continue
        dev = entry / "device"
        try:
            ue = parse_uevent((dev / "uevent").read_text())
        except OSError:
            ue = {}
        pci = ue.get("PCI_ID", "").lower() or None
        if pci is None:
            try:
                vendor = (dev / "vendor").read_text().strip().removeprefix("0x")
                device = (dev / "device").read_text().strip().removeprefix("0x")
                pci = f"{vendor}:{device}".lower()
            except OSError:
                pci = None
        cards.append(CardFact(entry.name, pci, ue.get("PCI_SLOT_NAME"), ue.get("DRIVER"),
                              VENDORS.get(pci.split(":")[0]) if pci else None, PCI_NAMES.get(pci or "")))
    return cards, None


def _kernel_facts(kernel: str | None, kernel_config: str | Path | None, unread: list[str],
                  root: Path = Path("/")) -> KernelFacts:
    local = platform.release()
    release = kernel if kernel is not None else local
    if kernel is not None and parse_kernel_release(kernel) is None:
        raise BadInput(f"--kernel {kernel!r} is not a kernel version", "pass what `uname -r` prints, e.g. 6.19.10-300.fc44.x86_64")
    if kernel_config is not None:
        return KernelFacts(release, parse_kernel_release(release), parse_kernel_config(read_text(kernel_config, "kernel config")),
                           str(kernel_config))
    if kernel is not None:  # a kernel named by hand describes a report, even when this machine runs the same one
        unread.append("kernel config: --kernel names a kernel, not its config; pass the config with --kernel-config")
        return KernelFacts(release, parse_kernel_release(release), None, None)
    for cand in (Path(f"/boot/config-{local}"), Path("/proc/config.gz"), Path(f"/lib/modules/{local}/config")):
        try:
            raw = _on_host(root, cand).read_bytes()
        except OSError:
            continue
        text = (gzip.decompress(raw) if cand.suffix == ".gz" else raw).decode("utf-8", "replace")
        return KernelFacts(release, parse_kernel_release(release), parse_kernel_config(text), str(cand))
    unread.append(f"kernel config: none of /boot/config-{local}, /proc/config.gz, /lib/modules/{local}/config is readable")
    return KernelFacts(release, parse_kernel_release(release), None, None)


def parse_xe_module(version: str | None, srcversion: str | None, filename: str | None) -> tuple[str | None, bool | None]:
    """(the xe module's version label, whether it is a DKMS/out-of-tree build) from /sys/module/xe/{version,
    srcversion} and ``modinfo -F filename xe``. DKMS installs its modules under /lib/modules/<release>/updates/dkms
    (or extra/), where the kernel's own live under kernel/drivers."""
    label = f"version {version.strip()}" if version and version.strip() else (
        f"srcversion {srcversion.strip()}" if srcversion and srcversion.strip() else None)
    path = (filename or "").strip()
    backport = None if not path else ("/updates/" in path or "/extra/" in path or "dkms" in path)
    return label, backport


def xe_module_facts(sysfs_root: str | Path, timeout: float = TIMEOUT_S) -> tuple[str | None, bool | None]:
    """The running xe module (sysfs) and where modinfo finds it; (None, None) when xe is not loaded."""
    base = Path(sysfs_root) / "module" / "xe"
    if not base.is_dir():
        return None, None

    def leaf(name: str) -> str | None:
        try:
            return (base / name).read_text(encoding="utf-8")
        except OSError:
            return None

    out, _ = _run(["modinfo", "-F", "filename", "xe"], timeout)
    return parse_xe_module(leaf("version"), leaf("srcversion"), out)


def _oneapi_version(llama_compiler: str | None, root: Path = Path("/")) -> tuple[str | None, str | None]:
    for var in ("CMPLR_ROOT", "ONEAPI_ROOT"):
        v = os.environ.get(var, "")
        m = re.search(r"(20\d\d\.\d+(?:\.\d+)?)", v)
        if m:
            return m.group(1), f"${var}"
    latest = _on_host(root, "/opt/intel/oneapi/compiler/latest")
    if latest.exists():
        m = re.search(r"(20\d\d\.\d+(?:\.\d+)?)", latest.resolve().name)
        if m:
            return m.group(1), str(latest)
    if llama_compiler and "IntelLLVM" in llama_compiler:
        return llama_compiler.split()[-1], "llama-server --version (built with)"
    return None, None


def _package_query() -> tuple[dict[str, str], str | None, str]:
    names = list(NEO_PACKAGES + LOADER_PACKAGES)
    if shutil.which("dpkg-query"):
        out, why = _run(["dpkg-query", "-W", "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n", *names])
        if out is None and why.startswith("dpkg-query exited"):
            return {}, "dpkg", ""
        installed = "\n".join(l for l in (out or "").splitlines() if l.rstrip().endswith("ii"))
        return parse_packages(installed), "dpkg", why
    if shutil.which("rpm"):
        out, why = _run(["rpm", "-q", "--qf", "%{NAME}\t%{VERSION}-%{RELEASE}\n", *names])
        return parse_packages(out or ""), "rpm", why if out is None else ""
    if shutil.which("pacman"):
        out, why = _run(["pacman", "-Q", *names])
        return parse_packages(out or ""), "pacman", why if out is None else ""
    return {}, None, "no dpkg-query, rpm or pacman"


def _sycl_ls_file_facts(sycl_ls_file: str | Path, unread: list[str]) -> tuple[list[NeoVersion], list[SyclDevice]]:
    """NEO readings and devices from a pasted sycl-ls: the other machine's, so nothing of this one is mixed in."""
    text = read_text(sycl_ls_file, "sycl-ls")
    sycl_devices = parse_sycl_ls(text) or parse_ggml_sycl_table(text)
    if not sycl_devices:
        raise BadInput(f"{sycl_ls_file} holds no sycl-ls device lines",
                       "paste the output of `sycl-ls` (or `sycl-ls --verbose`) into the file")
    readings = neo_from_sycl(sycl_devices, f"sycl-ls file {sycl_ls_file}")
    if not readings:
        unread.append(f"NEO: {sycl_ls_file} shows no GPU driver version")
    return readings, sycl_devices


def _local_sycl_facts(root: Path, timeout: float,
                      unread: list[str]) -> tuple[list[NeoVersion], list[SyclDevice], str | None]:
    """NEO readings (sycl-ls, the library's soname, packages, clinfo: in the order SYCL trusts them), this
    machine's SYCL devices and the Level Zero loader's version."""
    readings: list[NeoVersion] = []
    sycl_devices: list[SyclDevice] = []
    loader: str | None = None
    out, why = _run(["sycl-ls"], timeout)
    if out is None:
        unread.append(f"sycl-ls: {why}")
    else:
        sycl_devices = parse_sycl_ls(out)
        readings += neo_from_sycl(sycl_devices, "sycl-ls")
    lib = _resolve_soname("libze_intel_gpu.so.1", root)
    v = parse_neo_version(lib.name, f"soname {lib}") if lib else None
    if v:
        readings.append(v)
    else:
        unread.append("libze_intel_gpu.so.1: not found in LD_LIBRARY_PATH or " + ", ".join(LIB_DIRS[:3]))
    packages, manager, why = _package_query()
    if manager is None or why:
        unread.append(f"packages: {why}")
    else:
        readings += neo_from_packages(packages, manager)
        loader = loader_from_packages(packages)
        if not packages:
            unread.append(f"packages: {manager} knows none of {', '.join(NEO_PACKAGES[:3])}, ...")
    out, why = _run(["clinfo"], timeout)
    if out is None:
        unread.append(f"clinfo: {why}")
    else:
        readings += parse_clinfo(out)
    if loader is None:
        lp = _resolve_soname("libze_loader.so.1", root)
        m = re.search(r"libze_loader\.so\.(\d+\.\d+\.\d+)", lp.name) if lp else None
        loader = m.group(1) if m else None
        if loader is None:
            unread.append("Level Zero loader: no libze1/level-zero package, no libze_loader.so.1")
    return readings, sycl_devices, loader


def _pick_neo(readings: list[NeoVersion], wanted: bool, unread: list[str], notes: list[str]) -> NeoVersion | None:
    """The first reading is what SYCL loads; its release filled in from another source of the same build."""
    builds = sorted({r.build for r in readings})
    if len(builds) > 1:
        notes.append("NEO sources disagree (" + "; ".join(f"{r.source}: {r.label}" for r in readings)
                     + "): the first is what SYCL loads; check LD_LIBRARY_PATH for a second install")
    neo = readings[0] if readings else None
    if neo is not None and neo.release is None:
        full = next((r for r in readings if r.release and r.build == neo.build), None)
        if full:
            neo = NeoVersion(neo.build, full.release, neo.raw, neo.source)
    if neo is None and wanted:
        unread.append("NEO version: no source gave it (install sycl-ls from oneAPI, or clinfo)")
    return neo


def _llama_build(build_info: Any, backend: str, unread: list[str]) -> str | None:
    """The llama.cpp build as one line: its number and commit (or version), and the compiler."""
    compiler = getattr(build_info, "compiler", None)
    llama_build = None
    if build_info is None:
        unread.append(f"llama.cpp build: none found; make one with `arcsplit llama build --backend {backend}`")
    elif getattr(build_info, "build_number", None) is not None or getattr(build_info, "version", None):
        llama_build = build_line(build_info.build_number, build_info.commit, build_info.version)
    else:
        unread.append("llama.cpp build: --version printed neither a build number nor a version")
    if llama_build and compiler:
        llama_build += f", built with {compiler}"
    return llama_build


def gather_facts(backend: str = SYCL, build_info: Any = None, sycl_ls_file: str | Path | None = None,
                 kernel: str | None = None, kernel_config: str | Path | None = None,
                 sysfs_root: str | Path | None = "/sys", timeout: float = TIMEOUT_S, host_root: str | Path = "/") -> Facts:
    """Read every source that exists. With ``--sycl-ls FILE`` NEO comes from the file only: it describes
    another machine (a bug report), and mixing in this machine's packages would misdiagnose it.

    ``host_root`` is where this machine's files are read (libraries, /boot, /opt/intel); the tools come from
    PATH. Tests point both at trees of their own, so no result depends on what the host has installed."""
    root = Path(host_root)
    known = REGISTRY.get(backend)
    intel = known is not None and known.intel_runtime
    unread: list[str] = []
    notes: list[str] = []
    readings: list[NeoVersion] = []
    sycl_devices: list[SyclDevice] = []
    loader: str | None = None
    if sycl_ls_file is not None:
        readings, sycl_devices = _sycl_ls_file_facts(sycl_ls_file, unread)
    elif intel:  # NEO, Level Zero and oneAPI only matter under SYCL; no point listing them as unread
        readings, sycl_devices, loader = _local_sycl_facts(root, timeout, unread)
    neo = _pick_neo(readings, intel, unread, notes)
    llama_build = _llama_build(build_info, backend, unread)
    compiler = getattr(build_info, "compiler", None)
    oneapi, _src = _oneapi_version(compiler, root) if sycl_ls_file is None and intel else (None, None)
    if oneapi is None and intel:
        unread.append("oneAPI: not in the sycl-ls file" if sycl_ls_file is not None
                      else "oneAPI: no $CMPLR_ROOT/$ONEAPI_ROOT, no /opt/intel/oneapi/compiler/latest")
    kfacts = _kernel_facts(kernel, kernel_config, unread, root)
    if sysfs_root is not None and kernel is None and kernel_config is None:  # this machine's running module
        xe, backport = xe_module_facts(sysfs_root, timeout)
        kfacts = replace(kfacts, xe_module=xe, xe_backport=backport)
    cards, why_cards = discover_cards(sysfs_root) if sysfs_root is not None else ([], None)  # None: another machine
    if why_cards:
        unread.append(f"cards: {why_cards}")
    return Facts(neo, tuple(readings), loader, oneapi, kfacts, tuple(cards), tuple(sycl_devices), llama_build,
                 tuple(unread), tuple(notes))
