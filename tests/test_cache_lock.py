"""Every writer of the shared cache holds one lock and checks "is it done?" again once it holds it.

Two `arcsplit llama build`s at once (a demo beside a test run) crashed in the web UI build with `FileExistsError:
.../ui-work`: the UI build ran outside the lock. The race below is two real processes building the UI into one
empty cache. npm itself is a stand-in here (a script that takes a second for `npm ci` and writes index.html for
`npm run build`): the real `npm ci` downloads about 700 MB and takes minutes, too much for a test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_NPM = textwrap.dedent("""\
    #!/bin/sh
    echo "$$ $*" >> "$NPM_CALLS"
    case "$1" in
      ci) sleep 1; mkdir -p node_modules ;;
      run) mkdir -p "$LLAMA_UI_OUT_DIR" && echo '<html>llama.cpp</html>' > "$LLAMA_UI_OUT_DIR/index.html" ;;
    esac
    """)
FAKE_NODE = "#!/bin/sh\necho v20.19.0\n"

BUILD_UI = ("import sys; from pathlib import Path; from arcsplit.llama.webui import build_ui; "
            "r = build_ui(lambda step, pct: print(step, flush=True), source=Path(sys.argv[1])); "
            "print('reason:', r, flush=True); sys.exit(0 if r is None else 1)")


def _tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("npm", FAKE_NPM), ("node", FAKE_NODE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ui = tmp_path / "tree" / "tools" / "ui"
    (ui / "src").mkdir(parents=True)
    (ui / "package.json").write_text('{"name": "ui"}\n')
    for i in range(200):  # enough files that copying the tree takes a moment
        (ui / "src" / f"part{i}.js").write_text("export const x = 1;\n" * 50)
    return bin_dir


def test_two_processes_build_the_ui_once(tmp_path: Path) -> None:
    bin_dir = _tools(tmp_path)
    cache = tmp_path / "cache"
    calls = tmp_path / "npm-calls"
    env = {**os.environ, "ARCSPLIT_CACHE_DIR": str(cache), "NPM_CALLS": str(calls),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_UI, str(tmp_path / "tree")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "Traceback" not in "".join(outs)
    ran = calls.read_text().splitlines()
    assert sum(" ci" in line for line in ran) == 1, ran  # the second found the first one's UI once it held the lock
    assert any("waiting for another arcsplit process" in out for out in outs), outs
    root = next((cache / "llama.cpp").iterdir())
    assert (root / "ui" / "index.html").read_text().startswith("<html>")
    assert not (root / "ui-work").exists() and not (root / "ui.partial").exists()


def test_a_model_another_process_fetched_is_not_fetched_again(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from arcsplit import demo

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path))
    target = demo.chat_model_path()
    # Another process holds the cache lock while it fetches the chat model, then writes it and lets go.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; from pathlib import Path; fh = open(sys.argv[1], 'a'); "
         "fcntl.flock(fh, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.0); "
         "t = Path(sys.argv[2]); t.parent.mkdir(parents=True, exist_ok=True); t.write_bytes(b'GGUF')",
         str(tmp_path / "lock"), str(target)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

    def no_download(*a: object, **k: object) -> None:
        raise AssertionError("fetched again although another process had fetched it")

    monkeypatch.setattr(demo.subprocess, "run", no_download)
    got: list[Path] = []
    t = threading.Thread(target=lambda: got.append(demo.ensure_chat_model()))
    t.start()
    t.join(30)
    assert holder.wait(10) == 0
    assert got == [target] and target.read_bytes() == b"GGUF"
