"""Build llama.cpp's servers from the pinned source, once per (source version, backend, flags).

A build happens in ``build-<key>.partial`` and is renamed to ``build-<key>`` only when every target
exists, so a failed or interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import BadInput, BuildError
from . import patches
from .source import SDIST_VERSION, extract_source, fetch_sdist, llama_root, source_commit

TARGETS = ("llama-server", "ggml-rpc-server", "llama-cli", "llama-bench", "llama-fit-params")
BACKENDS = ("cpu", "cuda", "vulkan", "sycl")

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
_BACKEND_FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": ("-DGGML_NATIVE=ON",),
    "cuda": ("-DGGML_NATIVE=ON", "-DGGML_CUDA=ON"),
    "vulkan": ("-DGGML_NATIVE=ON", "-DGGML_VULKAN=ON"),
    "sycl": ("-DGGML_SYCL=ON", "-DGGML_SYCL_F16=ON", "-DGGML_SYCL_TARGET=INTEL",
             "-DCMAKE_C_COMPILER=icx", "-DCMAKE_CXX_COMPILER=icpx"),
}
# What each backend needs on PATH before anything starts: (program, how to get it).
_TOOLCHAIN: dict[str, tuple[tuple[str, str], ...]] = {
    "cpu": (("cmake", "apt-get install cmake"), ("c++", "apt-get install g++")),
    "cuda": (("cmake", "apt-get install cmake"), ("nvcc", "install the CUDA toolkit and put nvcc on PATH")),
    "vulkan": (("cmake", "apt-get install cmake"), ("glslc", "install the Vulkan SDK (glslc) and libvulkan-dev")),
    "sycl": (("cmake", "apt-get install cmake"),
             ("icpx", "install Intel oneAPI and run `source /opt/intel/oneapi/setvars.sh` first")),
}


@dataclass(frozen=True)
class BuildConfig:
    """Everything that makes two builds different; its key names the build directory."""

    backend: str = "cpu"
    extra_flags: tuple[str, ...] = ()
    # arcsplit's llama.cpp patches (arcsplit/data/patches); False builds the stock tree.
    patched: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise BadInput(f"unknown backend {self.backend!r}", f"use one of {', '.join(BACKENDS)}")

    @property
    def cmake_flags(self) -> tuple[str, ...]:
        return _COMMON + _BACKEND_FLAGS[self.backend] + self.extra_flags

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


def sycl_flags(device_arch: str | None) -> tuple[str, ...]:
    """Optional AOT target for SYCL (e.g. ``bmg_g31`` for the Arc Pro B70)."""
    return (f"-DGGML_SYCL_DEVICE_ARCH={device_arch}",) if device_arch else ()


def is_built(config: BuildConfig) -> bool:
    return all((config.bin_dir / t).exists() for t in TARGETS)


def check_toolchain(backend: str) -> None:
    """Say what is missing before anything is downloaded or compiled."""
    for program, fix in _TOOLCHAIN[backend]:
        if shutil.which(program) is None:
            raise BuildError(f"the {backend} build needs `{program}`, which is not on PATH", fix)


_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def _run_step(name: str, cmd: list[str], log: Path, env: dict[str, str],
              progress: Callable[[str, int | None], None]) -> None:
    progress(name, None)
    with log.open("ab") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                fh.write(raw)
                m = _PROGRESS.match(raw.decode(errors="replace"))
                if m:
                    progress(name, int(m.group(1)))
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        raise BuildError(f"llama.cpp build failed at the {name} step (exit {rc}); its log is {log}",
                         "read the end of that log; fix the toolchain and run `arcsplit llama build` again")


def print_progress(step: str, pct: int | None) -> None:
    if pct is None:
        print(f"arcsplit: {step} …", file=sys.stderr, flush=True)
    elif sys.stderr.isatty():
        print(f"\r  {step}: {pct:3d}%", end="", file=sys.stderr, flush=True)


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
          progress: Callable[[str, int | None], None] = print_progress, source: Path | None = None) -> Path:
    """Fetch, verify, extract and build; returns the bin dir. Reuses a finished build.

    ``source`` builds an already extracted tree instead (a machine that cannot reach PyPI).
    """
    if source is not None:
        _check_source(Path(source))
    if is_built(config) and not force:
        return config.bin_dir
    check_toolchain(config.backend)
    root = llama_root()
    root.mkdir(parents=True, exist_ok=True)
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
    if sys.stderr.isatty():
        print(file=sys.stderr)
    missing = [t for t in TARGETS if not (partial / "bin" / t).exists()]
    if missing:
        raise BuildError(f"the build finished without {', '.join(missing)} (log: {log})",
                         "read the log; the llama.cpp source may have renamed a target")
    # Which patches went in, readable later by `arcsplit llama which` from the bin dir alone.
    (partial / "bin" / patches.MARKER).write_text(
        (src / patches.MARKER).read_text() if config.patched else "stock\n")
    shutil.rmtree(config.build_dir, ignore_errors=True)
    partial.rename(config.build_dir)
    with log.open("a") as fh:
        fh.write(f"\nbuilt in {time.monotonic() - started:.0f} s\n")
    return config.bin_dir
