"""The CLI's contract with a user: readable help, one-line errors with exit 2, a working `which`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def arcsplit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "arcsplit", *args], capture_output=True, text=True,
                          env=full, timeout=300)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.slow  # a Python process per help page
@pytest.mark.parametrize("cmd", [[], ["llama"], ["llama", "build"], ["llama", "which"], ["devices"], ["model", "demo"]])
def test_help_pages(cmd):
    r = arcsplit(*cmd, "--help")
    assert r.returncode == 0 and "usage: arcsplit" in r.stdout


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_unknown_backend_is_one_line():
    line = one_line_error(arcsplit("llama", "build", "--backend", "metalx"))
    assert "metalx" in line


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_llama_dir_without_binaries(tmp_path):
    line = one_line_error(arcsplit("llama", "which", "--llama-dir", str(tmp_path)))
    assert str(tmp_path) in line and "llama-server" in line


@pytest.mark.slow  # starts llama.cpp
def test_which_reports_the_build(llama_bins):
    r = arcsplit("llama", "which", "--json", env={"ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    # The sdist carries no git history, so there is no build count: the pinned commit identifies the build.
    assert data["commit"] and data["commit"] != "unknown"
    assert data["target"].startswith("Linux")
    assert Path(data["server"]).exists() and Path(data["rpc_server"]).exists()
    assert data["rpc_server_name"] in ("ggml-rpc-server", "rpc-server")
    text = arcsplit("llama", "which", env={"ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)})
    build = next(line for line in text.stdout.splitlines() if line.startswith("build "))
    assert "None" not in build and data["commit"] in build, build  # one version, said as what it is


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_mismatched_rpc_server_on_path(tmp_path, llama_bins):
    """llama-server from one dir and an rpc-server from another: refused before anything starts."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "llama-server").symlink_to(llama_bins.server)
    (b / "ggml-rpc-server").symlink_to(llama_bins.rpc_server)
    # Symlinks resolve to one build dir; copies stand for two different builds.
    (a / "llama-server").unlink()
    shutil.copy(llama_bins.server, a / "llama-server")
    env = {"PATH": f"{a}:{b}:/usr/bin:/bin", "ARCSPLIT_LLAMA_DIR": ""}
    line = one_line_error(arcsplit("llama", "which", env=env))
    assert "not from one build" in line


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_missing_compiler_reported_before_anything(tmp_path):
    """A backend whose toolchain is absent fails at once, naming the program and the fix."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed here (scripts/_env.sh installs it)")
    tools = tmp_path / "bin"  # cmake and nothing else, whatever else the host has installed (icpx or not)
    tools.mkdir()
    (tools / "cmake").symlink_to(cmake)
    env = {"PATH": f"{Path(sys.executable).parent}:{tools}"}
    line = one_line_error(arcsplit("llama", "build", "--backend", "sycl", env=env))
    assert "icpx" in line and "oneAPI" in line


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_bad_gpus_list():
    line = one_line_error(arcsplit("devices", "--gpus", "0,x"))
    assert "--gpus" in line
