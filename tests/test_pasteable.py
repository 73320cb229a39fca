"""Commands arcsplit shows (plan's, unit's comment, the dashboard's, a log's start line) paste into a shell as they
are: every argument quoted as a shell needs it, so a served name with spaces stays one word."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import anyio

from arcsplit.cli.plan import _process_line
from arcsplit.cli.unit import render_unit
from arcsplit.proc.child import Child
from arcsplit.proc.spec import ProcessSpec
from arcsplit.roles import Role
from arcsplit.tui.state import DashState
from arcsplit.tui.widgets import render_plan

ROOT = Path(__file__).resolve().parents[1]
NAME = "Smollm2 135M 8k $HOME 'x'"  # a general.name as the demo's, plus what a shell would expand or end


def test_plan_lines_split_back_into_the_argv_and_environment():
    proc = {"name": "server", "env": {"LLAMA_ARG_X": "a b"},
            "argv": ["/opt/llama/llama-server", "-m", "/models/my model.gguf", "--alias", NAME]}
    line = _process_line(proc)
    words = shlex.split(line.split(": ", 1)[1])
    assert words == ["LLAMA_ARG_X=a b", *proc["argv"]]


def test_the_dashboard_shows_llama_servers_arguments_quoted():
    state = DashState()
    state.status = {"plan": {"llama_server_args": ["--alias", NAME, "-c", "4096"]}}
    line = next(x for x in render_plan(state).splitlines() if x.startswith("llama-server "))
    assert shlex.split(line.replace("\\[", "["))[1:] == ["--alias", NAME, "-c", "4096"]


def test_units_comment_repeats_the_command_as_typed(tmp_path):
    command = ["serve", str(tmp_path / "my model.gguf"), "--alias", NAME]
    text = render_unit(command, str(tmp_path), {})
    shown = next(x for x in text.splitlines() if x.startswith("#   arcsplit unit "))
    assert shlex.split(shown.removeprefix("#   ").split(" > ")[0]) == ["arcsplit", "unit", *command]


def test_a_process_logs_its_start_line_as_a_shell_command(tmp_path):
    log = tmp_path / "p.log"
    argv = ("/bin/sh", "-c", "exit 0", "a b")
    spec = ProcessSpec(name="p", role=Role.RPC, argv=argv, env=(), host="127.0.0.1", port=1, cards=())

    async def main() -> None:
        child = Child(spec, log_path=log)
        with anyio.fail_after(10):
            await child.run()

    anyio.run(main)
    start = next(x for x in log.read_text().splitlines() if x.startswith("=== "))
    assert shlex.split(start.split(" start ", 1)[1]) == list(argv)


def test_no_argv_is_joined_with_bare_spaces_for_display():
    """Every place that shows a command uses shlex.join; `" ".join(argv)` breaks on the first space in a value."""
    bare = re.compile(r"""["']\s["']\.join\([^)]*?(argv|cmd|command|args)\b""")
    found = [f"{p.relative_to(ROOT)}:{n}" for base in ("arcsplit", "bench", "scripts", "examples")
             for p in sorted((ROOT / base).rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if bare.search(line)]
    assert found == []
