"""arcsplit installed the way Python tools are: `python -m build` makes the sdist and, from the unpacked sdist,
the wheel; the wheel goes into a fresh venv outside the checkout (pip) and into pipx's own venv (`pipx install`,
the README's user path), which then plan, find the cached llama.cpp build (the same build key: patches and data
are packaged) and serve the demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from arcsplit.llama.build import BuildConfig
from arcsplit.proc.ports import free_port

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
    # pip without the checkout on PYTHONPATH: the arcsplit.egg-info the sdist build leaves there would read as
    # arcsplit already installed, and pip would skip the wheel
    env = outside_env(home, ("STATE", "RUNTIME", "CACHE"))
    run(sys.executable, "-m", "venv", venv, cwd=home, env=env)
    wheel = next(dist.glob("arcsplit-*.whl"))
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, cwd=home, env=env)
    env["ARCSPLIT_LLAMA_DIR"] = str(llama_bins.bin_dir)
    return venv / "bin" / "arcsplit", env, home


def outside_env(home: Path, private: tuple[str, ...]) -> dict[str, str]:
    """This process's environment without the checkout (PYTHONPATH, the venv, PATH entries inside it), with the
    named ARCSPLIT_*_DIR under ``home``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT)))
    for key in private:
        env[f"ARCSPLIT_{key}_DIR"] = str(home / key.lower())
    return env


@pytest.fixture(scope="module")
def pipx_installed(dist, tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """`pipx install <wheel>` with pipx from PyPI (the test extra), its home and bin dir in tmp; the installed
    arcsplit keeps the user's cache, so it finds the managed llama.cpp build there as a user's would (or the
    binaries $ARCSPLIT_LLAMA_DIR names, when the suite runs with it)."""
    home = tmp_path_factory.mktemp("pipxuser")
    env = outside_env(home, ("STATE", "RUNTIME"))
    env.update(PIPX_HOME=str(home / "pipx"), PIPX_BIN_DIR=str(home / "bin"), PIPX_MAN_DIR=str(home / "man"))
    wheel = next(dist.glob("arcsplit-*.whl"))
    run(sys.executable, "-m", "pipx", "install", "--python", sys.executable, wheel, cwd=home, env=env)
    return home / "bin" / "arcsplit", env, home


def serve_installed(arcsplit: Path, model: Path, home: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The installed command serving the demo model on two CPU cards; returned once it says "serving"."""
    port = free_port()
    proc = subprocess.Popen([str(arcsplit), "serve", str(model), "--backend", "cpu", "--gpus", "0,1",
                             "--ctx", "1024", "--threads", "1", "--port", str(port)],
                            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if "serving" not in first:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        raise AssertionError(f"serve's first line is not 'serving': {first!r}")
    return proc, port


def shipped_layouts() -> list[Path]:
    """The files of the checkout's top-level layouts/, the one place they live."""
    files = sorted(p for p in (ROOT / "layouts").rglob("*") if p.is_file())
    assert files, "no layouts in the checkout"
    return files


def test_sdist_carries_the_package_data(dist):
    sdist = next(dist.glob("arcsplit-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in tar.getnames() if "/" in n}
    data = [p for p in (ROOT / "arcsplit" / "data").rglob("*") if p.is_file()] + shipped_layouts()
    shipped = {p.relative_to(ROOT).as_posix() for p in data}
    assert shipped and shipped <= names


def test_wheel_carries_every_file_in_layouts(dist):
    """pyproject.toml maps the top-level layouts/ into the package: the wheel holds each file, byte for byte."""
    with zipfile.ZipFile(next(dist.glob("arcsplit-*.whl"))) as wheel:
        names = set(wheel.namelist())
        for p in shipped_layouts():
            inside = "arcsplit/data/layouts/" + p.relative_to(ROOT / "layouts").as_posix()
            assert inside in names, (inside, sorted(n for n in names if "layouts" in n))
            assert wheel.read(inside) == p.read_bytes(), inside


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
    proc, port = serve_installed(arcsplit, demo_model, home, env)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/completion",
                       json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_pipx_installed_arcsplit_plans_and_serves_from_the_default_cache(pipx_installed, llama_bins, demo_model):
    arcsplit, env, home = pipx_installed
    assert run(arcsplit, "--version", cwd=home, env=env).strip() == "arcsplit 0.1.0"
    venv_python = Path(os.path.realpath(arcsplit)).parent / "python"
    where = run(venv_python, "-c", "import arcsplit; print(arcsplit.__file__)", cwd=home, env=env)
    assert where.startswith(str(home / "pipx")), where  # pipx's own venv, not the checkout
    # the managed build, found by its key in the user's cache (or $ARCSPLIT_LLAMA_DIR's, as the suite's)
    which = json.loads(run(arcsplit, "llama", "which", "--backend", "cpu", "--json", cwd=home, env=env))
    assert which["bin_dir"] == str(llama_bins.bin_dir), which
    plan = json.loads(run(arcsplit, "plan", demo_model, "--backend", "cpu", "--gpus", "0,1", "--cpu-memory", "1024",
                          "--json", cwd=home, env=env))
    assert len(plan["cards"]) == 2 and all(n > 0 for n in plan["tensor_split"])
    proc, port = serve_installed(arcsplit, demo_model, home, env)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10, trust_env=False).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_installed_wheel_ships_the_layouts_by_name(installed, demo_model):
    """`--layout NAME` after an install, outside the checkout: the layouts are package data, not repo files."""
    arcsplit, env, home = installed
    shipped = sorted(p.stem for p in shipped_layouts() if p.suffix == ".toml")
    listed = run(arcsplit, "layouts", cwd=home, env=env).splitlines()
    assert [line.split()[0] for line in listed] == shipped
    plan = json.loads(run(arcsplit, "plan", demo_model, "--layout", "2x-arc-pro-b70", "--json", cwd=home, env=env))
    assert len(plan["cards"]) == 2 and all(n > 0 for n in plan["tensor_split"])
