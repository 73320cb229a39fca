"""bench/throughput.py end to end at its quickest: every mode served through arcsplit, real HTTP, a table out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, llama_bins, out: Path, *args: str, timeout: float = 300) -> str:
    """Run bench/<script> on the test build, writing its results to ``out``; returns its stdout."""
    env = {**os.environ, "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_throughput_bench_prints_table_and_ratios(llama_bins, demo_model, tmp_path: Path) -> None:
    out = tmp_path / "throughput.md"
    stdout = run_bench("throughput.py", llama_bins, out, "--model", str(demo_model), "--reps", "1", "--n-predict", "4",
                       "--ctx", "2048", timeout=180)
    assert "native on CPU = arcsplit mode single" in stdout
    rows = {}
    for line in out.read_text().splitlines():
        m = re.match(r"\| (native|hybrid|rpc) \((\w+)\) \| (\d+) \| .*? \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                     r"([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+)x \| (.*) \|$",
                     line)
        if m:
            rows[m.group(1)] = m.groups()
    assert set(rows) == {"native", "hybrid", "rpc"}, out.read_text()
    assert rows["native"][1] == "single" and rows["hybrid"][1] == "hybrid" and rows["rpc"][1] == "rpc"
    for mode, g in rows.items():
        prefill, decode, streams = (float(x) for x in g[3:6])
        assert prefill > 0 and decode > 0 and streams > 0, g
        # ratio columns are the mode's medians over native's, as printed (2 decimals)
        for value, native, r in zip((prefill, decode, streams), (float(x) for x in rows["native"][3:6]), g[6:9]):
            assert abs(value / native - float(r)) < 0.006, (mode, value, native, r)
    # time to first token on the client's clock, cache off and on, and its ratio to native's
    for mode, g in rows.items():
        ttft, ttft_cache = float(g[9]), float(g[10])
        assert ttft > 0 and ttft_cache > 0, g
        assert abs(ttft / float(rows["native"][9]) - float(g[11])) < 0.006, (mode, g)
    assert rows["native"][13] == "(reference)"
    # greedy output through the RPC routes equals the one-process run (same -fa/-ub, repack off)
    assert rows["hybrid"][13].startswith("yes") and rows["rpc"][13].startswith("yes"), rows
    # the recorded commands are the ones arcsplit ran: rpc-servers on loopback, llama-server pointed at them
    text = out.read_text()
    assert re.search(r"rpc / rpc1: `\S*rpc-server -H 127\.0\.0\.1 -p \d+ -t \d+( -c --seed-cache \S+)?`", text)
    assert re.search(r"rpc / server: `\S*llama-server .*--rpc 127\.0\.0\.1:\d+,127\.0\.0\.1:\d+ "
                     r"--device RPC0,RPC1", text)


@pytest.mark.slow
def test_rpc_patch_removes_blocking_waits(llama_bins, demo_model, tmp_path: Path) -> None:
    """arcsplit's llama.cpp patches (docs/patches.md) queue uploads instead of waiting for them: on the all-RPC
    route the rpc-server holding the layers sleeps far less often per token than with the patches switched off;
    with the link polling (patch 0005, ARCSPLIT_RPC_SPIN_US) the whole group sleeps far less again."""
    out = tmp_path / "waits.md"
    run_bench("rpc_waits.py", llama_bins, out, "--model", str(demo_model), "--modes", "rpc", "--reps", "3",
              "--tokens", "32", "--spin-us", "3000")
    rows = {}
    for line in out.read_text().splitlines():
        m = re.match(r"\| rpc \| (stock|patched|patched, spin \d+ us) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                     r"([\d.]+) \|", line)
        if m:
            rows[m.group(1).split(",")[0] + ("+spin" if "spin" in m.group(1) else "")] = [
                float(x) for x in m.groups()[1:]]
    assert set(rows) == {"stock", "patched", "patched+spin"}, out.read_text()
    server, rpc0, _, total = range(4)
    assert rows["patched"][rpc0] < 0.75 * rows["stock"][rpc0], rows
    assert rows["patched"][total] < rows["stock"][total], rows
    assert rows["patched+spin"][total] < 0.5 * rows["patched"][total], rows

@pytest.mark.slow
def test_rpc_link_bench_links_through_shared_memory_and_prints_every_cell(llama_bins, tmp_path: Path) -> None:
    """bench/rpc_link.py on the test build: its client (compiled here against the build's ggml) talks to a real
    rpc-server; the shared-memory rows only count when the rpc-server said it linked (the bench exits non-zero
    otherwise), and every link gets a round trip and both bulk directions, patch 0014's copied-first rows too. Speeds are the bench's to print, not
    this test's to assert."""
    out = tmp_path / "link.md"
    run_bench("rpc_link.py", llama_bins, out, "--runs", "1", "--reps", "5", "--sizes", "0.0625", timeout=240)
    rows = {}
    for line in out.read_text().splitlines():
        if line.startswith("| ") and "**" in line:
            name, *cells = [c.strip() for c in line.strip("|").split("|")]
            rows[name] = cells
    assert set(rows) == {"shared memory, polling 20000 us", "loopback TCP, polling 20000 us", "shared memory",
                         "loopback TCP", "shared memory, polling 20000 us, sets copied first",
                         "loopback TCP, polling 20000 us, sets copied first"}, out.read_text()
    assert all(len(cells) == 3 and all(re.fullmatch(r"\d+ / \*\*\d+\*\* / \d+", c) for c in cells)
               for cells in rows.values()), rows


@pytest.mark.slow
def test_poll_cost_bench_prints_a_row_per_mode_and_polling_budget(llama_bins, demo_model, tmp_path: Path) -> None:
    """bench/poll_cost.py on the test build: every process of the group is counted (CPU time from /proc), polling
    off and on, while decoding and idle. The cores it prints are the bench's to report; only their shape and sign
    are this test's."""
    out = tmp_path / "poll.md"
    run_bench("poll_cost.py", llama_bins, out, "--model", str(demo_model), "--modes", "hybrid", "--spin-us", "3000",
              "--tokens", "4", "--reps", "1", "--idle", "0.3", timeout=240)
    rows = [m.groups() for m in re.finditer(r"^\| hybrid \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                                           out.read_text(), re.M)]
    assert [r[0] for r in rows] == ["0", "3000"], out.read_text()
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and float(r[4]) > 0 for r in rows), rows
    assert "the cards are the cores" in out.read_text()  # the CPU build's reading of its rows


@pytest.mark.slow
def test_prompt_cache_link_counts_the_kv_copies_over_the_link(llama_bins, tmp_path: Path) -> None:
    """bench/prompt_cache_link.py: with llama.cpp's default prompt cache an rpc-server of an all-RPC group answers
    more GET_TENSORs (the KV copied out at slot selection) than with --cache-ram 0, on the same three prompts."""
    out = tmp_path / "cache.md"
    run_bench("prompt_cache_link.py", llama_bins, out, "--parallel", "1", timeout=240)
    rows = re.findall(r"^\| 1 \| (default|`--cache-ram 0`).*? \| (rpc\d) \| (\d+) \| ([\d,]+) \| ([\d,]+) \|$",
                      out.read_text(), re.MULTILINE)
    gets = {(on == "default", name): int(n) for on, name, n, _, _ in rows}
    assert len(gets) == 4, out.read_text()
    assert all(gets[(True, r)] > gets[(False, r)] for r in ("rpc0", "rpc1")), gets


@pytest.mark.slow
def test_startup_bench_times_each_entry_point_of_each_tree(llama_bins, demo_model, tmp_path: Path) -> None:
    """bench/startup.py: --help, plan on the demo model and the node agent's exec to ready, for the trees named
    (here this checkout twice), each cell min / median / max of the runs."""
    out = tmp_path / "startup.md"
    run_bench("startup.py", llama_bins, out, "--runs", "1", "--tree", str(ROOT), "--tree", str(ROOT), timeout=240)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "ms |" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| arcsplit --help", "| arcsplit plan (demo model)",
                                                 "| node agent: exec to ready"]
    for r in rows:
        cells = r.strip("| ").split(" | ")[1:]
        assert len(cells) == 2 and all(re.fullmatch(r"\d+ / \*\*\d+\*\* / \d+", c) for c in cells), r
