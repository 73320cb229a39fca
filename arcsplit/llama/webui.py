"""llama.cpp's web UI for the managed build: built once with npm from the pinned tree's ``tools/ui`` and served
by llama-server from a directory (``--path``); without it, ``GET /`` is a small page that says how to get it.

Why a directory and not llama.cpp's embedded UI (``-DLLAMA_BUILD_UI=ON``): the UI then needs no llama.cpp
compile of its own, one UI serves every backend's build, and a missing Node.js never fails a llama.cpp build.
The embedded route's other source, ``LLAMA_USE_PREBUILT_UI``, downloads assets at build time from outside
the pinned sdist, so the managed build keeps it off.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from .._dirs import cache_lock
from .patches import build_patches
from .source import extract_source, fetch_sdist, llama_root

FALLBACK_DIR = Path(__file__).resolve().parent.parent / "data" / "webui"


def ui_dir(root: Path | None = None) -> Path:
    """The built UI (index.html and its assets), beside the builds of one pinned llama.cpp version."""
    return (root or llama_root()) / "ui"


def _reason_file(root: Path | None = None) -> Path:
    return (root or llama_root()) / "ui.missing"


def missing_reason(root: Path | None = None) -> str | None:
    """Why the UI is not built (None when it is)."""
    if (ui_dir(root) / "index.html").exists():
        return None
    try:
        return _reason_file(root).read_text().strip() or "it was never built"
    except OSError:
        return "it was never built: run `arcsplit llama build`"


def serve_dir(bin_dir: Path) -> str | None:
    """What llama-server serves at ``/`` (``--path``) when arcsplit built it (without an embedded UI): the UI
    built beside that build, else the page saying how to get it. None for a build of the user's: it keeps its own."""
    if build_patches(bin_dir) is None:
        return None
    root = root_of(bin_dir)
    return str(ui_dir(root) if missing_reason(root) is None else FALLBACK_DIR)


def root_of(bin_dir: Path) -> Path:
    """The llama_root a build of arcsplit's lives in: ``<root>/build-<key>/bin``."""
    return bin_dir.parent.parent


def _node_problem() -> str | None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        return "Node.js and npm are not installed (Debian/Ubuntu: `apt-get install nodejs npm`)"
    out = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    m = re.match(r"v(\d+)\.(\d+)", out)
    if not m:
        return f"`node --version` printed {out!r}, not a version"
    version = (int(m.group(1)), int(m.group(2)))
    # vite 7, which the pinned tree's UI builds with, wants Node.js ^20.19 or >= 22.12 (its package.json engines).
    if not ((20, 19) <= version < (21, 0) or version >= (22, 12)):
        return f"Node.js {out} is too old for the UI's build tools (vite 7 needs 20.19+ or 22.12+)"
    return None


def build_ui(progress: Callable[[str, int | None], None], force: bool = False,
             source: Path | None = None) -> str | None:
    """Build the UI once (from ``source``'s tools/ui, else the pinned tree's); return None when it is there,
    else why not, which is also kept for ``serve`` to say. Under the cache's lock, checked again once held: a
    second build that waited finds the first one's UI (two at once crashed on each other's ``ui-work``)."""
    if not force and missing_reason() is None:
        return None
    with cache_lock(lambda: progress("waiting for another arcsplit process writing the cache", None)):
        if not force and missing_reason() is None:
            return None
        root = llama_root()
        root.mkdir(parents=True, exist_ok=True)
        log = root / "ui.log"
        log.write_text("arcsplit: llama.cpp web UI build\n")
        reason = _node_problem() or _npm_build(root, source, log, progress)
        if reason:
            _reason_file().write_text(reason + "\n")
        else:
            _reason_file().unlink(missing_ok=True)
        return reason


def _npm_build(root: Path, source: Path | None, log: Path, progress: Callable[[str, int | None], None]) -> str | None:
    src = source or root / "src"
    if not (src / "tools" / "ui" / "package.json").exists():
        if source is not None:
            return f"{source} has no tools/ui/package.json (a llama.cpp tree from before the Svelte UI)"
        src = extract_source(fetch_sdist(log), root / "src-stock")  # patches never touch tools/ui
    work, out = root / "ui-work", root / "ui.partial"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src / "tools" / "ui", work)
    # No browser downloads (the UI's own e2e tests want one; the build does not).
    env = {**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1", "LLAMA_UI_OUT_DIR": str(out),
           "npm_config_audit": "false", "npm_config_fund": "false", "npm_config_update_notifier": "false"}
    try:
        for step, cmd in (("web UI: npm ci", ["npm", "ci"]), ("web UI: npm run build", ["npm", "run", "build"])):
            progress(step, None)
            with log.open("ab") as fh:
                rc = subprocess.run(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                return f"`{shlex.join(cmd)}` failed (exit {rc}); its log is {log}"
        if not (out / "index.html").exists():
            return f"the UI build finished without index.html; its log is {log}"
        shutil.rmtree(ui_dir(), ignore_errors=True)
        out.rename(ui_dir())
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)  # node_modules is ~700 MB; the built UI is a few MB
        shutil.rmtree(out, ignore_errors=True)
