"""scripts/_env.sh's two profiles: the demo installs what serving needs, the tests everything, and neither one's
stamp breaks the other's venv.

pip and apt are stand-ins here (scripts that record what they were asked): the real installs take minutes and reach
PyPI and Debian. Their real cost, on a fresh clone, is bench/setup_cost.py's (bench/results/setup_cost.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bash and a fake installer per case: seconds
ROOT = Path(__file__).resolve().parents[1]
RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$CALLS"\n'


def _checkout(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "_env.sh", repo / "scripts" / "_env.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    tools = tmp_path / "tools"  # what the apt step looks for, present, and apt-get itself as a recorder
    tools.mkdir()
    for name, path in (("python", venv_bin / "python"), ("apt-get", tools / "apt-get"), ("ccache", tools / "ccache"),
                       ("chromedriver", tools / "chromedriver"), ("systemctl", tools / "systemctl")):
        path.write_text(RECORDER)
        path.chmod(0o755)
    return repo, tools


def _setup(repo: Path, tools: Path, calls: Path, profile: str | None) -> list[str]:
    calls.write_text("")
    env = {**os.environ, "CALLS": str(calls), "PATH": f"{tools}:{os.environ['PATH']}"}
    env.pop("ARCSPLIT_SETUP", None)
    prefix = f"ARCSPLIT_SETUP={profile} " if profile else ""
    subprocess.run(["bash", "-c", f"{prefix}source scripts/_env.sh"], cwd=repo, env=env, check=True,
                   capture_output=True)
    return [line for line in calls.read_text().splitlines() if "--upgrade pip" not in line]


def _pip(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("python -m pip")]


def test_demo_installs_arcsplit_alone_and_tests_complete_it(tmp_path: Path) -> None:
    repo, tools = _checkout(tmp_path)
    calls = tmp_path / "calls"
    demo = _setup(repo, tools, calls, "serve")
    assert demo == ["python -m pip install --quiet -e ."], demo  # no extras, no bindings build, no apt at all
    assert _setup(repo, tools, calls, "serve") == []  # its stamp holds
    full = _pip(_setup(repo, tools, calls, None))  # scripts/test: the default profile
    assert any('-e .[test,bench]' in c for c in full) and any("llama-cpp-python==0.3.36" in c for c in full)
    assert _setup(repo, tools, calls, "serve") == []  # a full venv also serves the demo
    assert _pip(_setup(repo, tools, calls, None)) == []  # and the demo left the full stamp alone
    assert sorted(p.name.split("-")[1] for p in (repo / ".venv").glob(".arcsplit-*")) == ["all"]


def test_a_changed_pyproject_installs_again(tmp_path: Path) -> None:
    repo, tools = _checkout(tmp_path)
    calls = tmp_path / "calls"
    _setup(repo, tools, calls, "serve")
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    assert _setup(repo, tools, calls, "serve") == ["python -m pip install --quiet -e ."]
    assert len(list((repo / ".venv").glob(".arcsplit-serve-*"))) == 1  # the old stamp went


FAKE_PY = """#!/bin/sh
# a stand-in python: `-m venv DIR` makes DIR/bin/python (this script again); `-m pip install` takes a second
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0; fi
if [ "$1 $2" = "-m pip" ]; then echo "pip $*" >> "$CALLS"; sleep 1; exit 0; fi
exit 1
"""


def test_two_test_runs_install_the_oneapi_runtime_once(tmp_path: Path) -> None:
    """scripts/_oneapi.sh writes the shared cache: it takes arcsplit's cache lock (flock) and looks again once it
    holds it, so a second run started meanwhile finds the first one's runtime."""
    py = tmp_path / "python"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {**os.environ, "CALLS": str(calls), "PY": str(py), "ARCSPLIT_CACHE_DIR": str(tmp_path / "cache")}
    script = f"source {ROOT / 'scripts' / '_oneapi.sh'} && echo \"rt=$ARCSPLIT_TEST_ONEAPI_RT\""
    procs = [subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()  # one install
    assert all(out.strip().endswith("/oneapi-rt/2026.2.0") for out, _ in outs), outs
    assert any("waiting for another arcsplit process" in err for _, err in outs), outs


def test_editable_installs_leave_out_setuptools_banner(tmp_path: Path) -> None:
    """setuptools' "Editable installation" BuildBackendWarning (printed even with --quiet) is filtered from both
    profiles' `pip install -e`: the filter is in pip's environment, and it silences that very warning."""
    repo, tools = _checkout(tmp_path)
    recorder = '#!/bin/sh\necho "$(basename "$0") $* [PYTHONWARNINGS=$PYTHONWARNINGS]" >> "$CALLS"\n'
    (repo / ".venv" / "bin" / "python").write_text(recorder)
    calls = tmp_path / "calls"
    installs = [c for profile in ("serve", None) for c in _setup(repo, tools, calls, profile) if " -e " in c]
    assert len(installs) == 2, installs
    values = {c.rsplit("[PYTHONWARNINGS=", 1)[1].rstrip("]") for c in installs}
    (value,) = values
    assert value, installs
    # setuptools' own words (setuptools/command/editable_wheel.py), as a UserWarning subclass would print them
    warn = ("import warnings\nclass BuildBackendWarning(UserWarning): pass\n"
            "warnings.warn('Editable installation.\\n!!\\n\\n  Please be careful with folders in your working "
            "directory with the same name as your package', BuildBackendWarning)\n")
    shown = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": ""})
    quiet = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": value})
    assert "Editable installation" in shown.stderr and quiet.stderr == "", quiet.stderr
