"""llama.cpp's own compute buffers, measured once per model file and plan options and kept as small JSON files.

``arcsplit plan --measure`` fills it (llama/fitparams.measure_compute: on the cards themselves when they are here,
else on CPU rpc-servers standing in for them); every later plan and serve with the same
model file (path, size, mtime, inode of every shard), backend, route and options reads it (memory.MeasuredCompute)
and plans those cards with llama.cpp's numbers instead of the formulas. A file that does not parse is ignored with
a warning: the formulas still bound the plan from above. The llama.cpp build is not part of the key (arcsplit pins
one tree); after building another tree, `plan --measure` again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._dirs import cache_dir, keep_json
from ..memory import MeasuredCompute

VERSION = 1
MAX_ENTRIES = 256  # per file: contexts x splits a user has measured; the oldest go first


@dataclass(frozen=True)
class CacheKey:
    """What a measurement depends on besides the context class, expert offload and split (the entries' keys)."""

    digest: str
    fields: dict[str, Any]

    @property
    def path(self) -> Path:
        return cache_dir() / "compute" / f"{self.digest}.json"


def cache_key(profile: Any, backend: str, mode: str, devices: list[str], options: Any) -> CacheKey:
    """The key of ``profile``'s file on ``backend`` in ``mode`` over ``devices`` with ``options`` (PlanOptions)."""
    shards = []
    for s in profile.shards:
        p = Path(s).resolve()
        try:
            st = p.stat()
            shards.append([str(p), st.st_size, st.st_mtime_ns, st.st_ino])
        except OSError:
            shards.append([str(p), None, None, None])
    o = options
    fields = {"version": VERSION, "model": shards, "backend": backend, "mode": mode, "devices": list(devices),
              "n_parallel": o.n_parallel, "kv_unified": o.kv_unified, "type_k": o.cache_type_k,
              "type_v": o.cache_type_v, "n_batch": o.n_batch, "n_ubatch": o.n_ubatch, "flash_attn": o.flash_attn,
              "swa_full": o.swa_full, "n_outputs": o.n_outputs, "output_on_first": o.output_on_first,
              **({"input_on_first": True} if o.input_on_first else {})}  # keys measured before it stay valid
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return CacheKey(digest, fields)


def load(key: CacheKey) -> tuple[MeasuredCompute | None, str | None]:
    """(the measurements under ``key`` or None, a warning when a file was there but unusable)."""
    try:
        text = key.path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"compute cache {key.path} unreadable ({exc.strerror}); planning from the formulas"
    try:
        raw = json.loads(text)
        if raw["version"] != VERSION or raw["key"] != key.fields:
            raise ValueError("written for another model or options")
        entries = {tuple(int(x) for x in e[:5]): int(e[5]) for e in raw["entries"]}
        if any(len(k) != 5 or v < 0 for k, v in entries.items()):
            raise ValueError("bad entry")
        return MeasuredCompute(str(raw["backend"]), entries), None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return None, (f"ignored compute cache {key.path} ({exc.__class__.__name__}: {exc}); planning from the "
                      f"formulas; `arcsplit plan --measure` writes it again")


def store(key: CacheKey, backend: str, entries: dict[tuple[int, ...], int]) -> MeasuredCompute:
    """Add ``entries`` (measured on ``backend``) to the file under ``key``; returns everything it now holds."""
    old, _ = load(key)
    merged = dict(old.entries) if old is not None and old.backend == backend else {}
    merged.update(entries)
    items = list(merged.items())[-MAX_ENTRIES:]
    data = {"version": VERSION, "key": key.fields, "backend": backend, "entries": [[*k, v] for k, v in items]}
    keep_json(key.path, data)  # a read-only cache only costs the measurement next time
    return MeasuredCompute(backend, dict(items))
