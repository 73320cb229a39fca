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
