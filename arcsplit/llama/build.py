"""Build llama.cpp's servers from the pinned source, once per (source version, backend, flags).

A build happens in ``build-<key>.partial`` and is renamed to ``build-<key>`` only when every target
exists, so a failed or interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .. import backends
from .._dirs import cache_lock
from ..errors import BadInput, BuildError
from . import patches
from .facts import LIB_DIRS
from .source import SDIST_VERSION, extract_source, fetch_sdist, llama_root, rpc_proto, source_commit

TARGETS = ("llama-server", "ggml-rpc-server", "llama-cli", "llama-bench", "llama-fit-params")

_COMMON = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no UI download at build time; webui.py builds the UI beside the build
    "-DBUILD_SHARED_LIBS=ON",
    # Libraries sit beside the binaries and are found through $ORIGIN, so the build dir can be renamed.
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)


@dataclass(frozen=True)
class BuildConfig:
    """Everything that makes two builds different; its key names the build directory."""

    backend: str = backends.CPU
    extra_flags: tuple[str, ...] = ()
    # arcsplit's llama.cpp patches (arcsplit/data/patches); False builds the stock tree.
    patched: bool = True

    def __post_init__(self) -> None:
        backends.get(self.backend)  # an unknown name is a one-line error

    @property
    def cmake_flags(self) -> tuple[str, ...]:
        flags = backends.get(self.backend).cmake_flags
        host = host_flags(platform.machine()) if "-DGGML_NATIVE=ON" in flags else ()
        return _COMMON + flags + host + self.extra_flags

    @property
    def key(self) -> str:
        parts = self.cmake_flags + ((f"patches={patches.digest()}",) if self.patched else ())
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
        return f"{self.backend}-{digest}"

    @property
    def build_dir(self) -> Path:
        return llama_root() / f"build-{self.key}"

    @property
    def bin_dir(self) -> Path:
        return self.build_dir / "bin"


# Explicit -mno-* flags win over -march=native in GCC and Clang whatever their order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def host_flags(machine: str) -> tuple[str, ...]:
    """What a native (``-march=native``) build adds on this kind of host.

    On x86-64, ggml's AMX kernels are left out: in virtual machines that advertise AMX they trap at the first tile
    instruction (SIGILL in ``tinygemm_kernel_amx`` once llama-server holds Q8 weights on its CPU: llama.cpp #28756,
    and this project's own 2-core CI machines, where a stand-alone AMX test passes but ggml's kernel traps).
    The cost is CPU-held int8 matmuls on bare-metal Sapphire Rapids and later; an AMX build stays one flag away:
    ``arcsplit llama build --cmake-flag=-DCMAKE_C_FLAGS= --cmake-flag=-DCMAKE_CXX_FLAGS=``.
    """
    if machine.lower() in ("x86_64", "amd64"):
        return (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    return ()


CONFIG_FILE = ".arcsplit-build.json"  # in a finished build's bin dir: the BuildConfig it was made from


@dataclass(frozen=True)
class ManagedBuild:
    """A finished build in the user cache; ``config`` is None for one made before arcsplit recorded it."""

    key: str
    bin_dir: Path
    built: float  # mtime of the bin dir: when the build finished
    config: BuildConfig | None

    @property
    def backend(self) -> str:
        return self.key.split("-", 1)[0]

    @property
    def is_default(self) -> bool:
        """What ``arcsplit llama build --backend B`` makes with no other flag."""
        return self.backend in backends.REGISTRY and self.key == BuildConfig(self.backend).key

    def to_dict(self) -> dict[str, object]:
        cfg = self.config
        return {"key": self.key, "backend": self.backend, "bin_dir": str(self.bin_dir), "built": self.built,
                "default": self.is_default, "extra_flags": list(cfg.extra_flags) if cfg else None,
                "patched": cfg.patched if cfg else None}


def managed_builds(backend: str | None = None) -> list[ManagedBuild]:
    """Every finished managed build (of ``backend``, when given): the default key first, then newest first."""
    found = []
    root = llama_root()
    for d in root.glob("build-*") if root.is_dir() else ():
        key = d.name.removeprefix("build-")
        bin_dir = d / "bin"
        if d.suffix == ".partial" or not all((bin_dir / t).exists() for t in TARGETS):
            continue
        config = _read_config(bin_dir)
        if config is None and key.split("-", 1)[0] in backends.REGISTRY and key == BuildConfig(key.split("-", 1)[0]).key:
            config = BuildConfig(key.split("-", 1)[0])  # a default build needs no record to be known
        build = ManagedBuild(key, bin_dir, bin_dir.stat().st_mtime, config)
        if backend is None or build.backend == backend:
            found.append(build)
    return sorted(found, key=lambda b: (not b.is_default, -b.built))


def _read_config(bin_dir: Path) -> BuildConfig | None:
    try:
        data = json.loads((bin_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        return BuildConfig(str(data["backend"]), tuple(str(f) for f in data["extra_flags"]), bool(data["patched"]))
    except (OSError, ValueError, KeyError, TypeError, BadInput):
        return None


@dataclass(frozen=True)
class StaleBuild:
    """A directory of arcsplit's llama.cpp cache that today's arcsplit would never run (``arcsplit llama prune``)."""

    path: Path
    why: str
    size: int  # bytes on disk
    users: tuple[int, ...] = ()  # pids running one of its binaries: then it is kept
    named: bool = False  # ARCSPLIT_LLAMA_DIR points into it: kept too

    @property
    def kept(self) -> bool:
        return bool(self.users) or self.named

    def to_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "why": self.why, "bytes": self.size, "in_use_by": list(self.users),
                "named_by_env": self.named, "kept": self.kept}


def _disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _running_exes() -> list[tuple[int, Path]]:
    """(pid, executable) of every process we may read: a build one of them runs is in use."""
    import psutil  # here, not at the top: the node agent imports this module as it starts

    return [(p.pid, Path(p.info["exe"])) for p in psutil.process_iter(["exe"]) if p.info.get("exe")]


def stale_builds() -> list[StaleBuild]:
    """Builds an upgrade left behind: each was made with another patch set or llama.cpp version than this arcsplit
    pins (its key no longer matches the config it records), or never finished. Builds of today's keys, default or
    not, stay; so does one a process runs, or ``ARCSPLIT_LLAMA_DIR`` names."""
    root = llama_root()
    named = os.environ.get("ARCSPLIT_LLAMA_DIR")
    found: list[tuple[Path, str]] = []
    for other in sorted(root.parent.glob("*")) if root.parent.is_dir() else ():
        if other.is_dir() and other.name != SDIST_VERSION:
            found.append((other, f"llama.cpp of llama-cpp-python {other.name} (this arcsplit pins {SDIST_VERSION})"))
    for d in sorted(root.glob("build-*")) if root.is_dir() else ():
        if not d.is_dir():
            continue
        key = d.name.removeprefix("build-")
        if d.suffix == ".partial":
            found.append((d, "an unfinished build"))
            continue
        config = _read_config(d / "bin")
        backend = key.split("-", 1)[0]
        if config is None and not (backend in backends.REGISTRY and key == BuildConfig(backend).key):
            found.append((d, "made by an older arcsplit (no build record)"))
        elif config is not None and config.key != key:
            found.append((d, "made with another patch set or flags (an older arcsplit)"))
    exes = _running_exes() if found else []
    return [StaleBuild(path, why, _disk_bytes(path), tuple(pid for pid, exe in exes if exe.is_relative_to(path)),
                       bool(named) and Path(str(named)).resolve().is_relative_to(path.resolve()))
            for path, why in found]


def prune(dry_run: bool = False, progress: Callable[[str, int | None], None] | None = None) -> list[StaleBuild]:
    """Remove the stale builds nothing runs (and their build logs); returns what was found. Holds the build lock, so
    no build is half-removed under a build, or the reverse."""
    root = llama_root()
    with _build_lock(progress or _quiet):
        found = stale_builds()
        if not dry_run:
            for s in found:
                if s.kept:
                    continue
                shutil.rmtree(s.path, ignore_errors=True)
                log = s.path.parent / f"{s.path.name.removesuffix('.partial')}.log"
                if s.path.parent == root and log.is_file() and not log.with_suffix("").is_dir():
                    log.unlink()
    return found


def cache_trees(bin_dir: Path) -> list[Path]:
    """The extracted trees a managed build in ``bin_dir`` was made from, under arcsplit's cache: the PyPI tree with
    the patches, a ``--source`` copy, the stock one ([] for a build outside the cache)."""
    root = llama_root()
    if not bin_dir.resolve().is_relative_to(root.resolve()):
        return []
    return [root / "src", root / "src-source", root / "src-stock"]


def build_rpc_proto(bin_dir: Path) -> str | None:
    """The RPC protocol version of the build in ``bin_dir``: recorded by the managed build, else read from the tree it
    was built from - the cache's extracted tree for a managed build made before the record (the same pinned source;
    arcsplit's patches leave the protocol alone), or the checkout around a ``build/bin`` of the user's own. None when
    neither is there (a packaged build): the inventory check then compares the commit only."""
    try:
        recorded = json.loads((bin_dir / CONFIG_FILE).read_text(encoding="utf-8")).get("rpc_proto")
        if recorded:
            return str(recorded)
    except (OSError, ValueError, AttributeError):
        pass
    trees = cache_trees(bin_dir) + [bin_dir.parent.parent, bin_dir.parent.parent.parent]
    return next((v for v in map(rpc_proto, trees) if v), None)


def sycl_flags(device_arch: str | None) -> tuple[str, ...]:
    """Optional AOT target for SYCL (e.g. ``bmg_g31`` for the Arc Pro B70)."""
    return (f"-DGGML_SYCL_DEVICE_ARCH={device_arch}",) if device_arch else ()


def is_built(config: BuildConfig) -> bool:
    return all((config.bin_dir / t).exists() for t in TARGETS)


def check_toolchain(backend: str, flags: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Say what is missing before anything is downloaded or compiled; returns notes on what the build will lack."""
    found = find_vulkan(flags) if backend == backends.VULKAN else None
    for program, fix in backends.get(backend).toolchain:
        if found is not None and program == "glslc":
            continue  # it may be in $VULKAN_SDK/bin, not on PATH: vulkan_problem looks in both
        if shutil.which(program) is None:
            raise BuildError(f"the {backend} build needs `{program}`, which is not on PATH", fix)
    if found is None:
        return ()
    problem = vulkan_problem(found)
    if problem:
        raise BuildError(*problem)
    return vulkan_notes(found)


