"""One RPC link's speed, shared memory against loopback TCP (patch 0008), with and without polling (0005).

    python bench/rpc_link.py [--backend cpu|cuda] [--sizes 0.0625,4] [--reps 30] [--runs 3] [--spin-us 20000]

Why this figure: patch 0008 changes how bytes cross between llama-server and an rpc-server on the same host;
what it buys a route depends on the card, but the link itself can be timed anywhere. A small client
(bench/link/rpc_link.cpp, compiled here against the managed build's ggml) talks to a real ggml-rpc-server
through ggml's own RPC backend and times, per repetition: an upload of N bytes into a compute buffer (SET_TENSOR,
then a 4-byte GET so it has landed), a download of N bytes (GET_TENSOR) and a 4-byte round trip. Each run starts a
fresh rpc-server per variant; a cell is min / median / max over runs of each run's median. The rpc-server's log
must say "shared-memory link" in every shm row (checked). On a GPU backend the rpc-server's buffer is on the card,
so an upload includes its copy to the card. On a GPU backend the client also times a device upload: a copy from a
tensor on its own card into the rpc-server's buffer (a hybrid split's activation: patch 0001 reads the card into a
page-locked payload; the row "pageable reads" is the same link with ARCSPLIT_RPC_PINNED=0, ordinary memory).
Writes bench/results/rpc_link_<backend>.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from arcsplit.llama.devices import cpu_model  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.llama.build import cache_trees  # noqa: E402
from arcsplit.llama.patches import IN_PLACE_ENV, PINNED_ENV, SHM_ENV, SPIN_ENV  # noqa: E402
from arcsplit.proc.ports import free_port, wait_listening  # noqa: E402
from throughput import build_line  # noqa: E402
from _proc import stop  # noqa: E402
from _report import write_report  # noqa: E402

CLIENT = ROOT / "bench" / "link" / "rpc_link.cpp"


def compile_client(bin_dir: Path, out: Path) -> Path:
    """The client, against the headers of the tree the build was made from (arcsplit's cache layout)."""
    found = [t / "ggml" / "include" for t in cache_trees(bin_dir)]
    include = next((d for d in found if (d / "ggml-rpc.h").is_file()), None)
    if include is None:
        raise SystemExit(f"no ggml headers for {bin_dir}: run this on a build arcsplit made (arcsplit llama build)")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler on PATH (apt-get install g++)")
    exe = out / "rpc_link"
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{include}", str(CLIENT), f"-L{bin_dir}", "-lggml", "-lggml-base",
                    "-lggml-rpc", f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe


def one_run(rpc_server: Path, client: Path, env: dict[str, str], sizes: list[int], reps: int, log: Path
            ) -> dict[tuple[str, int], float]:
    """A fresh rpc-server, the client once per size: each (op, bytes) -> the median over the repetitions, in us."""
    port = free_port()
    full = {**os.environ, **env}
    with log.open("wb") as fh:
        server = subprocess.Popen([str(rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"], env=full,
                                  stdout=fh, stderr=subprocess.STDOUT)
    try:
        wait_listening(server, "127.0.0.1", port, 60)  # before the client: an rpc-server serves one client
        samples: dict[tuple[str, int], list[float]] = {}
        for size in sizes:
            out = subprocess.run([str(client), f"127.0.0.1:{port}", str(size), str(reps)], env=full, check=True,
                                 capture_output=True, text=True, timeout=600).stdout
            for line in out.splitlines():
                op, n, us = line.split()
                samples.setdefault((op, size if op != "round_trip" else 4), []).append(float(us))
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {k: statistics.median(v) for k, v in samples.items()}


def link_variant(shm: bool, spin_us: int, pinned: bool = True, in_place: bool = True) -> tuple[str, dict[str, str]]:
    """A row: its name and the environment of both ends (patch 0008's link on or off, 0005's polling budget,
    0001's page-locked device reads, 0014's sets sent from where their data lies)."""
    name = ("shared memory" if shm else "loopback TCP") + (f", polling {spin_us} us" if spin_us else "") \
        + ("" if pinned else ", pageable reads") + ("" if in_place else ", sets copied first")
    return name, {SHM_ENV: "1" if shm else "0", SPIN_ENV: str(spin_us), **({} if pinned else {PINNED_ENV: "0"}),
                  **({} if in_place else {IN_PLACE_ENV: "0"})}


def spread(values: list[float]) -> str:
    return f"{min(values):.0f} / **{statistics.median(values):.0f}** / {max(values):.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--llama-dir")
    ap.add_argument("--sizes", default="0.0625,4", help="MiB per bulk transfer, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spin-us", type=int, default=20000, help="the polling rows' ARCSPLIT_RPC_SPIN_US (0: none)")
    ap.add_argument("--out")
    a = ap.parse_args()
    bins = find_llama(a.llama_dir, backend=a.backend)
    sizes = [int(float(s) * 2**20) for s in a.sizes.split(",")]
    spins = (a.spin_us, 0) if a.spin_us > 0 else (0,)
    variants = [link_variant(shm, spin) for spin in spins for shm in (True, False)]
    if a.backend != "cpu":  # the client has a card of its own: its reads into page-locked memory, on and off
        variants.append(link_variant(True, spins[0], pinned=False))
    # patch 0014 off: every upload copied into a block of the client's own first, as stock does
    variants += [link_variant(shm, spins[0], in_place=False) for shm in (True, False)]
    results: dict[str, list[dict[tuple[str, int], float]]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="rpc-link-") as tmp:
        client = compile_client(Path(bins.bin_dir), Path(tmp))
        for run in range(a.runs):
            for name, env in variants:
                log = Path(tmp) / "rpc-server.log"
                medians = one_run(Path(bins.rpc_server), client, env, sizes, a.reps, log)
                linked = "shared-memory link" in log.read_text(errors="replace")
                if linked != (env[SHM_ENV] == "1"):
                    raise SystemExit(f"{name}: the rpc-server {'did not link' if not linked else 'linked'} through "
                                     "shared memory (a build without patch 0008?)")
                results[name].append(medians)
                print(f"run {run + 1}/{a.runs} {name}: " + ", ".join(f"{op} {n}: {us:.0f} us"
                                                                     for (op, n), us in sorted(medians.items())))
    ops = ("upload", "download") + (("device_upload",) if all(("device_upload", sizes[0]) in r for runs in
                                                              results.values() for r in runs) else ())
    keys = [("round_trip", 4)] + [(op, n) for n in sizes for op in ops]
    head = ["| link |"] + [f" {op.replace('_', ' ')} {n / 2**20:g} MiB |" if n > 4 else " round trip, 4 bytes |"
                           for op, n in keys]
    lines = [f"# One RPC link, shared memory against loopback TCP ({a.backend})", "",
             f"- Build: {build_line(a.llama_dir, a.backend)}",
             f"- Machine: {cpu_model()} ({os.cpu_count()} cores)",
             f"- Command: `{shlex.join(['python', 'bench/rpc_link.py', *sys.argv[1:]])}`",
             f"- {a.runs} runs, each a fresh rpc-server per row; {a.reps} repetitions per run after 2 warm-ups. A cell "
             "is microseconds, min / **median** / max over runs of each run's median. Upload = SET_TENSOR of N bytes "
             "into a compute buffer, then a 4-byte GET (so it has landed); download = GET_TENSOR of N bytes; round "
             "trip = a 4-byte GET; device upload = a copy from a tensor on the client's own card into the "
             "rpc-server's buffer, then a 4-byte GET. Shared-memory rows: patch 0008 (ARCSPLIT_RPC_SHM=1 on both "
             "ends, the rpc-server's log says it linked); TCP rows: the same build with ARCSPLIT_RPC_SHM=0. An upload of "
             "256 KiB or more leaves from the client's own memory (patch 0014); rows 'sets copied first': "
             "ARCSPLIT_RPC_IN_PLACE=0, the data copied into a block of the client's own before it is sent, as stock "
             "does.", "",
             "".join(head), "|---|" + "---|" * len(keys)]
    for name, runs in results.items():
        lines.append(f"| {name} | " + " | ".join(spread([r[k] for r in runs]) for k in keys) + " |")
    bulk = sizes[-1]
    lines += ["", f"Throughput of the {bulk / 2**20:g} MiB transfers (median of run medians): " + "; ".join(
        f"{name}: up {bulk / statistics.median([r[('upload', bulk)] for r in runs]):.0f} MB/s, "
        f"down {bulk / statistics.median([r[('download', bulk)] for r in runs]):.0f} MB/s"
        for name, runs in results.items()) + ".", ""]
    write_report(a.out or ROOT / "bench" / "results" / f"rpc_link_{a.backend}.md", "\n".join(lines))


if __name__ == "__main__":
    main()
