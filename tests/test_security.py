"""Security promises a user relies on when the cards are shared with other programs and people:

- rpc-servers (which run any code a client sends) listen on 127.0.0.1 unless the user opts in, and then a warning
  is printed;
- control sockets, state files and logs are private to the user;
- no ``shell=True`` (or os.system / os.popen) anywhere in the project;
- an API key given for llama-server (``-- --api-key KEY``) never shows in ``ps``, state.json, logs or events.
"""

from __future__ import annotations

import ast
import json
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import Served  # noqa: E402

SECRET = "sk-arcsplit-test-7f3c9e1d5b"


# -- no shell ------------------------------------------------------------------------------------------------------


def _python_files() -> list[Path]:
    out = []
    for top in ("arcsplit", "bench", "scripts", "tests", "examples"):
        out += [p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts]
    return out


def test_no_shell_anywhere():
    """Every process is started from an argv list: a model path or extra arg can never become shell syntax."""
    files = _python_files()
    assert len(files) > 30
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} shell={ast.unparse(kw.value)}")
            f = node.func
            name = ast.unparse(f)
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
                        "asyncio.create_subprocess_shell", "anyio.run_process") and not (
                    name == "anyio.run_process" and node.args and not isinstance(node.args[0], ast.Constant)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
            if name == "anyio.open_process" and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} open_process with a command string")
    assert bad == []


# -- rpc-servers bind loopback unless asked --------------------------------------------------------------------------


def _prepare(demo_model, llama_bins, capsys, **kw):
    from arcsplit._api import ServeRequest, prepare
    from arcsplit.decide.specs import build_specs

    req = ServeRequest(model=str(demo_model), gpus="0,1", cpu_memory_mib=1024, ctx=4096, port=_free_port(),
                       llama_dir=str(llama_bins.server.parent), **kw)
    p = prepare(req)
    specs = build_specs(p.config, [50111, 50112][: 2])
    return p, specs, capsys.readouterr().err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # needs the llama.cpp build
