"""The Vulkan route: the build's prerequisite check (pure, and real on this machine), then, in the Vulkan tier
(scripts/test-vulkan), the real Vulkan build of llama.cpp on Mesa's CPU driver (lavapipe).

Lavapipe is a conformant Vulkan implementation whose device is the CPU (PHYSICAL_DEVICE_TYPE_CPU, named
``llvmpipe``). Listing its manifest twice makes the Vulkan loader show two devices, so the group runs as it
would on two cards: llama-server holds Vulkan card 0 and one rpc-server holds Vulkan card 1, each process
seeing only its own through GGML_VK_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arcsplit.errors import BuildError
from arcsplit.llama.build import VulkanFound, find_vulkan, vulkan_notes, vulkan_problem

FIXTURES = Path(__file__).parent / "fixtures" / "vulkan"
COMPLETE = VulkanFound(glslc="/usr/bin/glslc", spirv_headers="/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
                       headers="/opt/vk/include", header_version="1.4.309", has_layer_settings=True,
                       loader="/usr/lib/x86_64-linux-gnu/libvulkan.so")


@pytest.mark.parametrize("missing, words", [
    ({"glslc": None}, ["`glslc`", "apt-get install glslc"]),
    ({"spirv_headers": None}, ["SPIRV-Headers", "apt-get install spirv-headers"]),
    ({"headers": None, "header_version": None, "has_layer_settings": False}, ["vulkan/vulkan_core.h", "libvulkan-dev"]),
    ({"header_version": "1.3.239", "has_layer_settings": False}, ["(1.3.239) are too old", "VK_EXT_layer_settings",
                                                                  "VULKAN_SDK"]),
    ({"loader": None}, ["libvulkan.so"]),
])
def test_each_missing_or_too_old_prerequisite_is_named_in_one_line(missing, words):
    found = VulkanFound(**{**COMPLETE.__dict__, **missing})
    problem = vulkan_problem(found)
    assert problem is not None
    line = str(BuildError(*problem))
    assert "\n" not in line
    for w in words:
        assert w in line, line


def test_a_complete_view_lets_the_build_start():
    assert vulkan_problem(COMPLETE) is None


def test_the_first_missing_prerequisite_is_the_one_named():
    both = VulkanFound(**{**COMPLETE.__dict__, "glslc": None, "header_version": "1.3.239", "has_layer_settings": False})
    assert "glslc" in vulkan_problem(both)[0]


def test_a_glslc_without_the_fast_paths_is_a_note_not_an_error():
    found = VulkanFound(**{**COMPLETE.__dict__, "glslc_lacks": ("GL_KHR_cooperative_matrix",)})
    assert vulkan_problem(found) is None
    (note,) = vulkan_notes(found)
    assert "GL_KHR_cooperative_matrix" in note and "matrix engines" in note and "\n" not in note
    assert vulkan_notes(COMPLETE) == ()


def _sdk(tmp_path: Path, header: str) -> Path:
    """A Vulkan SDK prefix whose vulkan_core.h carries the version lines of a real one (fixtures)."""
    sdk = tmp_path / header
    (sdk / "include" / "vulkan").mkdir(parents=True)
    shutil.copy(FIXTURES / f"vulkan_core_{header}.h", sdk / "include" / "vulkan" / "vulkan_core.h")
    return sdk


def test_headers_are_read_where_findvulkan_looks_sdk_first(tmp_path):
    old, new = _sdk(tmp_path, "1.3.239"), _sdk(tmp_path, "1.4.309")
    found = find_vulkan(env={"VULKAN_SDK": str(old), "PATH": ""})
    assert (found.headers, found.header_version, found.has_layer_settings) == (str(old / "include"), "1.3.239", False)
    found = find_vulkan(env={"VULKAN_SDK": str(new), "PATH": ""})
    assert (found.headers, found.header_version, found.has_layer_settings) == (str(new / "include"), "1.4.309", True)
    # an explicit -DVulkan_INCLUDE_DIR= (CMake's own cache variable) wins over VULKAN_SDK
    found = find_vulkan((f"-DVulkan_INCLUDE_DIR={old / 'include'}",), env={"VULKAN_SDK": str(new), "PATH": ""})
    assert found.header_version == "1.3.239"


def test_glslc_in_the_sdk_is_found_without_path(tmp_path):
    sdk = _sdk(tmp_path, "1.4.309")
    (sdk / "bin").mkdir()
    (sdk / "bin" / "glslc").write_text("")
    assert find_vulkan(env={"VULKAN_SDK": str(sdk), "PATH": ""}).glslc == str(sdk / "bin" / "glslc")
    assert find_vulkan(env={"PATH": str(tmp_path)}).glslc is None


def _build_vulkan(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "VULKAN_SDK"}
    full.update({"ARCSPLIT_CACHE_DIR": str(tmp_path / "cache"), **env})
    return subprocess.run([sys.executable, "-m", "arcsplit", "llama", "build", "--backend", "vulkan"],
                          capture_output=True, text=True, env=full, timeout=120)


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_real_cli_names_a_missing_glslc_before_fetching_anything(tmp_path):
    tools = {name: shutil.which(name) for name in ("cmake", "c++")}
    if None in tools.values():
        pytest.skip("cmake and c++ are needed to reach the Vulkan check")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, path in tools.items():
        (bin_dir / name).symlink_to(path)
    line = _one_line(_build_vulkan(tmp_path, {"PATH": str(bin_dir)}))
    assert line.startswith("arcsplit: ") and "`glslc`" in line
    assert not (tmp_path / "cache" / "sdist").exists()  # nothing downloaded, nothing compiled


def test_real_cli_says_what_this_machine_lacks(tmp_path):
    """On this machine as it is (no VULKAN_SDK): the line is the check's verdict on what is really installed."""
    env = {k: v for k, v in os.environ.items() if k != "VULKAN_SDK"}
    if None in (shutil.which("cmake"), shutil.which("c++")):
        pytest.skip("cmake and c++ are needed to reach the Vulkan check")
    problem = vulkan_problem(find_vulkan(env=env))
    if problem is None:
        pytest.skip("this machine has every Vulkan build prerequisite: the CLI would start a build")
    line = _one_line(_build_vulkan(tmp_path, {}))
    assert line == f"arcsplit: {BuildError(*problem)}"
    assert not (tmp_path / "cache" / "sdist").exists()
