"""Device inventory: the --list-devices parser on verbatim outputs, and the real CPU build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arcsplit.errors import BadInput, UnknownCard
from arcsplit.llama.devices import cpu_rig, list_devices, parse_gpus, parse_list_devices

# Verbatim from ggml-org/llama.cpp#22885 (2x Arc Pro B70, old NEO device name).
SYCL_OLD_NEO = """\
Available devices:
  SYCL0: Intel(R) Graphics [0xe223] (32656 MiB, 32611 MiB free)
  SYCL1: Intel(R) Graphics [0xe223] (32656 MiB, 32020 MiB free)
"""
# Verbatim, llama.cpp #27888 (Arc Pro B50, new NEO marketing name).
SYCL_NEW_NEO = "  SYCL0: Intel(R) Arc(TM) Pro B50 Graphics (16304 MiB, 16220 MiB free)\n"
# Verbatim, llama.cpp #10929 (CUDA + SYCL in one build, with backend init chatter before the list).
CUDA_AND_SYCL = """\
ggml_cuda_init: found 1 CUDA devices (Total VRAM: 2002 MiB):
  Device 0: NVIDIA GeForce 940MX, compute capability 5.0, VMM: yes, VRAM: 2002 MiB
Available devices:
  CUDA0: NVIDIA GeForce 940MX (2002 MiB, 1974 MiB free)
  SYCL0: Intel(R) HD Graphics 620 (29588 MiB, 29588 MiB free)
"""
# Verbatim, llama.cpp PR #15793 (Vulkan on Windows).
VULKAN = """\
load_backend: loaded RPC backend from vulkan\\bin\\ggml-rpc.dll
ggml_vulkan: Found 1 Vulkan devices:
ggml_vulkan: 0 = NVIDIA GeForce RTX 4060 Laptop GPU (NVIDIA) | uma: 0 | fp16: 1 | bf16: 1 | warp size: 32 | shared memory: 49152 | int dot: 1 | matrix cores: NV_coopmat2
load_backend: loaded Vulkan backend from vulkan\\bin\\ggml-vulkan.dll
load_backend: loaded CPU backend from vulkan\\bin\\ggml-cpu-alderlake.dll
Available devices:
  Vulkan0: NVIDIA GeForce RTX 4060 Laptop GPU (7957 MiB, 7189 MiB free)
"""
# Verbatim from this build's llama-server --rpc ... --list-devices (RPC device as llama-server lists it).
RPC = """\
Available devices:
  ROCm0: AMD Radeon RX 6600 (8176 MiB, 7654 MiB free)
  RPC0: 127.0.0.1:50152 (24105 MiB, 24105 MiB free)
"""
NONE = "Available devices:\n  (none)\n"


def test_sycl_old_neo_names():
    devs = parse_list_devices(SYCL_OLD_NEO)
    assert [(d.name, d.backend, d.index) for d in devs] == [("SYCL0", "sycl", 0), ("SYCL1", "sycl", 1)]
    assert devs[0].description == "Intel(R) Graphics [0xe223]"
    assert (devs[1].total_mib, devs[1].free_mib) == (32656, 32020)


def test_sycl_new_neo_name_with_parentheses():
    (dev,) = parse_list_devices("Available devices:\n" + SYCL_NEW_NEO)
    assert dev.description == "Intel(R) Arc(TM) Pro B50 Graphics"
    assert (dev.total_mib, dev.free_mib) == (16304, 16220)


def test_cuda_with_sycl_ignores_init_chatter():
    devs = parse_list_devices(CUDA_AND_SYCL)
    assert [(d.backend, d.name, d.free_mib) for d in devs] == [("cuda", "CUDA0", 1974), ("sycl", "SYCL0", 29588)]


def test_vulkan():
    (dev,) = parse_list_devices(VULKAN)
    assert (dev.backend, dev.index, dev.description) == ("vulkan", 0, "NVIDIA GeForce RTX 4060 Laptop GPU")


def test_rpc_endpoint_is_the_description():
    devs = parse_list_devices(RPC)
    assert devs[1].backend == "rpc" and devs[1].description == "127.0.0.1:50152"


def test_none_and_missing_header():
    assert parse_list_devices(NONE) == []
    assert parse_list_devices("  SYCL0: x (1 MiB, 1 MiB free)\n") == []


@pytest.mark.parametrize("spec,expected", [("0,1", [0, 1]), ("1", [1]), (" 2 , 0 ", [2, 0]), (None, None)])
def test_parse_gpus(spec, expected):
    assert parse_gpus(spec) == expected


@pytest.mark.parametrize("spec", ["", "a,b", "0,", "0,0", "-1", "1.5"])
def test_parse_gpus_rejects(spec):
    with pytest.raises(BadInput):
        parse_gpus(spec)


@pytest.mark.parametrize("gpus,missing", [([9], 9), ([0, 2], 2), ([1], 1)])
def test_cpu_card_missing_is_refused(gpus, missing):
    """CPU cards are numbered from 0 in the number asked for: another number is refused as a GPU's would be."""
    with pytest.raises(UnknownCard, match=f"there is no cpu card {missing}") as err:
        cpu_rig(gpus, 1024)
    assert err.value.fix and "--gpus 0,1" in err.value.fix


def test_cpu_cards_from_zero_in_any_order():
    assert [c.index for c in cpu_rig([1, 0], 1024).cards] == [1, 0]
    assert [c.index for c in cpu_rig(None, 1024).cards] == [0]


@pytest.mark.slow  # starts llama.cpp
def test_real_cpu_build_lists_no_gpu(llama_bins):
    """The real CPU build prints the header and `(none)`: parsed as no cards, not as an error."""
    out = list_devices(llama_bins)
    assert "Available devices:" in out
    assert parse_list_devices(out) == []


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_cli_cpu_cards_json():
    out = subprocess.run([sys.executable, "-m", "arcsplit", "devices", "--backend", "cpu", "--gpus", "0,1",
                          "--cpu-memory", "2048", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert [c["index"] for c in data["cards"]] == [0, 1]
    assert all(c["backend"] == "cpu" and c["total_mib"] == 2048 for c in data["cards"])


def test_version_parsers():
    from arcsplit.llama.locate import parse_version

    release = parse_version("version: 9093 (1e5ad35d5)\nbuilt with IntelLLVM 2026.0.0 for Linux x86_64\n")
    assert (release.build_number, release.commit, release.compiler, release.target) == (
        9093, "1e5ad35d5", "IntelLLVM 2026.0.0", "Linux x86_64")
    dev = parse_version("version: 0.5.0-dev (build 0, commit 0c1e57098)\nbuilt with GNU 12.2.0 for Linux x86_64")
    assert (dev.build_number, dev.commit, dev.version) == (None, "0c1e57098", "0.5.0-dev")
