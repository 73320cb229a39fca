"""Every managed llama.cpp build is found and can be picked, not only the default key: a build made with
--sycl-arch, --cmake-flag or --no-patches lives under another key, and `serve` / `llama which` must see it.

Fast tests lay out build directories (the selection is about directories; `_in_dir` only looks for the files);
the slow one points `llama which --build` at the real CPU binaries under another key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.errors import LlamaError
from arcsplit.llama import patches
from arcsplit.llama.build import CONFIG_FILE, TARGETS, BuildConfig, managed_builds, sycl_flags
from arcsplit.llama.locate import find_llama, pick_build
from arcsplit.llama.source import llama_root
from arcsplit.proc.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def machine(tmp_path, monkeypatch):
    """A cache of our own, and no llama.cpp on PATH or in the environment (whatever the host has)."""
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin") + os.pathsep + str(Path(sys.executable).parent))


def lay_out(config: BuildConfig, age_s: float = 0.0, record: bool = True, files: Path | None = None) -> Path:
    """A finished build dir for ``config`` (files empty, or links to ``files``), finished ``age_s`` ago."""
    bin_dir = config.bin_dir
    bin_dir.mkdir(parents=True)
    for t in TARGETS:
        if files is not None:
            (bin_dir / t).symlink_to(files / t)
        else:
            (bin_dir / t).write_bytes(b"")
    if files is not None:  # the shared libraries beside the binaries
        for lib in files.glob("*.so*"):
            (bin_dir / lib.name).symlink_to(lib)
    if record:
        (bin_dir / CONFIG_FILE).write_text(json.dumps({"backend": config.backend, "extra_flags": list(config.extra_flags),
                                                        "patched": config.patched}))
    when = time.time() - age_s
    os.utime(bin_dir, (when, when))
    return bin_dir


def test_every_finished_build_is_listed_default_first_then_newest():
    default = BuildConfig("cpu")
    stock = BuildConfig("cpu", patched=False)
    flagged = BuildConfig("cpu", ("-DGGML_AVX512=OFF",))
    lay_out(default, age_s=300, record=False)  # made before arcsplit recorded configs: known by its key
    lay_out(stock, age_s=100)
    lay_out(flagged, age_s=10)
    lay_out(BuildConfig("sycl", sycl_flags("bmg_g31")))
    partial = llama_root() / f"build-{BuildConfig('vulkan').key}.partial" / "bin"
    partial.mkdir(parents=True)
    for t in TARGETS:
        (partial / t).write_bytes(b"")
    (llama_root() / "build-cuda-0123456789" / "bin").mkdir(parents=True)  # incomplete: no binaries
    builds = managed_builds("cpu")
    assert [b.key for b in builds] == [default.key, flagged.key, stock.key]
    assert builds[0].is_default and builds[0].config == default
    assert builds[1].config == flagged and builds[2].config == stock
    assert {b.backend for b in managed_builds()} == {"cpu", "sycl"}


def test_the_default_build_wins_and_the_others_are_named():
    lay_out(BuildConfig("cpu"), age_s=300)
    newer = BuildConfig("cpu", patched=False)
    lay_out(newer)
    found = find_llama(backend="cpu")
    assert found.bin_dir == BuildConfig("cpu").bin_dir and found.found_by == "managed"
    assert "the default" in found.note and newer.key in found.note and "--build" in found.note


def test_without_the_default_the_newest_wins_and_says_so():
    # the Arc user who built only with --sycl-arch, twice (two archs)
    old = BuildConfig("sycl", sycl_flags("bmg_g21"))
    new = BuildConfig("sycl", sycl_flags("bmg_g31"))
    lay_out(old, age_s=600)
    lay_out(new, age_s=5)
    found = find_llama(backend="sycl")
    assert found.bin_dir == new.bin_dir
    assert "newest of 2" in found.note and old.key in found.note


def test_a_single_default_build_needs_no_note():
    lay_out(BuildConfig("cpu"))
    assert find_llama(backend="cpu").note is None


def test_build_key_picks_any_build_by_key_or_prefix():
    stock = BuildConfig("cpu", patched=False)
    lay_out(BuildConfig("cpu"))
    lay_out(stock)
    assert find_llama(backend="cpu", build=stock.key).bin_dir == stock.bin_dir
    assert find_llama(backend="cpu", build=stock.key[:8]).found_by == f"--build {stock.key[:8]}"
    with pytest.raises(LlamaError, match="no managed llama.cpp build is called 'cpu-zzz'.*llama which --all"):
        find_llama(backend="cpu", build="cpu-zzz")
    with pytest.raises(LlamaError, match="matches 2 builds"):
        pick_build("cpu-")
    with pytest.raises(LlamaError, match="is a cpu build, not sycl"):
        find_llama(backend="sycl", build=stock.key)
    with pytest.raises(LlamaError, match="--build and --llama-dir"):
        find_llama("/somewhere", backend="cpu", build=stock.key)


def test_nothing_built_says_how_to_build():
    with pytest.raises(LlamaError, match="arcsplit llama build --backend vulkan"):
        find_llama(backend="vulkan")


def test_serve_prepares_with_the_picked_build_and_says_which(tmp_path):
    from arcsplit._api import ServeRequest, prepare

    arch = BuildConfig("cpu", ("-DGGML_AVX512=OFF",))
    lay_out(BuildConfig("cpu"), age_s=60)
    lay_out(arch)
    model = synth.write_llama(tmp_path / "m.gguf", n_layer=4, header_only=True)
    picked = prepare(ServeRequest(model=str(model), gpus="0,1", cpu_memory_mib=512, port=free_port(), build=arch.key))
    assert Path(picked.config.server_bin).parent == arch.bin_dir and picked.notes == ()
    default = prepare(ServeRequest(model=str(model), gpus="0,1", cpu_memory_mib=512, port=free_port()))
    assert Path(default.config.server_bin).parent == BuildConfig("cpu").bin_dir
    assert len(default.notes) == 1 and arch.key in default.notes[0]


def arcsplit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arcsplit", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


def test_llama_which_all_lists_the_keys(capsys):
    from arcsplit.cli import main

    stock = BuildConfig("cpu", patched=False)
    lay_out(BuildConfig("cpu"), age_s=60)
    lay_out(stock)
    assert main(["llama", "which", "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["builds"]
    assert [(r["key"], r["default"], r["patched"]) for r in rows] == [(BuildConfig("cpu").key, True, True),
                                                                      (stock.key, False, False)]
    assert main(["llama", "which", "--all"]) == 0
    text = capsys.readouterr().out
    assert stock.key in text and "stock" in text and "(default)" in text


def test_bad_build_key_is_one_line_exit_2(capsys):
    from arcsplit.cli import main

    assert main(["llama", "which", "--build", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama which --all" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_which_runs_the_binaries_of_a_build_under_another_key(llama_bins):
    # the real CPU binaries, seen as a --no-patches build: `llama which --build KEY` reports that build
    stock = BuildConfig("cpu", patched=False)
    bin_dir = lay_out(stock, files=llama_bins.bin_dir)
    (bin_dir / patches.MARKER).write_text("stock\n")
    r = arcsplit_cli("llama", "which", "--build", stock.key, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert Path(data["bin_dir"]) == bin_dir and data["found_by"] == f"--build {stock.key}"
    assert data["patches"] == [] and data["build_number"] is not None or data["commit"]
    r = arcsplit_cli("llama", "which")  # the only cpu build, not the default: picked, and said
    assert r.returncode == 0 and "only one, not the default" in r.stdout, r.stdout + r.stderr


def test_the_library_build_prints_nothing_the_cli_does(capsys):
    # library code does not print: `build()` reports progress to the callback it is given; the CLI prints
    import inspect

    from arcsplit.cli.llama import _progress_printer
    from arcsplit.llama.build import build

    quiet = inspect.signature(build).parameters["progress"].default
    quiet("fetch", None)
    quiet("compile", 50)
    assert capsys.readouterr() == ("", "")
    show = _progress_printer()
    show("fetch", None)
    assert capsys.readouterr().err == "arcsplit: fetch …\n"
    for pct in (0, 3, 9, 10, 15, 37, 99, 100, 100):  # not a terminal (capsys): a line per 10 %, 100 once
        show("compile", pct)
    assert capsys.readouterr().err.splitlines() == [f"arcsplit: compile {p}%" for p in (0, 10, 37, 99, 100)]
