"""arcsplit installed the way Python tools are: `python -m build` makes the sdist and, from the unpacked sdist,
the wheel; the wheel goes into a fresh venv outside the checkout, which then plans, finds the cached llama.cpp
build (the same build key: patches and data are packaged) and serves the demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from arcsplit.llama.build import BuildConfig
from arcsplit.run.ports import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out)
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory, llama_bins) -> tuple[Path, dict[str, str], Path]:
    """(the venv's arcsplit, an environment without the checkout, a working dir outside it)."""
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=home)
    wheel = next(dist.glob("arcsplit-*.whl"))
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, cwd=home)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT)))
    env["ARCSPLIT_LLAMA_DIR"] = str(llama_bins.bin_dir)
    for key in ("STATE", "RUNTIME", "CACHE"):
        env[f"ARCSPLIT_{key}_DIR"] = str(home / key.lower())
    return venv / "bin" / "arcsplit", env, home


def test_sdist_carries_the_package_data(dist):
    sdist = next(dist.glob("arcsplit-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in tar.getnames() if "/" in n}
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "arcsplit" / "data").rglob("*") if p.is_file()}
    assert shipped and shipped <= names


def test_installed_arcsplit_runs_outside_the_checkout(installed):
    arcsplit, env, home = installed
    assert run(arcsplit, "--version", cwd=home, env=env).strip() == "arcsplit 0.1.0"
    code = "import arcsplit, sys; print(arcsplit.__file__)"
    where = run(arcsplit.parent / "python", "-c", code, cwd=home, env=env)
    assert not where.startswith(str(ROOT)) and "site-packages" in where


def test_installed_llama_which_finds_the_cached_build_and_its_patches(installed, llama_bins):
    arcsplit, env, home = installed
    which = json.loads(run(arcsplit, "llama", "which", "--json", cwd=home, env=env))
    assert which["bin_dir"] == str(llama_bins.bin_dir) and which["same_build"]
    # the installed package computes the checkout's build key: same flags, same patch files (package data)
    key = run(arcsplit.parent / "python", "-c", "from arcsplit.llama.build import BuildConfig as B; "
              "print(B('cpu').key)", cwd=home, env=env).strip()
    assert key == BuildConfig("cpu").key


def test_installed_plan_is_the_checkouts_plan(installed, demo_model):
    arcsplit, env, home = installed
    # fixed CPU and host budgets and fixed ports: the defaults follow the machine's free memory and ports, which
    # move between the two runs
    argv = ("plan", demo_model, "--backend", "cpu", "--gpus", "0,1", "--cpu-memory", "1024", "--host-memory", "4096",
            "--port", str(free_port()), "--rpc-ports", f"{free_port()},{free_port()}", "--json")
    theirs = json.loads(run(arcsplit, *argv, cwd=home, env=env))
    ours = json.loads(run(sys.executable, "-m", "arcsplit", *argv, cwd=home, env={**env, "PYTHONPATH": str(ROOT)}))
    assert theirs == ours and sum(theirs["tensor_split"]) > 0


def test_installed_serve_answers_and_stops(installed, demo_model):
    arcsplit, env, home = installed
    port = free_port()
    proc = subprocess.Popen([str(arcsplit), "serve", str(demo_model), "--backend", "cpu", "--gpus", "0,1",
                             "--ctx", "1024", "--threads", "1", "--port", str(port)],
                            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        r = httpx.post(f"http://127.0.0.1:{port}/completion",
                       json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
