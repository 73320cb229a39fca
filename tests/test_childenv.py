"""The environment every llama.cpp child gets: inherited SYCL settings reported harmful are dropped, named, and
the user can keep one. Pure rules, the specs that carry them, and a real child process that sees the result."""

from __future__ import annotations

import os
import sys

import anyio
import pytest

from arcsplit.llama.childenv import KEEP_VAR, SYCL_RULES, clean_env, overlay
from arcsplit.proc.child import Child
from arcsplit.decide.specs import ProcessSpec, build_specs, n_rpc_servers

from test_specs import config

USER = {"PATH": "/usr/bin", "HOME": "/home/u", "GGML_SYCL_DISABLE_OPT": "1",
        "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS": "1", "SYCL_CACHE_PERSISTENT": "1",
        "GGML_SYCL_ENABLE_HOST_PINNED_MEM": "0"}


def test_sycl_children_lose_the_reported_harmful_settings_and_keep_the_rest():
    env, dropped = clean_env("sycl", USER)
    assert "GGML_SYCL_DISABLE_OPT" not in env and "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS" not in env
    assert env["SYCL_CACHE_PERSISTENT"] == "0"
    # the user's own settings and the #28765 workaround pass through untouched
    assert env["PATH"] == "/usr/bin" and env["GGML_SYCL_ENABLE_HOST_PINNED_MEM"] == "0"
    assert {d.var for d in dropped} == {r.var for r in SYCL_RULES}
    line = next(d for d in dropped if d.var == "GGML_SYCL_DISABLE_OPT").line()
    assert line.startswith("GGML_SYCL_DISABLE_OPT=1 removed: ") and "ggml-org/llama.cpp#22413" in line
    assert all(d.sources for d in dropped), "every change cites where the harm was reported"


def test_nothing_changes_when_nothing_harmful_is_inherited_or_on_other_backends():
    assert clean_env("sycl", {"PATH": "/usr/bin", "SYCL_CACHE_PERSISTENT": "0"}) == (
        {"PATH": "/usr/bin", "SYCL_CACHE_PERSISTENT": "0"}, ())
    for backend in ("cpu", "cuda", "vulkan"):
        assert clean_env(backend, USER) == (USER, ())


def test_the_user_can_keep_a_variable():
    env, dropped = clean_env("sycl", {**USER, KEEP_VAR: "GGML_SYCL_DISABLE_OPT, SYCL_CACHE_PERSISTENT"})
    assert env["GGML_SYCL_DISABLE_OPT"] == "1" and env["SYCL_CACHE_PERSISTENT"] == "1"
    assert [d.var for d in dropped] == ["SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS"]


def test_every_process_of_a_group_gets_the_same_change():
    _, dropped = clean_env("sycl", USER)
    sets, unsets = overlay(dropped)
    for mode in ("multi", "hybrid", "rpc"):
        cfg = config("sycl", mode, [0, 1], env_dropped=dropped)
        for spec in build_specs(cfg, list(range(50100, 50100 + n_rpc_servers(cfg)))):
            assert spec.env_dict["SYCL_CACHE_PERSISTENT"] == "0", (mode, spec.name)
            assert set(spec.env_unset) == set(unsets) == {"GGML_SYCL_DISABLE_OPT",
                                                          "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS"}
    assert dict(sets) == {"SYCL_CACHE_PERSISTENT": "0"}


def test_a_real_child_does_not_inherit_a_dropped_variable(monkeypatch):
    """The supervisor's Child starts the process: an inherited variable in env_unset must not reach it."""
    monkeypatch.setenv("GGML_SYCL_DISABLE_OPT", "1")
    monkeypatch.setenv("ARCSPLIT_TEST_KEEP", "yes")
    code = "import os; print(sorted(k for k in os.environ if k in ('GGML_SYCL_DISABLE_OPT', 'ARCSPLIT_TEST_KEEP', 'SYCL_CACHE_PERSISTENT')))"
    spec = ProcessSpec(name="server", role="server", argv=(sys.executable, "-c", code), env=(("SYCL_CACHE_PERSISTENT", "0"),),
                       host="127.0.0.1", port=0, cards=(), env_unset=("GGML_SYCL_DISABLE_OPT",))
    child = Child(spec)

    async def run() -> None:
        with anyio.fail_after(20):
            await child.run()

    anyio.run(run)
    assert child.returncode == 0
    assert "['ARCSPLIT_TEST_KEEP', 'SYCL_CACHE_PERSISTENT']" in list(child.lines)
    assert os.environ["GGML_SYCL_DISABLE_OPT"] == "1"  # the supervisor's own environment is left alone
