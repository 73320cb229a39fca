"""bench/RESULTS.md: one current row per figure, its history in a results file of its own, plots by matplotlib.

It was 6,800 lines with up to 40 rows per figure, and its plot a hand-written SVG."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import run_all  # noqa: E402


def test_one_current_row_per_figure_and_every_run_in_its_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    res = tmp_path / "results"
    res.mkdir()
    (res / "multihost.md").write_text("Result: time to ready 1.08x (target <= 1.2x: meets).\n")
    (res / "multihost_quick_after.md").write_text("Result: time to ready 1.36x (target <= 1.2x: misses).\n")
    (res / "custom_probe.md").write_text("# A figure nobody listed\n\nsomething measured\n")
    monkeypatch.setattr(run_all, "RESULTS", res)
    text = run_all.assemble([])
    rows = [line for line in text.splitlines() if line.startswith("| 6. ")]
    assert len(rows) == 1, rows
    assert "1.08x" in rows[0] and "1.36x" not in rows[0] and "[2 runs](results/history/6.md)" in rows[0]
    history = (res / "history" / "6.md").read_text()
    assert history.index("1.08x") < history.index("1.36x")  # the current run first, then the earlier ones
    assert "## bench/results/multihost_quick_after.md" in history  # each file's full text, nothing dropped
    assert any(line.startswith("| custom_probe |") for line in text.splitlines())
    assert (res / "history" / "custom-probe.md").exists()


def test_the_plot_is_drawn_by_matplotlib_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    res = tmp_path / "results"
    res.mkdir()
    row = "| {m} (x) | 1 | 2 | 3 | 4 | 5 | 0.90x | 0.97x | 0.93x |\n"
    (res / "throughput_cpu.md").write_text("".join(row.format(m=m) for m in ("native", "hybrid", "rpc")))
    monkeypatch.setattr(run_all, "RESULTS", res)
    assert not hasattr(run_all, "write_svg")
    path, how = run_all.plot(res)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert path is None and "[bench]" in how
        return
    assert path == res / "throughput.png" and path.read_bytes()[:4] == b"\x89PNG" and how == "matplotlib"


def test_the_ubatch_overlap_figure_passes_only_when_256_beats_512_on_both_routes():
    """5u's verdict reads the paired rows bench/throughput.py writes: the committed CPU file passes; the same rows
    with hybrid's median at or below 1 fail; a file without the pairs says so instead of guessing."""
    text = (Path(run_all.__file__).parent / "results" / "throughput_cpu_ubatch_overlap.md").read_text()
    v = run_all.v_ubatch_overlap(text)
    assert v.status == "pass" and "rpc 1.33 / 1.33 / 1.48 (3 of 3)" in v.detail
    worse = re.sub(r"(\| hybrid / hybrid-ub512 \| )[^|]*", r"\g<1>0.90 / **0.97** / 1.02 (1 of 3) ", text)
    assert run_all.v_ubatch_overlap(worse).status == "FAIL"
    assert run_all.v_ubatch_overlap("# nothing\n").status == "info"


def test_split_cost_over_native_with_the_same_setting():
    """bench/twin_cost.py: rpc-bs is judged against native-bs of the same run (not plain native, which the setting
    does not speed up); a plain route or an -alt row without its own twin is left alone; the figure fails when a
    route's median over its twin is above 100 us."""
    import twin_cost

    def rep(run: int, mode: str, tps: list[float]) -> str:
        return (f"- run {run}, {mode}: ready after 1.00 s; prefill 1000.0, 1000.0; "
                f"decode {', '.join(f'{x:.2f}' for x in tps)}; 4 streams 1.0; TTFT ms 1.0; cache on 1.0")

    # native 400 t/s (2500 us), native-bs 500 (2000 us), rpc-bs 490 / 480 / 495 t/s, hybrid 350 (no twin)
    lines = ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-4097bd8a-48f4-274b-da50-169789380b9f), Linux", ""]
    for run, rpc_bs in ((1, 490.0), (2, 480.0), (3, 495.0)):
        lines += [rep(run, "native", [400, 401, 399]), rep(run, "native-bs", [500, 500, 500]),
                  rep(run, "rpc-bs", [rpc_bs, rpc_bs]), rep(run, "hybrid", [350])]
    text = "\n".join(lines)
    costs = twin_cost.twin_costs(text)
    assert list(costs) == [("rpc-bs", "native-bs")]
    assert [round(x) for x in costs[("rpc-bs", "native-bs")]] == [41, 83, 20]
    v = run_all.v_twin_us(text)
    assert v.status == "pass" and "GPU-4097bd8a" in v.detail and "+20 / +41 / +83" in v.detail
    slow = text.replace("decode 490.00, 490.00", "decode 450.00, 450.00")  # run 1: +222 us; median now +83
    assert run_all.v_twin_us(slow).status == "pass"
    slower = slow.replace("decode 495.00, 495.00", "decode 460.00, 460.00")  # run 3: +174; median +174
    assert run_all.v_twin_us(slower).status == "FAIL"
    assert run_all.v_twin_us("no repetitions here").status == "info"


def test_tune_verdict_reads_only_the_rig_table_whatever_follows_it():
    """bench/tune.py's file: the rig table, then per-candidate tables (7 columns since time to first token), which
    must not be read as rigs; a pick slower than the default by more than the noise fails."""
    rig = "| rig | runs | picks | default / pick (min / median / max) | wall | rerun | wrong | picks correct |\n" \
          "|---|---|---|---|---|---|---|---|\n| llama | 3 | p | {r} / 1.80 / 1.86 | 34 / 35 / 35 | x | 0 | 3/3 |\n"
    cands = "\n**llama**\n\n| candidate | status | prefill | decode | streams | ttft ms | why |\n" \
            "|---|---|---|---|---|---|---|\n| cpu rpc [defaults] | ok | 1.0 | 2.0 | 3.0 | 79.0 |  |\n"
    good = run_all.v_tune(rig.format(r="1.73") + cands, "default/pick")
    assert good.status == "pass" and "llama: default/pick 1.73 / 1.80 / 1.86" in good.detail
    assert "cpu rpc" not in good.detail
    assert run_all.v_tune(rig.format(r="0.80") + cands, "default/pick").status == "FAIL"