# The pinned tree's ggml-vulkan.cpp creates its instance with VK_EXT_layer_settings (vk::LayerSettingEXT):
# Vulkan headers without it (Debian 12 ships 1.3.239) fail to compile it, after the long shader step.
_VULKAN_NEEDS = "VK_EXT_layer_settings"
_VULKAN_HEADERS_FIX = ("install newer Vulkan headers (Debian 13's libvulkan-dev 1.4.309 or the LunarG SDK) and "
                       "set VULKAN_SDK to their prefix; scripts/_vulkan.sh does this on Debian 12")


@dataclass(frozen=True)
class VulkanFound:
    """What the Vulkan build's prerequisites are on this machine, as CMake's FindVulkan will find them."""

    glslc: str | None = None
    spirv_headers: str | None = None  # the SPIRV-HeadersConfig.cmake that find_package(SPIRV-Headers) reads
    headers: str | None = None  # the include dir holding vulkan/vulkan_core.h
    header_version: str | None = None  # "1.3.239", from VK_HEADER_VERSION_COMPLETE
    has_layer_settings: bool = False
    loader: str | None = None  # libvulkan.so, what the build links against
    glslc_lacks: tuple[str, ...] = ()  # of _GLSLC_FAST_PATHS


# ggml-vulkan's CMake asks glslc for these and builds the shaders that use them only when it has them: matrix
# multiplication on the cards' matrix engines (Arc: XMX) and with integer dot products (DP4A). Debian 12's
# glslc (2023.2) has neither; the build still works, slower.
_GLSLC_FAST_PATHS = ("GL_KHR_cooperative_matrix", "GL_EXT_integer_dot_product")


