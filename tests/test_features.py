"""Binaries arcsplit did not build: their --help is read once, and arcsplit never passes a flag they lack.

Checked on the real llama-server of the CPU build (its --help) and on the recorded usage table of an early-2025
llama-server (tests/fixtures/runtime/help_server_53dd4beb.md: `-fa` a bare switch; no --fit, --kv-unified, -ot,
--rpc). No IPEX-LLM binary was available; its flags are unknown here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arcsplit.errors import BadInput
from arcsplit.llama.features import OPTIONAL, RPC_OPTIONAL, RPC_REQUIRED, binary_features, fit_args, parse_help

from test_specs import config, specs_for

OLD = parse_help((Path(__file__).parent / "fixtures" / "runtime" / "help_server_53dd4beb.md").read_text())


def test_old_build_usage_table():
    assert {"-fa", "--flash-attn", "--metrics", "-dev", "--device", "-ts", "-lv", "--no-mmap"} <= OLD.flags
    assert "-fa" not in OLD.with_value and "-ts" in OLD.with_value and "--device" in OLD.with_value
    assert not {"--fit", "--kv-unified", "--no-kv-unified", "-ot", "--rpc", "--swa-full"} & OLD.flags


def test_old_build_gets_only_flags_it_knows():
    cfg = config("cuda", "multi", [0, 1], server_features=OLD)
    server = specs_for(cfg)[-1]
    argv = list(server.argv)
    assert "--fit" not in argv and "--kv-unified" not in argv
    i = argv.index("-fa")  # the old bare switch: "-fa on" became "-fa"
    assert i == len(argv) - 1 or argv[i + 1].startswith("-")
    assert {a for a in argv[1:] if a.startswith("-")} <= OLD.flags
    assert server.features_off == ()  # nothing the user would miss: no fit and one shared KV cache were old defaults


def test_flash_attention_off_and_lost_features_are_reported():
    fa_off = ["-m", "m", "-fa", "off", "--metrics", "-ot", "output.weight=SYCL0", "--no-kv-unified"]
    argv, off = fit_args(fa_off, OLD)
    assert argv == ("-m", "m", "--metrics")  # old default was off: nothing to pass
    assert any("--output-layer local" in o for o in off) and any("[--no-kv-unified]" in o for o in off)
    no_metrics = parse_help("-m,    --model FNAME      model path\n")
    assert any("[--metrics]" in o for o in fit_args(["-m", "m", "--metrics"], no_metrics)[1])


def test_a_flag_the_route_needs_is_one_clear_error():
    cfg = config("cuda", "hybrid", [0, 1], server_features=OLD)
    with pytest.raises(BadInput, match="does not accept --rpc"):
        specs_for(cfg)


def test_user_args_after_dashdash_are_left_alone():
    cfg = config("cuda", "multi", [0, 1], server_features=OLD, extra_args=("--fit", "on"))
    assert specs_for(cfg)[-1].argv[-2:] == ("--fit", "on")


def test_managed_builds_are_not_filtered():
    assert fit_args(["--fit", "off", "-fa", "on"], None) == (("--fit", "off", "-fa", "on"), ())


@pytest.mark.slow  # needs the llama.cpp build
def test_real_help_of_this_build(llama_bins, tmp_path, monkeypatch):
    """The CPU build's own --help: every flag arcsplit passes is there, -fa takes on|off|auto."""
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    f = binary_features(llama_bins.server)
    assert {"--fit", "--kv-unified", "--no-kv-unified", "-ot", "--rpc", "--metrics", "--device"} <= f.flags
    assert "-fa" in f.with_value and "--fit" in f.with_value and "--metrics" not in f.with_value
    assert set(OPTIONAL) <= f.flags
    for mode in ("multi", "hybrid", "rpc"):
        cfg = config("cpu" if mode != "multi" else "cuda", mode, [0, 1], server_features=f)
        plain = config("cpu" if mode != "multi" else "cuda", mode, [0, 1])
        assert specs_for(cfg)[-1].argv == specs_for(plain)[-1].argv, mode


def server_copy(llama_bins, bin_dir: Path) -> Path:
    """A copy of the build's llama-server (a file of its own to chmod and touch) that still finds its libraries."""
    bin_dir.mkdir()
    copy = bin_dir / "llama-server"
    shutil.copy2(llama_bins.server, copy)
    for lib in llama_bins.bin_dir.glob("*.so*"):
        os.symlink(lib, bin_dir / lib.name)
    return copy


@pytest.mark.slow  # needs the llama.cpp build
def test_help_is_read_once_per_binary_version(llama_bins, tmp_path, monkeypatch):
    """Cached by path, size and mtime: a second ask does not run the binary; a changed binary is asked again."""
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    copy = server_copy(llama_bins, tmp_path / "bin")
    first = binary_features(copy)
    assert len(list((tmp_path / "cache" / "features").glob("*.json"))) == 1
    copy.chmod(0o644)  # not executable any more: only the cache can answer now
    assert binary_features(copy) == first
    copy.chmod(0o755)
    os.utime(copy, ns=(0, 1))  # another mtime: another binary
    assert binary_features(copy) == first
    assert len(list((tmp_path / "cache" / "features").glob("*.json"))) == 2


