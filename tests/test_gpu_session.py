"""bench/gpu/session.sh's machine-independent parts: a CUDA build packed on one lent machine is unpacked on the
next (only when its key is this tree's), and collecting on a fresh machine says so at once instead of waiting out
the call. No GPU and no CUDA build: the "build" is a directory of bytes under the key arcsplit would build, with a
stand-in llama-server that lists a card (the unpack's check that a build packed elsewhere runs here)."""

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


def fake_build(bin_dir: Path, lib: bytes, devices: str = "  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)",
               cpu_flags: str | None = None) -> None:
    """A "build": the library's bytes and a llama-server whose --list-devices prints ``devices``; ``cpu_flags``:
    the build host's /proc/cpuinfo flags, as pack_here.sh records them."""
    bin_dir.mkdir(parents=True)
    (bin_dir / "libggml-cuda.so").write_bytes(lib)
    server = bin_dir / "llama-server"
    server.write_text(f"#!/bin/sh\necho 'Available devices:'\necho '{devices}'\n")
    server.chmod(0o755)
    if cpu_flags is not None:
        (bin_dir / ".build-host-cpu-flags").write_text(cpu_flags + "\n")


def machine(work: Path) -> Path:
    """A lent machine's WORK whose models exist, so no phase writes 18 GB here."""
    work.mkdir(parents=True)
    (work / "model7b.gguf").touch()
    (work / "moe16x32.gguf").touch()
    (work / "src").mkdir()
    return work


def packed(tmp_path: Path, lib: bytes = b"x" * 1024, **build: str) -> list[Path]:
    """A fake build of this tree's key packed by session.sh's pack phase, its parts moved to FILES/cudabin
    (tmp_path/files); ``build``: fake_build's options."""
    first, out, cudabin = machine(tmp_path / "first"), tmp_path / "out0", tmp_path / "files" / "cudabin"
    cudabin.mkdir(parents=True)
    fake_build(cuda_build_dir(first) / "bin", lib, **build)
    proc = session("pack", first, tmp_path / "files", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = sorted(out.glob("build-cuda-*.tar.xz.*"))
    for p in parts:
        p.rename(cudabin / p.name)
    return [cudabin / p.name for p in parts]


@pytest.mark.slow
def test_a_packed_build_is_unpacked_on_a_fresh_machine_whole(tmp_path: Path) -> None:
    lib = os.urandom(20 * 2**20)  # random bytes do not compress: more than one 15 MiB part
    parts = packed(tmp_path, lib)
    assert len(parts) == 2 and all(p.stat().st_size <= 16 * 2**20 for p in parts)

    fresh = machine(tmp_path / "fresh")
    unpacked = session("pack", fresh, tmp_path / "files", tmp_path / "out2")  # build() unpacks, then packs again
    assert "unpacked from cudabin/" in unpacked.stdout, unpacked.stdout + unpacked.stderr
    assert (cuda_build_dir(fresh) / "bin" / "libggml-cuda.so").read_bytes() == lib


@pytest.mark.slow
@pytest.mark.parametrize("build, why", [
    ({"devices": "  (none)"}, "shows no CUDA0 here"),
    ({"cpu_flags": "fpu sse2 avx2 avx_flag_no_cpu_has"}, "needs CPU flags this machine lacks (avx_flag_no_cpu_has)"),
], ids=["no card listed", "a CPU flag missing"])
def test_a_packed_build_that_cannot_run_here_is_compiled_instead(tmp_path: Path, build: dict[str, str],
                                                                 why: str) -> None:
    """A build packed on another machine (bench/gpu/pack_here.sh compiles one without a GPU) is used only where its
    llama-server lists the card and the CPU has the build host's instruction-set flags; else it is removed, and the
    phase compiles as on a machine with no pack."""
    packed(tmp_path, **build)
    work = tmp_path / "w"
    work.mkdir()
    proc = session("unpack", work, tmp_path / "files", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "unpacked from cudabin/" in proc.stdout and why in proc.stdout and "compiling" in proc.stdout, proc.stdout
    assert not cuda_build_dir(work).exists()


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
