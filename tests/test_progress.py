"""Progress where a user waits: a llama.cpp build (make's or ninja's step counter), a model load (per card bytes
from llama-server's own numbers) and the runtime probe. The fast tests check the parsers on lines the real
tools printed; the slow ones run a real CMake build, a real `arcsplit serve` load and a real `arcsplit doctor`
probe and check that the lines and events appear with values that only go up."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arcsplit.llama import build as build_mod
from arcsplit.llama.logs import MiB, load_mode_mmaps, load_progress, parse_buffer_line, parse_load_mode
from arcsplit.tui.state import DashState
from arcsplit.tui.widgets import render_header

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import Served  # noqa: E402

# Verbatim from llama-server (this repo's CPU build, the demo model over two rpc-servers, -lv 4).
LOAD_LINES = [
    "0.09.510.228 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)",
    "0.09.574.481 I load_tensors:   CPU_Mapped model buffer size =   170.00 MiB",
    "0.09.574.506 I load_tensors: RPC0[127.0.0.1:47101] model buffer size =    35.82 MiB",
    "0.09.574.518 I load_tensors: RPC0[127.0.0.1:47102] model buffer size =   199.34 MiB",
    "0.14.589.656 I llama_kv_cache: RPC0[127.0.0.1:47101] KV buffer size =     0.50 MiB",
]
BUFFERS = [b for b in map(parse_buffer_line, LOAD_LINES) if b is not None]
SIZES = {"CPU_Mapped": int(170.00 * MiB), "RPC0[127.0.0.1:47101]": int(35.82 * MiB),
         "RPC0[127.0.0.1:47102]": int(199.34 * MiB)}


def test_a_load_fills_the_buffers_in_llama_cpps_order():
    assert parse_load_mode(LOAD_LINES[0]) == "mmap" and load_mode_mmaps("mmap") and not load_mode_mmaps("none")
    assert load_progress(BUFFERS, 0.0) == {k: (0, n) for k, n in SIZES.items()}  # KV buffers are no load
    assert load_progress(BUFFERS, 1.0) == {k: (n, n) for k, n in SIZES.items()}
    half = load_progress(BUFFERS, 0.5)  # mmap: in the printed order, the host's mapped weights first
    total = sum(SIZES.values())
    assert half["CPU_Mapped"] == (SIZES["CPU_Mapped"],) * 2
    assert half["RPC0[127.0.0.1:47101]"][0] == pytest.approx(total / 2 - SIZES["CPU_Mapped"], abs=1)
    assert half["RPC0[127.0.0.1:47102]"][0] == 0
    staged = load_progress(BUFFERS, 0.5, mmap=False)  # without mmap the device buffers go first
    assert staged["RPC0[127.0.0.1:47101]"][0] == SIZES["RPC0[127.0.0.1:47101]"] and staged["CPU_Mapped"][0] == 0
    previous = {k: 0 for k in SIZES}
    for step in range(101):
        now = load_progress(BUFFERS, step / 100)
        assert all(previous[k] <= now[k][0] <= now[k][1] for k in SIZES)
        previous = {k: v[0] for k, v in now.items()}


def test_build_tool_step_counters():
    # make (CMake's default generator) prints a percentage, ninja a step count
    assert build_mod.step_percent("[ 45%] Building CXX object common/CMakeFiles/common.dir/arg.cpp.o") == 45
    assert build_mod.step_percent("[123/246] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o") == 50
    assert build_mod.step_percent("[100%] Built target llama-server") == 100
    assert build_mod.step_percent("-- Configuring done (1.2s)") is None


def test_the_dashboard_header_shows_each_cards_load():
    state = DashState(connected=True)
    state.status = {"state": "starting", "mode": "rpc", "backend": "cpu", "progress": {
        "value": 0.5, "cards": [{"card": 0, "done": 10 * MiB, "total": 40 * MiB},
                                {"card": 1, "done": 0, "total": 20 * MiB}, {"card": None, "done": 5, "total": 5}]}}
    assert "loading 50% (0: 25%, 1: 0%, host: 100%)" in render_header(state)


def test_demo_builds_llama_cpp_first_only_when_there_is_none(tmp_path, monkeypatch):
    """`arcsplit demo` on a machine without a build builds the managed CPU one (with the build's progress); with
    binaries the user named, a wrong one is an error, not a reason to build others. (The build itself is recorded:
    a real one takes minutes; test_builds.py and the CMake test above run real builds.)"""
    from arcsplit.cli import demo, llama as cli_llama
    from arcsplit.errors import LlamaError
    from arcsplit.llama.build import BuildConfig

    calls: list[str] = []
    monkeypatch.setattr(cli_llama, "build_with_progress", lambda config, *a, **k: calls.append(config.key))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))  # no managed build in it
    monkeypatch.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no llama-server on PATH
    demo._ensure_cpu_build()
    assert calls == [BuildConfig("cpu").key]
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(LlamaError, match="ARCSPLIT_LLAMA_DIR"):
        demo._ensure_cpu_build()
    assert calls == [BuildConfig("cpu").key]


def _monotone_cards(progresses: list[dict]) -> None:
    """Every card's loaded bytes never go down, never pass its size, and the last report has them all loaded."""
    assert progresses
    last: dict = {}
    for p in progresses:
        for c in p["cards"]:
            assert last.get(c["card"], 0) <= c["done"] <= c["total"], progresses
            last[c["card"]] = c["done"]
    final = progresses[-1]
    assert final["value"] == 1.0 and final["cards"] and all(c["done"] == c["total"] for c in final["cards"])


@pytest.mark.slow  # starts llama.cpp
def test_serve_reports_the_load_per_card(demo_model, llama_bins, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
    events = Served(Path(demo_model), ctx=1024, parallel=1, extra_serve=("--json-events", "--threads", "1"))
    console = Served(Path(demo_model), ctx=1024, parallel=1, extra_serve=("--threads", "1"))
    for served in (events, console):
        served.start()
        try:
            served.wait_ready(180)
            if served is events:
                lines = [json.loads(line) for line in served.output().splitlines() if line.startswith("{")]
                progress = [e["data"] for e in lines if e["kind"] == "progress"]
                assert all(b["value"] >= a["value"] for a, b in zip(progress, progress[1:])), progress
                # the planned cards (rpc0, rpc1) and the host's mapped embeddings, each with its buffer's size
                assert [c["card"] for c in progress[-1]["cards"]] == [0, 1, None]
                _monotone_cards(progress)
            else:
                said = [m for m in re.finditer(r"arcsplit: loading the weights of \S+: (\d+)% \((.*)\)", served.output())]
                assert said, served.output()[-2000:]
                reports = []
                for m in said:
                    cards = [re.fullmatch(r"(card \d+|host) (\d+)/(\d+) MiB", part.strip()) for part in m[2].split(",")]
                    assert all(cards), m[0]
                    reports.append({"value": int(m[1]) / 100, "cards": [
                        {"card": c[1], "done": int(c[2]), "total": int(c[3])} for c in cards if c]})
                _monotone_cards(reports)
        finally:
            assert served.stop() == 0
            served.cleanup()


@pytest.mark.slow  # a real CMake build of a tiny project with each generator
@pytest.mark.parametrize("generator", ["Unix Makefiles", "Ninja"])
def test_a_real_cmake_build_reports_rising_percentages(generator, tmp_path):
    tool = "make" if generator == "Unix Makefiles" else "ninja"
    if shutil.which("cmake") is None or shutil.which(tool) is None:
        pytest.skip(f"cmake or {tool} is not installed")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}.c").write_text(f"int f{i}(void) {{ return {i}; }}\n")
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(p C)\n"
        + "".join(f"add_library(l{i} STATIC f{i}.c)\n" for i in range(6))
        + "add_executable(app main.c)\ntarget_link_libraries(app " + " ".join(f"l{i}" for i in range(6)) + ")\n")
    seen: list[tuple[str, int | None]] = []
    log = tmp_path / "build.log"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "CMAKE_GENERATOR": generator}
    build_mod._run_step("configure", ["cmake", "-S", str(src), "-B", str(tmp_path / "b")], log, env,
                        lambda step, pct: seen.append((step, pct)))
    build_mod._run_step("compile", ["cmake", "--build", str(tmp_path / "b"), "-j", "1"], log, env,
                        lambda step, pct: seen.append((step, pct)))
    pcts = [p for step, p in seen if step == "compile" and p is not None]
    assert ("compile", None) in seen and len(pcts) >= 7, seen  # one per object file at least
    assert pcts == sorted(pcts) and pcts[-1] == 100 and pcts[0] < 50, pcts


@pytest.mark.slow  # starts rpc-servers and llama-bench
def test_doctor_says_each_probe_before_and_after(llama_bins, tmp_path):
    env = {"ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir), "ARCSPLIT_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "arcsplit", "doctor", "--backend", "cpu", "--gpus", "0,1",
                        "--reprobe", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "probe 1/1" in line]
    assert re.fullmatch(r"arcsplit: probe 1/1: rpc on 2 cpu cards \(up to \d+ s\) …", lines[0]), lines
    assert re.fullmatch(r"arcsplit: probe 1/1: rpc works after [\d.]+ s", lines[1]), lines
    assert json.loads(r.stdout)  # stdout stays the report
