"""What a tuned result depends on, and where it is kept: one JSON file per fingerprint in the user cache.

A result holds while the cards and their driver, NEO and the xe module, the llama.cpp build, the model, the
context and the slots stay the same; any change gives another fingerprint, so the old result is simply not found
(invalidated without being deleted; ``tune --fresh`` ignores it). The model's part is cheap: a SHA-256 of the
GGUF's first MiB (header and tensor table) with the file's size and mtime, not a hash of gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._dirs import cache_dir, keep_json

CACHE_VERSION = 1
HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class Fingerprint:
    backend: str
    cards: tuple[str, ...]  # "index:name:total bytes" per card, in --gpus order
    driver: str  # the kernel driver module's version (xe, i915, nvidia, amdgpu) where sysfs gives one
    neo: str  # NEO's version (SYCL), "" elsewhere or unread
    xe: str  # the loaded xe module's version or srcversion (a DKMS backport carries the fix on an old kernel)
    kernel: str  # uname -r
    build: str  # llama-server's path, mtime and size (a rebuild in place changes it)
    model: str  # model_digest()
    ctx: int | None
    parallel: int

    @property
    def digest(self) -> str:
        data = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(data).hexdigest()[:20]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "digest": self.digest}

    def changed(self, other: "Fingerprint") -> list[str]:
        """The parts that differ from ``other`` (what invalidated its result)."""
        a, b = asdict(self), asdict(other)
        return [k for k in a if a[k] != b[k]]


def model_digest(path: str | Path) -> str:
    """SHA-256 of the first MiB, with size and mtime: a new download or an edit in place changes it."""
    p = Path(path)
    st = p.stat()
    with p.open("rb") as f:
        head = hashlib.sha256(f.read(HEADER_BYTES)).hexdigest()[:16]
    return f"{head}:{st.st_size}:{st.st_mtime_ns}"


def build_id(server: str | Path) -> str:
    try:
        st = Path(server).stat()
        return f"{server}@{st.st_mtime_ns}:{st.st_size}"
    except OSError:
        return str(server)


def module_version(name: str, sysfs_root: str | Path = "/sys") -> str:
    """A loaded kernel module's ``version`` (DKMS and out-of-tree builds set one), else its ``srcversion``; ""
    when it is not loaded."""
    base = Path(sysfs_root) / "module" / name
    for leaf in ("version", "srcversion"):
        try:
            text = (base / leaf).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text:
            return f"{leaf} {text}"
    return ""


def tune_dir() -> Path:
    """``ARCSPLIT_TUNE_DIR`` overrides (a bench or a test keeps its results apart from the user's)."""
    override = os.environ.get("ARCSPLIT_TUNE_DIR")
    return Path(override) if override else cache_dir() / "tune"


def anything_kept() -> bool:
    """Whether any fingerprint has results: serve asks this before it works out its own fingerprint."""
    try:
        return any(tune_dir().glob("*.json"))
    except OSError:
        return False


def path_for(fp: Fingerprint) -> Path:
    return tune_dir() / f"{fp.digest}.json"


def load(fp: Fingerprint) -> dict[str, Any]:
    """The stored results of this fingerprint: {"results": {key: result}, "pick": {objective: key}, ...}; empty
    when none (or another cache version)."""
    try:
        data = json.loads(path_for(fp).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    return data


def store(fp: Fingerprint, data: dict[str, Any]) -> bool:
    """Keep ``data`` (results so far: a later run resumes from them) for this fingerprint."""
    return keep_json(path_for(fp), {**data, "version": CACHE_VERSION, "fingerprint": fp.to_dict(),
                                    "updated": time.time()}, indent=1)
