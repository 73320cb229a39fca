"""Find the llama.cpp binaries arcsplit will run, and tell which build they come from.

Lookup order: ``--llama-dir``, ``$ARCSPLIT_LLAMA_DIR``, ``PATH``, the managed builds. llama-server and the
rpc-server must come from one build (the RPC protocol is only guaranteed between equal builds).

Managed builds are keyed by backend, flags and patch set (``--sycl-arch``, ``--cmake-flag`` and ``--no-patches``
each make another one). ``--build KEY`` names one; otherwise the backend's default build wins, else the newest,
and the note says which was picked when there was a choice.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .. import backends
from ..errors import LlamaError
from .answers import answer, cache_path, run_flag
from .build import ManagedBuild, managed_builds

RPC_NAMES = ("ggml-rpc-server", "rpc-server")
# "version: 9093 (1e5ad35d5)" (release builds) or "version: 0.5.0-dev (build 0, commit 0c1e57098)".
_VERSION = re.compile(r"version:\s*(\d+)\s*\(([0-9a-f]+)\)")
_VERSION_DEV = re.compile(r"version:\s*(\S+)\s*\(build (\d+), commit (\S+)\)")
_BUILT_WITH = re.compile(r"built with (.+?) for (.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class BuildInfo:
    """What ``--version`` says about a binary."""

    build_number: int | None
    commit: str | None
    version: str | None
    compiler: str | None
    target: str | None


@dataclass(frozen=True)
class LlamaBinaries:
    """The binaries of one llama.cpp build, and where they were found."""

    server: Path
    rpc_server: Path
    cli: Path | None
    bench: Path | None
    fit_params: Path | None
    found_by: str
    note: str | None = None  # which managed build was picked among several, and how to pick another

    @property
    def bin_dir(self) -> Path:
        return self.server.parent

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def parse_version(text: str) -> BuildInfo:
    b = _BUILT_WITH.search(text)
    number: int | None = None
    commit: str | None = None
    version: str | None = None
    if m := _VERSION.search(text):
        number, commit, version = int(m.group(1)), m.group(2), f"b{m.group(1)}"
    elif m := _VERSION_DEV.search(text):
        version, number, commit = m.group(1), int(m.group(2)) or None, m.group(3)
        commit = None if commit == "unknown" else commit
    return BuildInfo(
        build_number=number,
        commit=commit,
        version=version,
        compiler=b.group(1).strip() if b else None,
        target=b.group(2) if b else None,
    )


def _in_dir(d: Path, found_by: str) -> LlamaBinaries | None:
    server = d / "llama-server"
    rpc = next((d / n for n in RPC_NAMES if (d / n).exists()), None)
    if not server.exists() or rpc is None:
        return None
    opt = lambda n: (d / n) if (d / n).exists() else None  # noqa: E731
    return LlamaBinaries(server, rpc, opt("llama-cli"), opt("llama-bench"), opt("llama-fit-params"), found_by)


def find_llama(llama_dir: str | Path | None = None, backend: str = backends.CPU, build: str | None = None) -> LlamaBinaries:
    """Resolve the binaries; a directory or build the user names must hold them, or it is an error."""
    if build is not None:
        if llama_dir is not None:
            raise LlamaError("--build and --llama-dir both name the binaries", "give one of them")
        return _managed(pick_build(build, backend), f"--build {build}")
    if llama_dir is not None:
        d = Path(llama_dir)
        found = _in_dir(d, "--llama-dir") or _in_dir(d / "bin", "--llama-dir")
        if found is None:
            raise LlamaError(f"--llama-dir {d} has no llama-server and ggml-rpc-server (or rpc-server)",
                             "point it at a llama.cpp build's bin directory built with -DGGML_RPC=ON")
        return _checked(found)
    env_dir = os.environ.get("ARCSPLIT_LLAMA_DIR")
    if env_dir:
        d = Path(env_dir)
        found = _in_dir(d, "ARCSPLIT_LLAMA_DIR") or _in_dir(d / "bin", "ARCSPLIT_LLAMA_DIR")
        if found is None:
            raise LlamaError(f"ARCSPLIT_LLAMA_DIR={d} has no llama-server and ggml-rpc-server",
                             "fix or unset ARCSPLIT_LLAMA_DIR")
        return _checked(found)
    on_path = shutil.which("llama-server")
    if on_path:
        server = Path(on_path).resolve()
        found = _in_dir(server.parent, "PATH")
        if found is None:
            rpc_path = next((shutil.which(n) for n in RPC_NAMES if shutil.which(n)), None)
            if rpc_path:
                raise LlamaError(f"llama-server ({server}) and the rpc-server ({rpc_path}) are not from one build",
                                 "use binaries from the same build dir, or pass --llama-dir")
        else:
            return _checked(found)
    builds = managed_builds(backend)
    if not builds:
        raise LlamaError(f"no llama.cpp build found for backend {backend}",
                         f"run `arcsplit llama build --backend {backend}` or pass --llama-dir")
    found = _managed(builds[0], "managed")
    if len(builds) == 1 and builds[0].is_default:
        return found
    why = ("the default" if builds[0].is_default else
           "the only one, not the default" if len(builds) == 1 else f"the newest of {len(builds)}, none the default")
    others = ", ".join(b.key for b in builds[1:])
    note = (f"llama.cpp: managed {backend} build {builds[0].key} ({why}"
            + (f"; also built: {others}; pick one with --build KEY)" if others else ")"))
    return replace(found, note=note)


def pick_build(key: str, backend: str | None = None) -> ManagedBuild:
    """The managed build named by its key or a unique prefix of it (``arcsplit llama which --all`` lists them)."""
    builds = managed_builds()
    matches = [b for b in builds if b.key == key] or [b for b in builds if b.key.startswith(key)]
    known = ", ".join(b.key for b in builds) or "none yet"
    if not matches:
        raise LlamaError(f"no managed llama.cpp build is called {key!r} (built: {known})",
                         "list them with `arcsplit llama which --all`")
    if len(matches) > 1:
        raise LlamaError(f"--build {key!r} matches {len(matches)} builds ({', '.join(b.key for b in matches)})",
                         "give more of the key")
    if backend is not None and matches[0].backend != backend:
        raise LlamaError(f"build {matches[0].key} is a {matches[0].backend} build, not {backend}",
                         f"pass --backend {matches[0].backend}, or pick a {backend} build")
    return matches[0]


def _managed(build: ManagedBuild, found_by: str) -> LlamaBinaries:
    found = _in_dir(build.bin_dir, found_by)
    if found is None:  # listed as finished a moment ago: removed since
        raise LlamaError(f"managed build {build.key} has no binaries any more", "rebuild it with `arcsplit llama build`")
    return found


def _checked(found: LlamaBinaries) -> LlamaBinaries:
    """Both binaries must run; a library that does not load is reported now, not at serve time."""
    for exe in (found.server, found.rpc_server):
        if not os.access(exe, os.X_OK):
            raise LlamaError(f"{exe} is not executable", f"chmod +x {exe}")
    return found


def server_build_info(binaries: LlamaBinaries, timeout: float = 30.0) -> BuildInfo:
    """What ``llama-server --version`` says (its build info is compiled in), asked once per binary file
    (llama/answers.py): every serve and every node agent's hello asks."""
    exe = binaries.server
    try:
        path = cache_path(exe, "version")
    except OSError as exc:
        raise LlamaError(f"cannot read {exe}: {exc.strerror}", "rebuild with `arcsplit llama build`") from None

    def ask() -> dict[str, Any]:
        text, rc = run_flag(exe, "--version", "rebuild with `arcsplit llama build`", timeout)
        info = parse_version(text)
        if info.version is None:
            raise LlamaError(f"{exe} --version printed no version (exit {rc})",
                             "check that its shared libraries load; rebuild with `arcsplit llama build`")
        return asdict(info)

    return answer(path, ask, lambda d: BuildInfo(**d))
