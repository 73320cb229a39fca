"""The llama.cpp source arcsplit builds: the tree vendored in a pinned llama-cpp-python sdist from PyPI.

Building the servers and the Python bindings from the same sdist keeps one llama.cpp (one C ABI).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .._dirs import cache_dir
from ..errors import BuildError

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_VENDOR_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
# The sdist keeps the submodule's git dir: its HEAD is the llama.cpp commit we build.
_SUBMODULE_HEAD = f"llama_cpp_python-{SDIST_VERSION}/.git/modules/vendor/llama.cpp/HEAD"
COMMIT_FILE = ".arcsplit-llama-commit"
# Parts of the vendored tree a build never reads; skipping them keeps the extracted source small.
_SKIP = (".git", ".github", ".devops", "docs/", "media/", "benches/", "models/")


def llama_root() -> Path:
    return cache_dir() / "llama.cpp" / SDIST_VERSION


def sdist_path() -> Path:
    return cache_dir() / "sdist" / SDIST_FILE


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_commit(src: Path) -> str | None:
    """The short llama.cpp commit of an extracted tree (the sdist carries no git history to count builds)."""
    try:
        text = (src / COMMIT_FILE).read_text().strip()
    except OSError:
        return None
    return None if text in ("", "unknown") else text


def build_line(build_number: int | None, commit: str | None, version: str | None) -> str:
    """A llama.cpp build as one version a person can look up: a release's build number (``build 9093``, its tag
    b9093) with its commit; else the commit alone. A tree without git history (this sdist's) has no build number,
    and the ``0.5.0-dev`` its --version prints is llama.cpp's CMake project version, the same across many commits;
    the ``0.3.36`` in the cache path is llama-cpp-python's release, whose sdist arcsplit takes the tree from."""
    if build_number is not None:
        return f"build {build_number} ({commit or 'commit unknown'})"
    if not commit:
        return f"version {version} (no build number, no commit)" if version else "not read"
    pinned = commit == source_commit(llama_root() / "src")
    where = (f"the llama.cpp vendored in {SDIST_NAME} {SDIST_VERSION}, arcsplit's pinned source" if pinned
             else "a tree without a release number")
    return f"commit {commit} ({where}; it calls itself {version or 'no version'})"


RPC_HEADER = "ggml/include/ggml-rpc.h"
_RPC_PROTO = re.compile(r"#define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")


def rpc_proto(src: Path) -> str | None:
    """The RPC protocol version ("7.0.0") of a llama.cpp tree, from ggml-rpc.h; None without one. rpc-servers and
    llama-server of another major version refuse each other at the first call (ggml-rpc.cpp's HELLO)."""
    try:
        found = dict(_RPC_PROTO.findall((src / RPC_HEADER).read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return None
    if set(found) != {"MAJOR", "MINOR", "PATCH"}:
        return None
    return f"{found['MAJOR']}.{found['MINOR']}.{found['PATCH']}"


def fetch_sdist(log: Path) -> Path:
    """Download the pinned sdist with pip (PyPI only) and check its hash; cached."""
    target = sdist_path()
    if target.exists() and _sha256(target) == SDIST_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp]
        with log.open("ab") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        got = Path(tmp) / SDIST_FILE
        if rc != 0 or not got.exists():
            raise BuildError(f"downloading {SDIST_NAME} {SDIST_VERSION} from PyPI failed (see {log})",
                             "check that PyPI is reachable, then run `arcsplit llama build` again")
        digest = _sha256(got)
        if digest != SDIST_SHA256:
            raise BuildError(f"{SDIST_FILE} has sha256 {digest[:16]}…, expected {SDIST_SHA256[:16]}…",
                             "the download is corrupt or was tampered with; delete it and retry")
        got.replace(target)
    return target


def extract_source(sdist: Path, dest: Path | None = None) -> Path:
    """Unpack vendor/llama.cpp once into ``dest`` (default: the cache's ``src``); a half-finished
    unpack is never reused."""
    dest = dest or llama_root() / "src"
    if (dest / "CMakeLists.txt").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    import tarfile  # here, not at the top: the node agent imports this module (through llama.build) as it starts

    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(_VENDOR_PREFIX):
                continue
            m.name = m.name[len(_VENDOR_PREFIX):]
            if not m.name or m.name.startswith(_SKIP):
                continue
            members.append(m)
        tar.extractall(partial, members=members, filter="data")
        try:
            head = tar.extractfile(_SUBMODULE_HEAD)
            commit = head.read().decode().strip() if head else ""
        except KeyError:
            commit = ""
    (partial / COMMIT_FILE).write_text(commit[:9] or "unknown")
    partial.rename(dest)
    return dest
