"""What a llama.cpp binary answered (``--help``, ``--version``), asked once per file and kept under arcsplit's cache.

Asking runs the binary: about 10 ms on CPU, far longer where it initialises a GPU runtime, and it is asked on
every ``serve`` and every node agent's hello. The answer is keyed by the file's resolved path, size and mtime,
so a rebuilt or replaced binary is asked again. Only good answers are kept; a cache that cannot be written costs
the next run one ask.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any, Callable

from .._dirs import cache_dir, keep_json
from ..errors import LlamaError


def cache_path(binary: Path, kind: str, version: int = 1) -> Path:
    """Where ``binary``'s ``kind`` answer is kept (OSError when the binary cannot be read)."""
    st = binary.stat()
    key = f"v{version}|{binary.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def run_flag(binary: Path, flag: str, fix: str, timeout: float = 30.0) -> tuple[str, int]:
    """``binary flag``'s output (stdout, then stderr) and exit code; LlamaError naming ``fix`` when it cannot run."""
    try:
        out = subprocess.run([str(binary), flag], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaError(f"`{binary} {flag}` failed: {exc}", fix) from None
    return out.stdout + "\n" + out.stderr, out.returncode


def answer(path: Path, ask: Callable[[], dict[str, Any]],
           read: Callable[[dict[str, Any]], Any] = lambda d: d) -> Any:
    """``read`` of the answer kept at ``path``, else of ``ask()``'s, which is then kept (``ask`` raises on a bad
    answer: nothing is kept)."""
    try:
        return read(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no or damaged entry: ask the binary
    data = ask()
    result = read(data)
    keep_json(path, data)
    return result