def test_rpc_servers_bind_loopback_by_default(demo_model, llama_bins, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    p, specs, err = _prepare(demo_model, llama_bins, capsys)
    rpc = [s for s in specs if s.role == "rpc"]
    assert len(rpc) == 2
    for s in rpc:
        assert s.argv[s.argv.index("-H") + 1] == "127.0.0.1"
    server = specs[-1]
    assert server.argv[server.argv.index("--host") + 1] == "127.0.0.1"
    assert all(e.startswith("127.0.0.1:") for e in server.argv[server.argv.index("--rpc") + 1].split(","))
    assert "warning" not in err


@pytest.mark.slow  # needs the llama.cpp build
def test_rpc_servers_on_another_address_only_when_asked_and_with_a_warning(demo_model, llama_bins, capsys, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    p, specs, err = _prepare(demo_model, llama_bins, capsys, rpc_host="0.0.0.0")
    assert all(s.argv[s.argv.index("-H") + 1] == "0.0.0.0" for s in specs if s.role == "rpc")
    assert err == ""  # the library prints nothing: the warning is in what it returns...
    assert len(p.warnings) == 1 and "0.0.0.0" in p.warnings[0] and "trusted network" in p.warnings[0]
    # ...and the CLI says it once, before anything starts (the group itself is not started here)
    from arcsplit.cli import main

    monkeypatch.setattr("arcsplit.cli.serve_run.anyio.run", lambda *a, **k: 0)
    assert main(["serve", str(demo_model), "--gpus", "0,1", "--cpu-memory", "1024", "--ctx", "4096",
                 "--port", str(_free_port()), "--rpc-host", "0.0.0.0", "--llama-dir", str(llama_bins.bin_dir)]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "0.0.0.0" in warning[0] and "trusted network" in warning[0]


# -- the API key stays out of argv, logs, state and events; files are private ---------------------------------------


@pytest.mark.slow  # starts llama.cpp
@pytest.mark.parametrize("given", ["after --", "LLAMA_API_KEY"])
def test_api_key_never_recorded_and_run_files_private(given, demo_model, llama_bins, monkeypatch):
    """The key given after ``--`` (then only the user's own command line shows it) or in llama-server's own
    variable LLAMA_API_KEY in arcsplit's environment (then nothing in ps does)."""
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.server.parent))
    if given == "LLAMA_API_KEY":
        monkeypatch.setenv("LLAMA_API_KEY", SECRET)
    served = Served(Path(demo_model), ctx=2048, parallel=1, extra_serve=("--json-events",),
                    llama_args=("--api-key", SECRET) if given == "after --" else ())
    served.start()
    try:
        served.wait_ready(180)
        served.note_children()
        kids = served.children()
        assert sorted(kids) == ["rpc0", "rpc1", "server"]

        # every listening socket of the group is on loopback
        for name, proc in kids.items():
            listening = [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            assert listening and all(a.ip == "127.0.0.1" for a in listening), (name, listening)

        # the key reached llama-server (through its environment) and is enforced
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"{served.url}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=60, trust_env=False).status_code == 401
        ok = httpx.post(url, json=body, timeout=60, trust_env=False, headers={"Authorization": f"Bearer {SECRET}"})
        assert ok.status_code == 200

        # not in ps: no process arcsplit starts shows it (nor any process at all when it came by environment)
        ps = subprocess.run(["ps", "-eo", "pid,args", "-ww"], capture_output=True, text=True, check=True).stdout
        leaks = [line for line in ps.splitlines() if SECRET in line]
        user_typed = [line for line in leaks if line.split()[0] == str(served.proc.pid)]
        assert leaks == user_typed and (bool(user_typed) == (given == "after --")), leaks
        for proc in kids.values():
            assert SECRET not in " ".join(proc.cmdline())

        # not in anything the bus hands out (status, snapshot, logs)
        from arcsplit.run.bus import BusInfo, Client

        run_dirs = [d for d in (served.state_dir / "runs").iterdir() if d.is_dir()]
        assert len(run_dirs) == 1
        run_dir = run_dirs[0]
        with Client(BusInfo.read(run_dir / "bus.json"), timeout=10) as client:
            seen = json.dumps([client.status(), client.snapshot(), client.logs(n=100_000)], default=str)
        assert "--rpc" in seen  # the argv is there, just not the key
        assert SECRET not in seen

        # private: the run dir and its files, the control sockets
        runtime = served.base / "runtime"
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        sockets = [p for p in runtime.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
        assert len(sockets) == 2
        for s in sockets:
            assert stat.S_IMODE(s.stat().st_mode) & 0o077 == 0, s
        for d in (served.state_dir / "runs", run_dir):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        for f in ("state.json", "bus.json"):
            assert stat.S_IMODE((run_dir / f).stat().st_mode) & 0o077 == 0, f
    finally:
        served.stop()
    try:
        # after stop: nothing written anywhere holds the key (logs, state, the JSON event stream on stdout)
        written = [p for p in served.base.rglob("*") if p.is_file()]
        assert any(p.name == "server.log" for p in written)
        for p in written:  # serve.log is arcsplit's own stdout + stderr
            assert SECRET.encode() not in p.read_bytes(), p
        events = [json.loads(line) for line in served.output().splitlines() if line.startswith("{")]
        assert any(e.get("kind") == "state" and e.get("data", {}).get("argv") for e in events)
        assert served.leftovers() == {"processes": [], "ports": [], "temp_files": [], "state_files": []}
    finally:
        served.cleanup()


def test_api_key_flag_forms_move_to_the_environment():
    """`--api-key K` and `--api-key=K` both leave argv; other args keep their order."""
    from arcsplit.decide.specs import split_secrets

    args, env = split_secrets(("-c", "4096", "--api-key", "k1", "--jinja", "--api-key=k2", "--api-key-file", "/f"))
    assert args == ("-c", "4096", "--jinja", "--api-key-file", "/f")
    assert env == (("LLAMA_API_KEY", "k2"),)  # the last one wins, as in llama-server's own parser
