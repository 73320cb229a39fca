"""What the two set-up commands cost a new user: time and venv size of `./scripts/demo` and `./scripts/test`.

    python bench/setup_cost.py [--runs 1] [--which demo,test] [--rev HEAD] [--out bench/results/setup_cost.md]

Each run clones the repository (the committed tree at --rev) into a temporary directory and starts with an empty
pip cache, as a fresh machine would. The user cache of arcsplit (the llama.cpp build, the web UI, the demo
model) is the machine's own and stays as it is: a cold llama.cpp build is `arcsplit llama build`'s time, stated
apart. demo: from the command to llama-server answering /health (then Ctrl-C). test: scripts/test's set-up, up to
its first check (mypy), as `ARCSPLIT_SETUP=all` sourcing of scripts/_env.sh plus the same build/model/runtime
steps. Prints min / median / max over runs and the venv's size.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _report import write_report  # noqa: E402

TEST_SETUP = ("source scripts/_env.sh && arcsplit llama build --backend cpu && arcsplit model demo >/dev/null"
              " && source scripts/_oneapi.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clone(rev: str, into: Path) -> Path:
    dest = into / "arcsplit"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", rev], check=True)
    return dest


def _venv_mib(repo: Path) -> float:
    out = subprocess.run(["du", "-sk", str(repo / ".venv")], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CACHE_DIR"] = str(tmp / "pip-cache")  # nothing downloaded before
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if "/.venv/" not in p)
    return env


def run_demo(repo: Path, env: dict[str, str], limit: float) -> float:
    """Seconds from `./scripts/demo` to a 200 from /health; stops it with SIGINT as a user's Ctrl-C would."""
    port = _free_port()
    log = (repo.parent / "demo.log").open("wb")
    start = time.monotonic()
    proc = subprocess.Popen(["./scripts/demo", "--port", str(port)], cwd=repo, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while time.monotonic() - start < limit:
            if proc.poll() is not None:
                raise SystemExit(f"scripts/demo exited {proc.returncode}: see {log.name} in {repo.parent}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"scripts/demo did not serve within {limit:.0f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_test_setup(repo: Path, env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(["bash", "-c", TEST_SETUP], cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def _summary(xs: list[float]) -> str:
    return f"{min(xs):.0f} / {statistics.median(xs):.0f} / {max(xs):.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--which", default="demo,test")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds the demo may take to serve")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "setup_cost.md"))
    a = ap.parse_args()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    rows = []
    for which in a.which.split(","):
        times, sizes = [], []
        for i in range(a.runs):
            with tempfile.TemporaryDirectory(prefix="arcsplit-setup-") as tmp:
                repo = _clone(rev, Path(tmp))
                env = _env(Path(tmp))
                took = run_demo(repo, env, a.limit) if which == "demo" else run_test_setup(repo, env)
                times.append(took)
                sizes.append(_venv_mib(repo))
                print(f"{which} run {i + 1}: {took:.0f} s, .venv {sizes[-1]:.0f} MiB", flush=True)
        rows.append(f"| `./scripts/{which}` | {_summary(times)} | {_summary(sizes)} | {a.runs} |")
    load = os.getloadavg()
    text = "\n".join([
        "# Set-up cost of the two scripts on a fresh clone",
        "",
        f"Commit {rev}; {os.cpu_count()} cores; load average at the end {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (1/5/15 min: other work shared the machine). Empty pip cache per run; arcsplit's user "
        "cache (llama.cpp build, web UI, demo model) as this machine had it. demo: to /health answering; "
        "test: scripts/test's set-up before its first check.",
        "",
        "| command | seconds min / median / max | .venv MiB min / median / max | runs |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Command: `python bench/setup_cost.py --runs {a.runs} --which {a.which}`",
        "",
    ])
    write_report(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
