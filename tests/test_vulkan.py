"""The Vulkan route: the build's prerequisite check (pure, and real on this machine), then, in the Vulkan tier
(scripts/test-vulkan), the real Vulkan build of llama.cpp on Mesa's CPU driver (lavapipe).

Lavapipe is a conformant Vulkan implementation whose device is the CPU (PHYSICAL_DEVICE_TYPE_CPU, named
``llvmpipe``). Listing its manifest twice makes the Vulkan loader show two devices, so the group runs as it
would on two cards: llama-server holds Vulkan card 0 and one rpc-server holds Vulkan card 1, each process
seeing only its own through GGML_VK_VISIBLE_DEVICES.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
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


# --------------------------------------------------------------------------------------------------------------
# The Vulkan tier: arcsplit's real Vulkan build of llama.cpp on lavapipe (scripts/test-vulkan builds it first).

PROMPT = "The three primary colors are"


def _managed_bin(backend: str) -> Path:
    """A finished managed build, never started from here (conftest's llama_bins would build the CPU one)."""
    from arcsplit.llama.build import BuildConfig, is_built

    config = BuildConfig(backend)
    if not is_built(config):
        pytest.skip(f"the {backend} build of llama.cpp is absent: scripts/test-vulkan builds it")
    return config.bin_dir


@pytest.fixture(scope="module")
def vulkan_bin() -> Path:
    return _managed_bin("vulkan")


@pytest.fixture(scope="module")
def cpu_bin() -> Path:
    return _managed_bin("cpu")


@pytest.fixture(scope="module")
def two_lavapipes(vulkan_bin, cpu_bin, demo_model, tmp_path_factory) -> Iterator[Path]:
    """Mesa's CPU driver as two Vulkan devices (its manifest listed twice), arcsplit's dirs in a temp dir."""
    manifest = next(iter(sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json"))), None)
    if manifest is None:
        pytest.skip("Mesa's CPU Vulkan driver is absent: apt-get install mesa-vulkan-drivers (scripts/test-vulkan)")
    root = tmp_path_factory.mktemp("vulkan")
    icds = [root / "lvp_a.json", root / "lvp_b.json"]
    for icd in icds:
        shutil.copy(manifest, icd)
    (root / "xdg").mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"VK_ICD_FILENAMES": ":".join(map(str, icds)), "XDG_RUNTIME_DIR": str(root / "xdg"),
                           "ARCSPLIT_STATE_DIR": str(root / "state"), "ARCSPLIT_CACHE_DIR": str(root / "cache")}.items():
            mp.setenv(key, value)
        mp.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
        yield root


def _greedy(url: str, n: int = 8) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=1200)
    r.raise_for_status()
    return r.json()["tokens"]


@contextlib.contextmanager
def _serving(argv: list[str]) -> Iterator[Any]:
    from anyio.from_thread import start_blocking_portal

    from arcsplit.cli import build_parser
    from arcsplit.cli.serve_run import build_config
    from arcsplit.proc.ports import free_port
    from arcsplit.run.remote import launcher_for
    from arcsplit.run.supervisor import RestartPolicy, Supervisor

    config, _, _, _ = build_config(build_parser().parse_args(["serve", "--port", str(free_port()), *argv]))
    with start_blocking_portal() as portal:
        sup = Supervisor(config, policy=RestartPolicy(max_failures=0), launcher=launcher_for(config))
        with portal.wrap_async_context_manager(sup) as s:
            yield s


@pytest.mark.slow
def test_devices_lists_the_lavapipe_cards(two_lavapipes, vulkan_bin):
    res = subprocess.run([sys.executable, "-m", "arcsplit", "devices", "--backend", "vulkan", "--json",
                          "--llama-dir", str(vulkan_bin)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cards = json.loads(res.stdout)["cards"]
    assert [c["index"] for c in cards] == [0, 1]
    assert all(c["name"].startswith("llvmpipe") and c["total_mib"] > 0 for c in cards), cards


@pytest.mark.slow
def test_a_weight_above_the_staging_block_reaches_a_vulkan_card_in_pieces(two_lavapipes, vulkan_bin, cpu_bin,
                                                                          tmp_path):
    """Patch 0003 on a card whose buffers are not host memory: a 96 MiB weight sent over the link (a remote
    rpc-server without the GGUF, or --no-rpc-seed) is received in pieces through the rpc-server's staging block, each
    copied to the Vulkan device before the next is read, and reads back as set; with ARCSPLIT_RPC_SET_PIECES=0 it is
    received whole, as stock, and reads back the same."""
    from arcsplit.llama.patches import SET_PIECES_ENV
    from arcsplit.proc.ports import free_port, wait_listening

    from _rpc_client import build_set_reuse

    client = build_set_reuse(cpu_bin, tmp_path)
    size = 96 << 20
    for pieces in ("1", "0"):
        port, log = free_port(), tmp_path / f"rpc-{pieces}.log"
        env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": "0", "GGML_RPC_DEBUG": "1", SET_PIECES_ENV: pieces}
        with log.open("wb") as out:
            proc = subprocess.Popen([str(vulkan_bin / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_listening(proc, "127.0.0.1", port, timeout=120)
            res = subprocess.run([str(client), f"127.0.0.1:{port}", str(size), "weights", str(16 << 20)],
                                 capture_output=True, text=True, timeout=600)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert res.returncode == 0 and res.stdout.split()[0] == "same", (pieces, res.stdout, res.stderr)
        text = log.read_text(errors="replace")
        assert "Vulkan0" in text and "llvmpipe" in text, text[-2000:]
        assert (f"size: {size}, in pieces" in text) == (pieces == "1"), text[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # lavapipe: ~80 s to ready, ~200 s for 8 tokens over RPC on 2 shared cores
def test_hybrid_on_two_vulkan_devices_gives_the_cpu_builds_greedy_tokens(two_lavapipes, vulkan_bin, cpu_bin,
                                                                         demo_model):
    common = [str(demo_model), "--ctx", "1024", "--threads", "1"]
    # Flash attention off on both: Debian 12's lavapipe (Mesa 22.3.6) segfaults in ggml-vulkan's flash-attention
    # path, and Mesa 25's LLVM takes many minutes to compile that shader. Repacking off: rpc-servers keep
    # weights unrepacked (tests/test_serve.py).
    with _serving([*common, "--backend", "cpu", "--gpus", "0", "--llama-dir", str(cpu_bin),
                   "--", "--no-repack", "-fa", "off"]) as cpu:
        reference = _greedy(cpu.url)
    with _serving([*common, "--backend", "vulkan", "--gpus", "0,1", "--mode", "hybrid",
                   "--llama-dir", str(vulkan_bin), "--", "-fa", "off"]) as vk:
        st = vk.status()
        assert st["state"] == "ready" and st["mode"] == "hybrid"
        server_log = "\n".join(vk.logs("server", 2000))
        assert "Vulkan0" in server_log and "llvmpipe" in server_log  # llama-server holds Vulkan card 0
        assert "RPC0" in server_log  # and the rpc-server's card is the second device
        tokens = _greedy(vk.url)
    assert tokens == reference


@pytest.mark.slow
@pytest.mark.parametrize("mode, devices", [("multi", ["Vulkan0", "Vulkan1"]), ("hybrid", ["Vulkan0", "RPC0"])])
def test_plan_measure_takes_compute_from_the_vulkan_cards_themselves(two_lavapipes, vulkan_bin, tmp_path, mode,
                                                                      devices):
    """plan --measure on cards that are present: llama-fit-params' dry run on the Vulkan devices as serve places
    them (one context, or llama-server's card plus a Vulkan rpc-server), cached; the next plan reads the cache."""
    from arcsplit import synth

    model = synth.write_rwkv7(tmp_path / "rwkv7.gguf", n_layer=8, n_embd=512, head_size=64, n_ff=2048,
                              n_vocab=32000, header_only=True)
    argv = [sys.executable, "-m", "arcsplit", "plan", str(model), "--backend", "vulkan", "--llama-dir", str(vulkan_bin),
            "--mode", mode, "--ctx", "4096", "--json"]
    before = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert [c["compute_source"] for c in before["cards"]] == ["formula +25% +6 rows +40 MiB vulkan"] * 2
    first = subprocess.run([*argv, "--measure"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    measured = json.loads(first.stdout)
    assert [c["device"] for c in measured["cards"]] == devices
    assert [c["compute_source"] for c in measured["cards"]] == ["measured vulkan"] * 2
    assert all(m["bytes"]["compute"] < b["bytes"]["compute"] for m, b in zip(measured["cards"], before["cards"]))
    again = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert again["cards"] == measured["cards"]  # from the cache, nothing run


@pytest.mark.slow
def test_the_glslc_check_agrees_with_the_builds_own_test(vulkan_bin):
    """find_vulkan's verdict on glslc's fast paths is the one ggml-vulkan's CMake reached in the real build."""
    build_dir = vulkan_bin.parent
    log = build_dir.with_name(build_dir.name + ".log")
    if not log.exists():
        pytest.skip(f"the Vulkan build's log {log} is gone")
    text = log.read_text(errors="replace")
    found = find_vulkan()
    for ext in ("GL_KHR_cooperative_matrix", "GL_EXT_integer_dot_product"):
        assert (f"-- {ext} not supported by glslc" in text) == (ext in found.glslc_lacks), ext


@pytest.mark.slow
@pytest.mark.timeout(1800)  # lavapipe compiles its pipelines in each new process: ~15 s the first, ~1 s cached
def test_tune_on_two_vulkan_devices_checks_layer_and_tensor_split_and_serve_uses_its_pick(two_lavapipes, vulkan_bin,
                                                                                           tmp_path, monkeypatch):
    """Issue 44 on a real Vulkan rig: every route tune knows runs on the two lavapipe devices (-sm layer and, where
    the build has it, -sm tensor in one context; hybrid; all-RPC), each is checked against the whole model on one
    card, and the pick is what serve then runs."""
    from arcsplit import synth
    from arcsplit.decide.prepare import ServeRequest
    from arcsplit.tuning.picks import tuned
    from arcsplit.tuning.runner import TuneRequest, tune

    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    model = synth.write_llama(tmp_path / "tiny.gguf", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=384,
                              n_vocab=2048)
    req = ServeRequest(model=str(model), gpus=[0, 1], backend="vulkan", ctx=1024, llama_dir=str(vulkan_bin))
    report = tune(TuneRequest(req, budget_s=1200, per_candidate_s=1, settings=False))
    res = {k: report.results[k] for k in report.order}
    assert {r["status"] for r in res.values()} == {"ok"}, {k: (r["status"], r.get("reason")) for k, r in res.items()}
    assert res["vulkan:single-1card:defaults"]["reason"].startswith("reference")
    tensor = res["vulkan:multi-tensor:defaults"]
    argv = tensor["argv"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a in ("-sm", "--split-mode")][-1] == "tensor"  # the last wins
    assert {"vulkan:multi:defaults", "vulkan:hybrid-last:defaults", "vulkan:rpc:defaults"} <= set(res)
    assert report.default == "vulkan:multi:defaults"  # the default order: one context
    assert report.pick is not None and res[report.pick]["status"] == "ok"
    got = tuned(req)
    assert got is not None and got[0].mode == res[report.pick]["candidate"]["mode"] and "tuned route" in got[1]
