"""How soon ``arcsplit serve --layout L`` spawns another host's ssh session, and what it imports before that.

    python bench/early_spawn.py [--runs 10] [--tree PATH ...] [--out FILE]

serve starts its hosts' sessions before it imports the serving stack (cli.main -> _warm.run_early), after checking
its flags and model (cli._check_serve), so a refused run logs in to no host. What that check imports delays every
session. For each ``--tree`` (an arcsplit checkout, default this one; bytecode compiled first, as pip install
would; the trees' runs alternate) this times ``python -m arcsplit serve MODEL --layout L`` from its exec to the
ssh's spawn: an audit hook on ``subprocess.Popen`` reads the monotonic clock (one clock for every process on Linux)
and ends the process before the spawn, so no ssh runs and no host is contacted (the layout's host is
127.0.0.1 port 1 anyway). The model is an empty file: the check only asks that it exists. It also lists, from
``python -X importtime``, the modules the check imports beyond what cli.main has imported before it. Prints
min / median / max in ms.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from startup import cell, tree_args  # noqa: E402  (the same table cells and --tree handling)

LAYOUT = """name = "bench"

[[hosts]]
name = "b"
ssh = "ssh://nobody@127.0.0.1:1"

[[cards]]
backend = "cpu"
index = 0
memory_mib = 1024

[[cards]]
backend = "cpu"
host = "b"
index = 0
memory_mib = 1024
"""

# The child: the hook stops the process at the first ssh spawn (wrapped: proc/_exec.py, stdbuf), printing when it
# came, before the fork.
_CHILD = """import os, runpy, sys, time
def hook(event, args):
    if event == "subprocess.Popen" and "ssh" in [os.path.basename(str(a)) for a in args[1]]:
        os.write(1, repr(time.monotonic()).encode())
        os._exit(0)
sys.addaudithook(hook)
sys.argv = ["arcsplit", *sys.argv[1:]]
runpy.run_module("arcsplit", run_name="__main__", alter_sys=True)
"""

# What _check_serve imports: the modules -X importtime reports after cli.main's own imports (arcsplit.cli, _warm).
# Its first is serve's command module, which build_parser imports with importlib.import_module: -X importtime does
# not report a module imported that way (only those it imports in turn), so an import statement takes it first.
_IMPORTS = """import sys
import arcsplit.cli, arcsplit._warm
print("MARK", file=sys.stderr, flush=True)
import arcsplit.cli.serve
arcsplit.cli._check_serve(sys.argv[1:])
"""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def spawn_s(tree: Path, argv: list[str]) -> float:
    """Seconds from exec to the ssh spawn of one ``arcsplit serve`` from ``tree``; no spawn stops the bench."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=tree, env=_env(tree), capture_output=True,
                       text=True)
    if r.returncode != 0 or not r.stdout:
        raise SystemExit(f"early_spawn: no ssh spawned in {tree} (exit {r.returncode}): "
                         f"{r.stderr.strip().splitlines()[-1:]}")
    return float(r.stdout) - t0


def check_imports(tree: Path, argv: list[str]) -> list[tuple[int, int, str]]:
    """(self us, cumulative us, module) of each module _check_serve imports, top-level imports first."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", _IMPORTS, *argv], cwd=tree, env=_env(tree),
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"early_spawn: the check failed in {tree}: {r.stderr.strip().splitlines()[-1:]}")
    lines = r.stderr.split("MARK\n", 1)[1].splitlines()
    out = []
    for line in lines:
        if line.startswith("import time:") and "|" in line:
            self_us, cum_us, name = (part.strip() for part in line[len("import time:"):].split("|"))
            out.append((int(self_us), int(cum_us), name))
    return out


def main() -> int:
    a, trees = tree_args(__doc__ or "")
    got: dict[Path, list[float]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="arcsplit-early-") as tmp:
        model, layout = Path(tmp) / "m.gguf", Path(tmp) / "layout.toml"
        model.touch()
        layout.write_text(LAYOUT, encoding="utf-8")
        argv = ["serve", str(model), "--layout", str(layout), "--backend", "cpu"]
        imports = {t: check_imports(t, argv) for t in trees}
        for t in trees:
            spawn_s(t, argv)  # warm the page cache
        for i in range(a.runs):
            for t in (trees if i % 2 == 0 else trees[::-1]):
                got[t].append(spawn_s(t, argv))
    rows = ["| tree | exec to ssh spawn, ms | modules _check_serve imports | their import time, ms (-X importtime) |",
            "|---|---|---|---|"]
    rows += [f"| `{t}` | {cell(got[t])} | {len(imports[t])} | {sum(s for s, _, _ in imports[t]) / 1000:.0f} |"
             for t in trees]
    for t in trees:
        heavy = sorted((c for c in imports[t] if c[1] >= 10_000), key=lambda c: -c[1])[:15]
        rows += ["", f"`{t}`: imports of 10 ms or more (cumulative), biggest first: "
                 + (", ".join(f"{name} {cum / 1000:.0f}" for _, cum, name in heavy) or "none")]
    text = "\n".join([f"# serve --layout: exec to the first ssh spawn, {a.runs} runs each, min / **median** / max "
                      f"ms ({os.cpu_count()} cores, Python {sys.version.split()[0]})", "", *rows, ""])
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
