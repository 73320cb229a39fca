"""serve's early start of its hosts' sessions (arcsplit/_warm.py, run/early.py): which runs take it, and a session
the run never takes is ended, never left running. The real path (ssh into a network namespace, adopted by the
launcher) is tests/test_multihost.py's; here the transport is a local stand-in that reads its stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from arcsplit import _warm
from arcsplit.run import early as early_mod

LAYOUT = textwrap.dedent("""\
    name = "two"

    [[hosts]]
    name = "b"
    ssh = "me@b"

    [[cards]]
    backend = "cpu"
    index = 0
    memory_mib = 1024

    [[cards]]
    backend = "cpu"
    host = "b"
    index = 0
    memory_mib = 1024
    """)


def _layout(tmp_path: Path, text: str = LAYOUT) -> str:
    path = tmp_path / "layout.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_only_a_serve_with_a_layout_naming_other_hosts_starts_early(tmp_path):
    layout = _layout(tmp_path)
    assert _warm.layout_hosts(["serve", "m.gguf", "--layout", layout]).hosts[0].name == "b"
    assert _warm.layout_hosts(["serve", "m.gguf", f"--layout={layout}"]) is not None
    for argv in (["serve", "m.gguf", "--layout", layout, "--help"], ["serve", "m.gguf", "--layout", layout, "--tui"],
                 ["serve", "m.gguf"], ["plan", "m.gguf", "--layout", layout],
                 ["serve", "m.gguf", "--", "--layout", layout],  # llama-server's own arguments
                 ["serve", "m.gguf", "--layout", str(tmp_path / "missing.toml")]):  # the CLI reports it as usual
        assert _warm.layout_hosts(argv) is None, argv
    local = _layout(tmp_path, "\n".join(line for line in LAYOUT.splitlines()[:2]) + textwrap.dedent("""
        [[cards]]
        backend = "cpu"
        index = 0
        memory_mib = 1024
        """))
    assert _warm.layout_hosts(["serve", "m.gguf", "--layout", local]) is None


# Stops `arcsplit serve` as it is about to spawn the first ssh (an audit hook: no ssh runs), printing the arcsplit
# modules imported by then.
_AT_SPAWN = textwrap.dedent("""\
    import json, os, sys
    def hook(event, args):
        if event == "subprocess.Popen" and "ssh" in [os.path.basename(str(a)) for a in args[1]]:
            os.write(1, json.dumps(sorted(m for m in sys.modules if m.startswith("arcsplit"))).encode())
            os._exit(0)
    sys.addaudithook(hook)
    from arcsplit.cli import main
    sys.exit(main(sys.argv[1:]))
    """)


def test_the_sessions_start_before_the_serving_stack_is_imported(tmp_path):
    """serve's flags and model are checked before a host's ssh is spawned (cli/serve.py, the parser), and the
    serving stack (arcsplit._api, cli/serve_run.py: ~0.25 s of imports) only after, while the login runs. Were the
    parser to import it again, every layout's sessions would start that much later and nothing else would say so."""
    model = tmp_path / "m.gguf"
    model.touch()  # the check asks only that it exists; the hook stops the run before anything reads it
    r = subprocess.run([sys.executable, "-c", _AT_SPAWN, "serve", str(model), "--layout", _layout(tmp_path)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "run")})
    assert r.returncode == 0 and r.stdout, (r.returncode, r.stderr)
    loaded = set(json.loads(r.stdout))
    assert "arcsplit.cli.serve" in loaded  # the flags were parsed and checked before the spawn
    assert not loaded & {"arcsplit._api", "arcsplit.cli.serve_run", "arcsplit.run.remote"}, sorted(loaded)


def test_a_session_the_run_never_takes_is_ended(tmp_path, monkeypatch):
    """A usage error after the sessions started (argparse exits 2 in the CLI's thread): each session's process is
    gone when the run returns, and its control socket with it."""
    monkeypatch.setenv("ARCSPLIT_RUNTIME_DIR", str(tmp_path / "run"))
    stand_in = [sys.executable, "-c", "import sys\nfor line in sys.stdin: pass"]  # lives until its stdin closes
    monkeypatch.setattr(early_mod, "node_argv", lambda host, control=None: stand_in)
    rig = _warm.layout_hosts(["serve", "m.gguf", "--layout", _layout(tmp_path)])
    seen: dict[str, early_mod.Early] = {}

    def dispatch(start: _warm.EarlyStart) -> int:
        seen.update(start.sessions)
        assert psutil.pid_exists(start.sessions["b"].process.pid)
        control = start.sessions["b"].control
        assert control is not None and control.parent == tmp_path / "run"
        control.touch()  # where ssh, as ControlMaster, would have bound it
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        _warm.run_early(rig, dispatch)
    e = seen["b"]
    assert e.process.returncode is not None and not e.taken and not psutil.pid_exists(e.process.pid)
    assert e.control is not None and not e.control.exists()
    assert e.argv == tuple(stand_in)