@pytest.mark.slow  # needs the llama.cpp build
def test_version_is_read_once_per_binary_version(llama_bins, tmp_path, monkeypatch):
    """`llama-server --version` (asked on every serve and every node agent's hello) runs once per binary file;
    a changed binary is asked again; a binary that cannot run is never cached as good."""
    from arcsplit.errors import LlamaError
    from arcsplit.llama.locate import server_build_info

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    copy = server_copy(llama_bins, tmp_path / "bin")
    bins = llama_bins.__class__(**{**llama_bins.__dict__, "server": copy})
    first = server_build_info(bins)
    assert first.commit and first.commit == server_build_info(llama_bins).commit
    copy.chmod(0o644)  # cannot run any more: only the cache can answer now
    assert server_build_info(bins) == first
    os.utime(copy, ns=(0, 1))  # another mtime: another binary, asked again, and it cannot run
    with pytest.raises(LlamaError, match="--version` failed"):
        server_build_info(bins)
    copy.chmod(0o755)
    assert server_build_info(bins) == first
    assert len(list((tmp_path / "cache" / "version").glob("*.json"))) == 3  # the original, the copy at two mtimes


@pytest.mark.slow  # needs the llama.cpp build
def test_serve_with_a_foreign_build_probes_it(llama_bins, demo_model, tmp_path, monkeypatch):
    """--llama-dir (not the managed build): prepare asks its --help; this build lacks nothing."""
    from arcsplit.decide.prepare import ServeRequest, prepare

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    p = prepare(ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", port=18932,
                             llama_dir=str(llama_bins.bin_dir)))
    assert p.config.server_features is not None and "--fit" in p.config.server_features.flags
    assert p.config.rpc_features is not None and {"-t", "-c", "-H", "-p"} <= p.config.rpc_features.flags
    assert not any("lacks flags" in n for n in p.notes)


@pytest.mark.slow  # needs the llama.cpp build
def test_rpc_server_of_this_build_and_an_older_one(llama_bins, tmp_path, monkeypatch):
    """ggml-rpc-server's own --help (options indented by two); an rpc-server without -t/-c loses them with a note,
    one without -H/-p cannot serve."""
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    f = binary_features(llama_bins.rpc_server)
    assert set(RPC_OPTIONAL) | set(RPC_REQUIRED) <= f.flags and "-t" in f.with_value and "-c" not in f.with_value
    cfg = config("cuda", "rpc", [0, 1], rpc_features=f, rpc_cache_dir="/c")
    assert specs_for(cfg)[0].argv == specs_for(config("cuda", "rpc", [0, 1], rpc_cache_dir="/c"))[0].argv
    old = parse_help("  -H HOST   host to bind to\n  -p PORT   port to bind to\n")
    rpc0 = specs_for(config("cuda", "rpc", [0, 1], rpc_features=old, rpc_cache_dir="/c"))[0]
    assert rpc0.argv[1:] == ("-H", "127.0.0.1", "-p", "50100")
    assert any("--rpc-cache" in o for o in rpc0.features_off)
    with pytest.raises(BadInput, match="does not accept -p"):
        specs_for(config("cuda", "rpc", [0, 1], rpc_features=parse_help("  -H HOST   host\n")))


def test_user_args_this_build_refuses_are_bad_input():
    """`serve MODEL -- ARGS`: what llama.cpp's parser would refuse is refused first, in one line naming the arg."""
    from arcsplit.errors import BadInput
    from arcsplit.llama.features import check_user_args

    for argv, words in ((["--no-such-flag"], ["'--no-such-flag'", "not an option"]),
                        (["-c", "4096", "--api-key"], ["--api-key", "needs a value"]),
                        (["--ctx-size", "512", "stray"], ["'stray'", "without its flag"])):
        with pytest.raises(BadInput) as e:
            check_user_args(argv, OLD)
        assert all(w in str(e.value) for w in words), str(e.value)
        assert "--help" in (e.value.fix or "")
    check_user_args(["-c", "4096", "--api-key", "k", "--no_mmap"], OLD)  # `--a_b` reads as `--a-b`


@pytest.mark.slow  # needs the llama.cpp build
def test_user_args_against_the_real_help(llama_bins, tmp_path, monkeypatch):
    from arcsplit.errors import BadInput
    from arcsplit.llama.features import check_user_args

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    f = binary_features(llama_bins.server)
    check_user_args(["--temp", "0", "--chat-template", "chatml", "--control-vector-layer-range", "1", "9", "-fa", "off",
                     "--alias", "m"], f)
    with pytest.raises(BadInput):
        check_user_args(["--control-vector-layer-range", "1"], f)  # START END: two values
    with pytest.raises(BadInput):
        check_user_args(["--no-such-flag"], f)
