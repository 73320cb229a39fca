"""``arcsplit llama prune``: an upgrade of arcsplit (another patch set, another pinned llama.cpp) leaves the old
builds in the cache, 70 MiB each on CPU and far more for SYCL or CUDA. Prune removes exactly those, and keeps
today's builds, a build a process is running, and one ARCSPLIT_LLAMA_DIR names. The "builds" here are
directories with the records a real build writes; the process is a real one, started from inside one of them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from arcsplit.cli import main
from arcsplit.llama.build import CONFIG_FILE, BuildConfig
from arcsplit.llama.source import llama_root


def fake_build(path: Path, config: BuildConfig | None, size: int = 4096) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "libggml-base.so").write_bytes(b"\0" * size)
    if config is not None:
        (path / "bin" / CONFIG_FILE).write_text(json.dumps(
            {"backend": config.backend, "extra_flags": list(config.extra_flags), "patched": config.patched}))
    (path.parent / f"{path.name}.log").write_text("build log\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
    root = llama_root()
    configs = [BuildConfig("cpu"), BuildConfig("cpu", patched=False), BuildConfig("cpu", ("-DGGML_AVX512=OFF",))]
    today = [fake_build(c.build_dir, c) for c in configs]
    today.append(fake_build(BuildConfig("vulkan").build_dir, None))  # a default build needs no record
    old = [fake_build(root / "build-cpu-0123456789", BuildConfig("cpu"), size=3 * 2**20),  # an older patch set
           fake_build(root / "build-sycl-9876543210", None),  # before builds were recorded
           fake_build(root / "build-cpu-aaaaaaaaaa.partial", None)]
    other_version = root.parent / "0.3.1"
    fake_build(other_version / "build-cpu-bbbbbbbbbb", BuildConfig("cpu"))
    return today, old + [other_version]


def test_prune_removes_what_an_upgrade_left_and_keeps_todays_builds(cache, capsys):
    today, old = cache
    assert main(["llama", "prune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove ") == len(old) and all(str(p) in out for p in old)
    assert "made with another patch set" in out and "an unfinished build" in out and "0.3.1" in out
    assert all(p.exists() for p in old)  # a dry run removes nothing

    assert main(["llama", "prune"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed ") == len(old) and "freed 3 MiB" in out
    assert not any(p.exists() for p in old)
    assert not (llama_root() / "build-cpu-0123456789.log").exists()
    assert not (llama_root() / "build-cpu-aaaaaaaaaa.log").exists()
    assert all((p / "bin" / "libggml-base.so").exists() and Path(f"{p}.log").exists() for p in today)

    assert main(["llama", "prune", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stale"] == []


def test_prune_keeps_an_old_build_that_a_process_runs_or_the_environment_names(cache, capsys, monkeypatch):
    _today, old = cache
    running, named = old[0], old[1]
    exe = running / "bin" / "llama-server"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)  # a real process whose executable is in that build
    proc = subprocess.Popen([str(exe), "60"])
    try:
        monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(named / "bin"))
        assert main(["llama", "prune"]) == 0
        out = capsys.readouterr().out
        assert f"kept {running}" in out and f"in use by pid {proc.pid}" in out
        assert f"kept {named}" in out and "ARCSPLIT_LLAMA_DIR names it" in out
        assert running.exists() and named.exists() and not old[2].exists() and not old[3].exists()
    finally:
        proc.kill()
        proc.wait()


def test_prune_before_this_versions_first_build_still_removes_an_older_version(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
    old = fake_build(llama_root().parent / "0.3.1" / "build-cpu-bbbbbbbbbb", BuildConfig("cpu")).parent
    assert main(["llama", "prune"]) == 0
    assert not old.exists() and "removed " in capsys.readouterr().out


def test_a_build_says_when_older_builds_take_room(cache, capsys):
    from arcsplit.llama.build import TARGETS

    today, old = cache
    for t in TARGETS:  # today's default build is finished: `llama build` finds it and builds nothing
        (today[0] / "bin" / t).touch()
    assert main(["llama", "build", "--backend", "cpu", "--no-ui"]) == 0
    err = capsys.readouterr().err
    assert f"note: {len(old)} build(s) an older arcsplit left take" in err and "arcsplit llama prune" in err
    assert main(["llama", "prune"]) == 0 and main(["llama", "build", "--backend", "cpu", "--no-ui"]) == 0
    assert "older arcsplit" not in capsys.readouterr().err
