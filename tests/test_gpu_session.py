"""bench/gpu/session.sh's machine-independent parts: a CUDA build packed on one lent machine is unpacked on the
next (only when its key is this tree's), and collecting on a fresh machine says so at once instead of waiting out
the call. No GPU and no CUDA build: the "build" is a directory of bytes under the key arcsplit would build."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arcsplit._dirs import cache_dir
from arcsplit.llama.build import BuildConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu" / "session.sh"


def session(phase: str, work: Path, files: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # python3 = this interpreter
    full = {**os.environ, "PATH": path, "WORK": str(work), "FILES": str(files), "OUT": str(out),
            "ARCSPLIT_CACHE_DIR": str(work / "cache"), **env}
    full.pop("ARCSPLIT_LLAMA_DIR", None)
    return subprocess.run(["bash", str(SCRIPT), phase], capture_output=True, text=True, timeout=120, env=full)


def cuda_build_dir(work: Path) -> Path:
    """Where session.sh (WORK=work) finds this tree's CUDA build: the cache dir it sets, then the key's name."""
    key_dir = BuildConfig("cuda", ("-DCMAKE_CUDA_ARCHITECTURES=90",)).build_dir
    return work / "cache" / key_dir.relative_to(cache_dir())


@pytest.mark.slow
def test_a_packed_build_is_unpacked_on_a_fresh_machine_whole(tmp_path: Path) -> None:
    first, fresh, files, out = (tmp_path / n for n in ("first", "fresh", "files", "out"))
    for d in (first, fresh, files / "cudabin", out):
        d.mkdir(parents=True)
    for w in (first, fresh):  # the models exist, so no phase writes 18 GB here
        (w / "model7b.gguf").touch()
        (w / "moe16x32.gguf").touch()
        (w / "src").mkdir()
    lib = os.urandom(20 * 2**20)  # random bytes do not compress: more than one 15 MiB part
    built = cuda_build_dir(first) / "bin"
    built.mkdir(parents=True)
    (built / "libggml-cuda.so").write_bytes(lib)

    packed = session("pack", first, files, out)
    assert packed.returncode == 0, packed.stdout + packed.stderr
    parts = sorted(out.glob("build-cuda-*.tar.xz.*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 16 * 2**20 for p in parts)
    for p in parts:
        p.rename(files / "cudabin" / p.name)

    unpacked = session("pack", fresh, files, tmp_path / "out2")  # build() unpacks, then packs again
    assert "unpacked from cudabin/" in unpacked.stdout, unpacked.stdout + unpacked.stderr
    assert (cuda_build_dir(fresh) / "bin" / "libggml-cuda.so").read_bytes() == lib


def test_a_packed_build_of_another_patch_set_is_not_used(tmp_path: Path) -> None:
    work, files, out = tmp_path / "w", tmp_path / "files", tmp_path / "out"
    (files / "cudabin").mkdir(parents=True)
    work.mkdir()
    (files / "cudabin" / "build-cuda-0000000000.tar.xz.0").write_bytes(b"not this tree's build")
    proc = session("unpack", work, files, out)
    assert proc.returncode == 0, proc.stderr
    assert f"not {cuda_build_dir(work).name}: compiling" in proc.stdout
    assert not cuda_build_dir(work).exists()


def test_collect_on_a_fresh_machine_says_so_at_once(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = session("collect", tmp_path, tmp_path, tmp_path / "out")
    assert proc.returncode == 3
    assert "fresh one" in proc.stdout
    assert time.monotonic() - t0 < 30  # not WAIT_S (540 s)
