"""arcsplit's SYCL device parsing and ONEAPI_DEVICE_SELECTOR strings against Intel's real SYCL runtime.

The runtime comes from PyPI (intel-sycl-rt + intel-opencl-rt, installed by scripts/_oneapi.sh into a venv of
its own); on a machine without an Intel GPU it shows one real device, the OpenCL CPU runtime's ``opencl:cpu``.
The device lines come from tests/tools/sycl_lister.cpp (no wheel ships sycl-ls), built here with g++ against
the wheel's libsycl. What stays untested: llama.cpp's SYCL backend itself, which cannot be built without
Intel's compiler (icpx) and refuses a platform without a GPU, and Level Zero, which has no device here.
The recorded-output tests at the end run without the runtime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import arcsplit
from arcsplit.llama.facts import neo_from_sycl, parse_dpctl, parse_sycl_ls
from arcsplit.llama.probe import plan_probe
from arcsplit.decide.specs import ServeConfig, build_specs, n_rpc_servers

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
LISTER = Path(__file__).parent / "tools" / "sycl_lister.cpp"
VERSION = "2026.2.0"  # scripts/_oneapi.sh


def _runtime_prefix() -> Path | None:
    env = os.environ.get("ARCSPLIT_TEST_ONEAPI_RT")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "arcsplit" / "oneapi-rt" / VERSION
    prefix = Path(env) if env else cache
    return prefix if (prefix / ".complete").exists() else None


@pytest.fixture(scope="module")
def runtime() -> dict[str, str]:
    """The environment that makes the wheels' SYCL runtime find its OpenCL CPU device."""
    prefix = _runtime_prefix()
    if prefix is None:
        pytest.skip("Intel's SYCL runtime is not installed: run scripts/test-oneapi (about 1.5 GB from PyPI)")
    lib = prefix / "lib"
    # The wheel's .icd file names an unfilled placeholder path, and 2026.2 needs its lib dir for libsvml.
    return {**os.environ, "OCL_ICD_FILENAMES": str(lib / "libintelocl.so"), "LD_LIBRARY_PATH": str(lib),
            "PYTHON": str(prefix / "bin" / "python"), "PREFIX": str(prefix)}


@pytest.fixture(scope="module")
def lister(runtime: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the SYCL device lister")
    prefix = Path(runtime["PREFIX"])
    out = tmp_path_factory.mktemp("sycl") / "sycl-lister"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{prefix / 'include'}", str(LISTER), f"-L{prefix / 'lib'}",
                    "-lsycl", f"-Wl,-rpath,{prefix / 'lib'}", "-o", str(out)], check=True, capture_output=True)
    return out


def sycl_ls(lister: Path, runtime: dict[str, str], selector: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(runtime)
    env.pop("ONEAPI_DEVICE_SELECTOR", None)
    if selector is not None:
        env["ONEAPI_DEVICE_SELECTOR"] = selector
    return subprocess.run([str(lister)], env=env, capture_output=True, text=True, timeout=120)


def emitted_selectors(demo_model: Path) -> set[str]:
    """Every ONEAPI_DEVICE_SELECTOR value arcsplit gives a process: serve's groups in each mode, the probe's."""
    out: set[str] = set()
    for mode in ("multi", "hybrid", "rpc"):
        plan = arcsplit.plan(demo_model, layout=ROOT / "layouts" / "4x-arc-pro-b60.toml", mode=mode, ctx=1024)
        config = ServeConfig(plan=plan, mode=mode, backend="sycl", server_bin="llama-server", rpc_bin="rpc-server")
        for spec in build_specs(config, list(range(50100, 50100 + n_rpc_servers(config)))):
            out.add(spec.env_dict["ONEAPI_DEVICE_SELECTOR"])
    for mode in ("multi", "hybrid", "rpc"):
        probe = plan_probe(mode, "sycl", [0, 1, 2, 3])
        out.update(env["ONEAPI_DEVICE_SELECTOR"] for _, env in probe.servers)
        out.add(probe.bench_env["ONEAPI_DEVICE_SELECTOR"])
    return out


@pytest.mark.slow
def test_the_real_runtime_lists_its_opencl_cpu_device_and_the_parser_reads_it(lister, runtime):
    run = sycl_ls(lister, runtime, None)
    assert run.returncode == 0, run.stderr
    devices = parse_sycl_ls(run.stdout)
    assert [(d.backend, d.type, d.index, d.platform) for d in devices] == [("opencl", "cpu", 0, "Intel(R) OpenCL")]
    assert devices[0].version.startswith("OpenCL 3.") and devices[0].driver.startswith("2026.")
    assert neo_from_sycl(devices, "sycl-ls") == []  # a CPU OpenCL runtime's version is not NEO's


@pytest.mark.slow
def test_every_selector_arcsplit_emits_is_accepted_by_the_real_parser(lister, runtime, demo_model):
    selectors = emitted_selectors(demo_model)
    assert {"level_zero:0", "level_zero:3", "level_zero:0,1,2,3", "level_zero:cpu"} <= selectors
    for selector in sorted(selectors):
        run = sycl_ls(lister, runtime, selector)
        assert run.returncode == 0 and not run.stderr, (selector, run.stderr)
        # Level Zero has no device here: each of them hides the OpenCL CPU device, as they must on an Arc
        # machine (an rpc-server confined to level_zero:N must not also pick up the CPU).
        assert parse_sycl_ls(run.stdout) == [], selector


@pytest.mark.slow
def test_the_index_in_a_selector_is_the_index_sycl_ls_prints(lister, runtime):
    shown = parse_sycl_ls(sycl_ls(lister, runtime, None).stdout)[0]
    kept = sycl_ls(lister, runtime, f"{shown.backend}:{shown.index}")
    assert [d.name for d in parse_sycl_ls(kept.stdout)] == [shown.name]
    assert parse_sycl_ls(sycl_ls(lister, runtime, f"{shown.backend}:{shown.index + 1}").stdout) == []
    assert len(parse_sycl_ls(sycl_ls(lister, runtime, "*:cpu").stdout)) == 1


@pytest.mark.slow
def test_a_malformed_selector_is_an_error_of_the_runtime(lister, runtime):
    """So the acceptance test above can fail: the runtime rejects what it cannot parse."""
    run = sycl_ls(lister, runtime, "level_zero")
    assert run.returncode == 1 and "Incomplete selector" in run.stderr


@pytest.mark.slow
def test_dpctl_output_of_the_real_runtime_gives_no_neo_version(runtime):
    run = subprocess.run([runtime["PYTHON"], "-m", "dpctl", "-f"], env=runtime, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Backend     opencl" in run.stdout and "Filter string       opencl:cpu:0" in run.stdout
    assert parse_dpctl(run.stdout) == []


# Recorded outputs of the same runtime (tests/fixtures/runtime/SOURCES.md): the parsers without the wheels.

def test_recorded_lister_line_of_the_oneapi_cpu_runtime():
    devices = parse_sycl_ls((FIXTURES / "oneapi_rt_sycl_lister.txt").read_text())
    assert [(d.backend, d.type, d.index, d.name, d.version, d.driver) for d in devices] == [
        ("opencl", "cpu", 0, "Intel(R) Xeon(R) Processor", "OpenCL 3.1 (Build 0)", "2026.22.10.0.01_160000")]
    assert neo_from_sycl(devices, "sycl-ls") == []


def test_recorded_dpctl_listing_of_the_oneapi_cpu_runtime_has_no_neo_version():
    assert parse_dpctl((FIXTURES / "oneapi_rt_dpctl_f.txt").read_text()) == []