def vulkan_problem(found: VulkanFound) -> tuple[str, str] | None:
    """The first missing or too-old prerequisite of the Vulkan build as (problem, fix); None when it can start."""
    if found.glslc is None:
        return ("the vulkan build needs `glslc` (the shader compiler), which is not on PATH or in $VULKAN_SDK/bin",
                "apt-get install glslc, or install the LunarG Vulkan SDK and set VULKAN_SDK")
    if found.spirv_headers is None:
        return ("the vulkan build needs SPIRV-Headers (CMake package SPIRV-Headers), which is not installed",
                "apt-get install spirv-headers, or set VULKAN_SDK to a Vulkan SDK that has them")
    if found.headers is None:
        return ("the vulkan build needs the Vulkan headers (vulkan/vulkan_core.h), which are not installed",
                "apt-get install libvulkan-dev, or set VULKAN_SDK to a Vulkan SDK")
    if not found.has_layer_settings:
        return (f"the Vulkan headers in {found.headers} ({found.header_version or 'version unknown'}) are too old: "
                f"the pinned llama.cpp needs {_VULKAN_NEEDS}", _VULKAN_HEADERS_FIX)
    if found.loader is None:
        return ("the vulkan build needs the Vulkan loader to link against (libvulkan.so), which is not installed",
                "apt-get install libvulkan-dev")
    return None


