"""The rpc-servers' weight cache on this host: seeded from the GGUF itself (patch 0006), bounded and cleaned.

An rpc-server arcsplit starts on this machine (not a layout's other hosts) sits beside the GGUF, so with a build
carrying patch 0006 it gets ``-c --seed-cache <model>``: the file's tensors are indexed by the FNV-1a hash that
llama.cpp's ``SET_TENSOR_HASH`` carries (once per file version, in parallel, by ``rpc-server --seed-only`` before
the group starts; the index is a few KB) and the rpc-server answers that command from the file, while llama-server
gets ``GGML_RPC_FNV_INDEX`` so it takes the hashes from the same index instead of reading and hashing the weights.
The weights then never cross the socket, and the cache holds no copy of them.

What can still grow is llama.cpp's own cache: a full copy of every big tensor an rpc-server received without a
hit (``--rpc-cache`` on a build without 0006, or a file the index does not cover). :func:`prune` bounds it.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import LlamaError
from ..llama.seeding import SEED_FLAG

INDEX_ENV = "GGML_RPC_FNV_INDEX"  # llama-server: where the indexes are (the rpc-servers' cache directory)
INDEX_SUFFIX = ".fnvidx"
# The index's first line. Version 2 lists tensors from 64 KiB (version 1: from 1 MiB); an rpc-server of this patch
# rebuilds an older one when it seeds, so serve has it rebuilt before the group starts (ensure_index).
INDEX_MAGIC = "ggml-rpc-fnv-index 2"
_COPY = re.compile(r"^[0-9a-f]{16}$")  # llama.cpp's cache entry: the tensor's bytes, named by their hash
_IDENTITY = re.compile(r"^(\d+)-(\d+)-(\d+)-(-?\d+)\.fnvidx$")  # st_dev-st_ino-st_size-st_mtime_ns
_STALE_TMP_S = 3600.0  # an unfinished index older than this was left by a killed rpc-server


def store(cache_root: str | Path) -> Path:
    """Where rpc-server -c keeps its entries when LLAMA_CACHE is ``cache_root`` (tools/rpc/rpc-server.cpp)."""
    return Path(cache_root) / "rpc"


def _identity(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}{INDEX_SUFFIX}"


def index_of(gguf: str | Path, cache_root: str | Path) -> Path | None:
    """The index an rpc-server wrote (or would write) for this GGUF as it is now; None when it cannot be read."""
    name = _identity(Path(gguf))
    return store(cache_root) / name if name else None


@dataclass(frozen=True)
class Pruned:
    """What :func:`prune` removed and what the cache holds afterwards."""

    indexes: int
    copies: int
    freed_bytes: int
    kept_bytes: int


def prune(cache_root: str | Path, keep_copy_bytes: int, now: float | None = None) -> Pruned:
    """Remove indexes whose GGUF is gone or changed (it has another identity then), unfinished index files of
    killed rpc-servers, and the oldest full copies until they total at most ``keep_copy_bytes``."""
    d = store(cache_root)
    now = time.time() if now is None else now
    indexes = copies = freed = 0
    kept: list[tuple[float, int, Path]] = []
    try:
        entries = list(os.scandir(d))
    except OSError:
        return Pruned(0, 0, 0, 0)
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        path = Path(e.path)
        if _IDENTITY.match(e.name):
            if _index_target_unchanged(path):
                kept.append((float("inf"), st.st_size, path))
                continue
            indexes += 1
        elif INDEX_SUFFIX + ".tmp" in e.name:
            if now - st.st_mtime < _STALE_TMP_S:
                continue
        elif _COPY.match(e.name):
            kept.append((st.st_mtime, st.st_size, path))
            continue
        else:
            continue
        path.unlink(missing_ok=True)
        freed += st.st_size
    total = sum(size for mtime, size, _ in kept if mtime != float("inf"))
    for mtime, size, path in sorted(kept):  # oldest copies first; indexes (inf) never
        if total <= keep_copy_bytes or mtime == float("inf"):
            break
        path.unlink(missing_ok=True)
        total -= size
        freed += size
        copies += 1
    return Pruned(indexes, copies, freed, sum(size for _, size, p in kept if p.exists()))


def _index_target_unchanged(index: Path) -> bool:
    """The GGUF named on the index's second line still has the identity in the index's name."""
    try:
        with index.open(encoding="utf-8") as fh:
            fh.readline()
            gguf = fh.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return False
    return bool(gguf) and _identity(Path(gguf)) == index.name


def _current(index: Path) -> bool:
    """The index is there and of this patch's version."""
    try:
        with index.open(encoding="utf-8") as fh:
            return fh.readline().rstrip("\n") == INDEX_MAGIC
    except (OSError, UnicodeDecodeError):
        return False


def ensure_index(rpc_bin: str, cache_root: str, files: Sequence[str], env: Mapping[str, str]) -> float | None:
    """Index the model's files before any rpc-server starts (``--seed-only``), so that no rpc-server spends the
    supervisor's start-up window hashing a big model. Seconds it took, None when every index was there already.
    An rpc-server that finds an index missing anyway (pruned meanwhile) builds it itself. An index of an older
    version is rebuilt here too; a build whose patch predates it keeps the one it has (that is no error)."""
    if all((i := index_of(f, cache_root)) is not None and _current(i) for f in files):
        return None
    argv = [rpc_bin, "--seed-only", "-c", *(x for f in files for x in (SEED_FLAG, f))]
    t0 = time.monotonic()
    run = subprocess.run(argv, env={**env, "LLAMA_CACHE": cache_root}, capture_output=True, text=True,
                         check=False)
    missing = [f for f in files if not ((i := index_of(f, cache_root)) is not None and i.exists())]
    if missing:  # a build without --seed-only prints its usage and exits 0: the index decides
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LlamaError(f"{rpc_bin} could not index {missing[0]} for the rpc-servers' weight cache "
                            f"(exit {run.returncode}: {tail[0]})",
                            "serve with --no-rpc-seed to send the weights over the socket instead")
    return time.monotonic() - t0
