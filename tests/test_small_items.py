"""Small things a new user reads: the llama.cpp build named by one version that says what it is, the Python API's
errors in Python's spelling, the load line naming what loads, which demo model is which."""

from __future__ import annotations

from pathlib import Path

import pytest

import arcsplit
from arcsplit.errors import BadInput
from arcsplit.llama.devices import parse_gpus
from arcsplit.llama.locate import parse_version
from arcsplit.llama.source import COMMIT_FILE, SDIST_VERSION, build_line


def _line(text: str) -> str:
    info = parse_version(text)
    return build_line(info.build_number, info.commit, info.version)


def test_a_build_is_named_by_one_version_that_says_what_it_is(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    src = tmp_path / "llama.cpp" / SDIST_VERSION / "src"
    src.mkdir(parents=True)
    (src / COMMIT_FILE).write_text("0c1e57098\n")
    dev = "version: 0.5.0-dev (build 0, commit 0c1e57098)\nbuilt with GNU 12.2.0 for Linux x86_64"
    line = _line(dev)
    assert "None" not in line and line.startswith("commit 0c1e57098 ")
    assert f"llama-cpp-python {SDIST_VERSION}" in line and "0.5.0-dev" in line  # both numbers, each said as what
    other = _line(dev.replace("0c1e57098", "1234abcde"))
    assert other.startswith("commit 1234abcde ") and "llama-cpp-python" not in other
    assert _line("version: 9093 (1e5ad35d5)\nbuilt with GNU 13 for Linux x86_64") == "build 9093 (1e5ad35d5)"


def test_python_api_errors_name_its_arguments(demo_model: Path) -> None:
    """From Python, a bad value is named as the argument it came in (gpus=[0, 0]); the CLI keeps its flags."""
    for kwargs, said in [({"gpus": [0, 0]}, "gpus=[0, 0] names a card twice"),
                         ({"gpus": "a,b"}, "gpus='a,b' is not a list of card numbers; write it like gpus=[0, 1]"),
                         ({"gpus": [0, 1], "ctx": -5}, "ctx=-5 must be positive"),
                         ({"gpus": [0, 1], "parallel": 0}, "parallel=0 must be at least 1"),
                         ({"gpus": [0, 1], "backend": "cpu", "cpu_memory_mib": 0}, "cpu_memory_mib=0 must be positive")]:
        with pytest.raises(BadInput) as err:
            arcsplit.plan(demo_model, **kwargs)
        assert said in str(err.value) and "--" not in str(err.value), str(err.value)
    with pytest.raises(BadInput, match=r"^budget_s=0 must be positive"):
        arcsplit.tune(demo_model, gpus=[0, 1], budget_s=0)
    with pytest.raises(BadInput, match=r"^--gpus '0,0' names a card twice"):  # below the API: the CLI's words
        parse_gpus("0,0")


def test_the_load_line_says_what_loads() -> None:
    from arcsplit.llama.logs import load_stage

    assert load_stage("text_model", "/models/SmolLM2-135M-Instruct.Q4_1.gguf") == \
        "the weights of SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "draft model" in load_stage("spec_model") and "vision projector" in load_stage("mmproj_model")
    assert "text_model" not in load_stage(None) and load_stage("something_new") == "something_new"


def test_which_demo_model_is_which(demo_model: Path, capsys) -> None:
    """`demo` serves the chat model, `model demo` prints the base one: both say so, in their help and output."""
    from arcsplit.cli import build_parser, main
    from arcsplit.demo import CHAT_NAME

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    demo_help = sub["demo"].format_help()
    model_demo = next(a for a in sub["model"]._actions if a.dest == "model_command").choices["demo"]
    assert CHAT_NAME in demo_help and "Gemma 3 270M" in demo_help and "model demo" in demo_help
    assert CHAT_NAME in model_demo.format_help() and "Gemma 3 270M" in model_demo.format_help()
    assert main(["model", "demo"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(demo_model)
    assert "Gemma 3 270M" in err and f"--chat: {CHAT_NAME}, what `arcsplit demo` serves" in err