def vulkan_notes(found: VulkanFound) -> tuple[str, ...]:
    """What a Vulkan build with these prerequisites will lack, though it builds."""
    if not found.glslc_lacks:
        return ()
    return (f"{found.glslc} lacks {', '.join(found.glslc_lacks)}: this Vulkan build will multiply matrices "
            "without the cards' matrix engines or integer dot products (slower, most of all on prompts); "
            "a newer glslc (Debian 13's, or the LunarG SDK's) has them",)


def _glslc_lacks(glslc: str) -> tuple[str, ...]:
    """The fast-path GLSL extensions this glslc rejects, asked the way ggml-vulkan's CMake asks."""
    lacks = []
    for ext in _GLSLC_FAST_PATHS:
        shader = f"#version 450\n#extension {ext} : require\nvoid main() {{}}\n"
        try:
            out = subprocess.run([glslc, "-fshader-stage=compute", "--target-env=vulkan1.3", "-o", os.devnull, "-"],
                                 input=shader, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ()  # not a verdict on the extensions; the build's own test will decide
        if f"extension not supported: {ext}" in out.stderr:
            lacks.append(ext)
    return tuple(lacks)


def _vulkan_header_facts(include: Path) -> tuple[str | None, bool]:
    """(the headers' version, whether they define the extension the pinned tree needs), from vulkan_core.h."""
    text = (include / "vulkan" / "vulkan_core.h").read_text(errors="replace")
    patch = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    complete = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(\s*\d+,\s*(\d+),\s*(\d+),", text)
    version = (f"{complete.group(1)}.{complete.group(2)}.{patch.group(1)}" if complete and patch
               else patch.group(1) if patch else None)
    return version, f"#define {_VULKAN_NEEDS} 1" in text


def find_vulkan(flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> VulkanFound:
    """Look where FindVulkan looks: ``-DVulkan_INCLUDE_DIR=``, then $VULKAN_SDK, then the system prefixes."""
    env = dict(os.environ) if env is None else env
    sdk = Path(env["VULKAN_SDK"]) if env.get("VULKAN_SDK") else None
    prefixes = ([sdk] if sdk else []) + [Path(p) for p in env.get("CMAKE_PREFIX_PATH", "").split(":") if p] \
        + [Path("/usr/local"), Path("/usr")]
    glslc = sdk / "bin" / "glslc" if sdk else None
    glslc_path = str(glslc) if glslc and glslc.exists() else shutil.which("glslc", path=env.get("PATH"))
    spirv = next((str(c) for p in prefixes for sub in ("share/cmake", "lib/cmake", "lib64/cmake",
                                                       "lib/x86_64-linux-gnu/cmake")
                  if (c := p / sub / "SPIRV-Headers" / "SPIRV-HeadersConfig.cmake").exists()), None)
    includes = [Path(f.split("=", 1)[1]) for f in flags if f.startswith("-DVulkan_INCLUDE_DIR=")] \
        + [p / "include" for p in prefixes]
    headers = next((d for d in includes if (d / "vulkan" / "vulkan_core.h").exists()), None)
    version, layer_settings = _vulkan_header_facts(headers) if headers else (None, False)
    lib_dirs = ([sdk / "lib"] if sdk else []) + [Path(d) for d in LIB_DIRS]
    loader = next((str(d / "libvulkan.so") for d in lib_dirs if (d / "libvulkan.so").exists()), None)
    return VulkanFound(glslc=glslc_path, spirv_headers=spirv, headers=str(headers) if headers else None,
                       header_version=version, has_layer_settings=layer_settings, loader=loader,
                       glslc_lacks=_glslc_lacks(glslc_path) if glslc_path else ())


# The build tool's step counter: make's "[ 45%] Building ..." or ninja's "[123/456] Building ..." (CMake picks
# ninja when CMAKE_GENERATOR=Ninja is set).
_PROGRESS = re.compile(r"^\[\s*(?:(?P<pct>\d+)%|(?P<n>\d+)/(?P<m>\d+))\]")


def step_percent(line: str) -> int | None:
    """The percentage done that a make or ninja output line reports, else None."""
    m = _PROGRESS.match(line)
    if m is None:
        return None
    if m.group("pct") is not None:
        return int(m.group("pct"))
    return 100 * int(m.group("n")) // max(1, int(m.group("m")))


def _run_step(name: str, cmd: list[str], log: Path, env: dict[str, str],
              progress: Callable[[str, int | None], None]) -> None:
    progress(name, None)
    with log.open("ab") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                fh.write(raw)
                pct = step_percent(raw.decode(errors="replace"))
                if pct is not None:
                    progress(name, pct)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        raise BuildError(f"llama.cpp build failed at the {name} step (exit {rc}); its log is {log}",
                         "read the end of that log; fix the toolchain and run `arcsplit llama build` again")


def _quiet(step: str, pct: int | None) -> None:
    """The default progress callback: library code says nothing; the CLI passes one that prints."""


def _check_source(src: Path) -> None:
    if not (src / "CMakeLists.txt").exists() or not (src / "tools" / "rpc").is_dir():
        raise BadInput(f"--source {src} is not a llama.cpp source tree", "point it at the tree's top directory")


def _managed_tree(sdist: Path, patched: bool, log: Path, progress: Callable[[str, int | None], None]) -> Path:
    """The extracted tree to build: ``src`` carries the current patch set, ``src-stock`` none.

    The patched tree keeps the name ``src`` so ccache's relative paths, and so its hits, survive a
    change of the patch set; a tree patched with another set, or half patched, is unpacked again.
    """
    root = llama_root()
    if not patched:
        return extract_source(sdist, root / "src-stock")
    dest = root / "src"
    if (dest / "CMakeLists.txt").exists() and patches.applied(dest) == patches.digest():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    extract_source(sdist, dest)
    progress("patch", None)
    patches.apply(dest, log)
    return dest


def build(config: BuildConfig, jobs: int | None = None, force: bool = False,
          progress: Callable[[str, int | None], None] = _quiet, source: Path | None = None) -> Path:
    """Fetch, verify, extract and build; returns the bin dir. Reuses a finished build.

    ``source`` builds an already extracted tree instead (a machine that cannot reach PyPI).
    """
    if source is not None:
        _check_source(Path(source))
    if is_built(config) and not force:
        return config.bin_dir
    for note in check_toolchain(config.backend, config.extra_flags):
        progress(f"note: {note}", None)
    root = llama_root()
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(progress):
        if is_built(config) and not force:
            return config.bin_dir  # another process built it while this one waited
        return _build_locked(config, jobs, force, progress, source, root)


@contextlib.contextmanager
def _build_lock(progress: Callable[[str, int | None], None]) -> Iterator[None]:
    """One writer of the cache at a time (_dirs.cache_lock): builds share the extracted, patched source and a build
    key's directories, so two at once (two terminals, parallel test runs) would trample each other's files."""
    with cache_lock(lambda: progress("waiting for another arcsplit process writing the cache", None)):
        yield


def _build_locked(config: BuildConfig, jobs: int | None, force: bool,
                  progress: Callable[[str, int | None], None], source: Path | None, root: Path) -> Path:
    log = root / f"build-{config.key}.log"
    log.write_text(f"arcsplit llama build, llama-cpp-python {SDIST_VERSION}, {config.backend}\n")
    if source is not None:
        src = Path(source)
        if config.patched:
            # The user's tree is never modified: the patches go onto a copy in the cache.
            progress("patch", None)
            copy = root / "src-source"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(src, copy, symlinks=True)
            try:
                patches.apply(copy, log)
            except BuildError:
                shutil.rmtree(copy, ignore_errors=True)  # no half-patched tree left behind
                raise
            src = copy
    else:
        progress("fetch", None)
        src = _managed_tree(fetch_sdist(log), config.patched, log, progress)
    partial = config.build_dir.with_name(config.build_dir.name + ".partial")
    if force:
        shutil.rmtree(config.build_dir, ignore_errors=True)
    env = dict(os.environ)
    flags = list(config.cmake_flags)
    commit = source_commit(src)
    if commit:
        flags.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    if shutil.which("ccache"):
        flags += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        # Relative paths in the compile commands let every build dir under root share cache entries.
        env.setdefault("CCACHE_BASEDIR", str(root))
    started = time.monotonic()
    _run_step("configure", ["cmake", "-S", str(src), "-B", str(partial), *flags], log, env, progress)
    jobs = jobs or os.cpu_count() or 2
    _run_step("compile", ["cmake", "--build", str(partial), "-j", str(jobs), "--target", *TARGETS],
              log, env, progress)
    missing = [t for t in TARGETS if not (partial / "bin" / t).exists()]
    if missing:
        raise BuildError(f"the build finished without {', '.join(missing)} (log: {log})",
                         "read the log; the llama.cpp source may have renamed a target")
    # Which patches went in, readable later by `arcsplit llama which` from the bin dir alone.
    (partial / "bin" / patches.MARKER).write_text(
        (src / patches.MARKER).read_text() if config.patched else "stock\n")
    (partial / "bin" / CONFIG_FILE).write_text(json.dumps(
        {"backend": config.backend, "extra_flags": list(config.extra_flags), "patched": config.patched,
         "rpc_proto": rpc_proto(src)}))
    shutil.rmtree(config.build_dir, ignore_errors=True)
    partial.rename(config.build_dir)
    with log.open("a") as fh:
        fh.write(f"\nbuilt in {time.monotonic() - started:.0f} s\n")
    return config.bin_dir
