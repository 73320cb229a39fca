"""The shipped layouts and `arcsplit plan`: plans for rigs you do not have, and one-line errors for bad input."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.cli import main
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, make_plan
from arcsplit.rig import load_layout

LAYOUTS = Path(__file__).resolve().parents[1] / "layouts"
EXPECTED = {
    "2x-arc-pro-b70.toml": [32656, 32656],
    "arc-b580-plus-pro-b70.toml": [12216, 32656],
    "4x-arc-pro-b60.toml": [24480] * 4,
    "2x-h200.toml": [143771, 143771],
    "cpu-demo.toml": [2048, 2048],
    "two-hosts-2x-b70.toml": [32656] * 4,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layout_loads_and_plans(name: str, demo_model: Path) -> None:
    rig = load_layout(LAYOUTS / name)
    assert [c.total_bytes // 2**20 for c in rig.cards] == EXPECTED[name]
    plan = make_plan(load_profile(demo_model), rig, PlanOptions(n_ctx=None))
    assert sum(plan.tensor_split) == 19 and plan.n_ctx >= 4096
    assert all(c.total <= c.card.budget_bytes for c in plan.cards)


def test_every_shipped_layout_is_tested() -> None:
    assert sorted(p.name for p in LAYOUTS.glob("*.toml")) == sorted(EXPECTED)


def test_plan_cli_json_for_a_layout(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(demo_model), "--layout", str(LAYOUTS / "cpu-demo.toml"), "--ctx", "8192", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_ctx"] == 8192 and sum(d["tensor_split"]) == 19
    assert [c["device"] for c in d["cards"]] == ["RPC0", "RPC1"]  # CPU cards are rpc-servers to llama-server
    assert d["llama_server_args"][:2] == ["--device", "RPC0,RPC1"]


def test_plan_cli_table(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(demo_model), "--layout", str(LAYOUTS / "arc-b580-plus-pro-b70.toml")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "free after" in out and "layer map" in out and "[out]" in out and "SYCL1" in out
    # card names whole, as the layout and sycl-ls give them (they were cut at 28 characters)
    assert "Intel(R) Arc(TM) Pro B70 Graphics " in out and "Intel(R) Arc(TM) B580 Graphics " in out


def test_save_writes_a_layout_that_loads_back(demo_model: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "my-rig.toml"
    rc = main(["plan", str(demo_model), "--layout", str(LAYOUTS / "2x-arc-pro-b70.toml"), "--ctx", "4096",
               "--save", str(saved), "--json"])
    assert rc == 0
    ts = json.loads(capsys.readouterr().out)["tensor_split"]
    rig = load_layout(saved)
    assert len(rig.cards) == 2 and rig.pinned_plan["tensor_split"] == ts and rig.pinned_plan["n_ctx"] == 4096


def test_live_cpu_cards(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(demo_model), "--backend", "cpu", "--gpus", "0,1", "--cpu-memory", "1024", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert [c["device"] for c in d["cards"]] == ["RPC0", "RPC1"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse usage errors exit 2 with one line too
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in err and "Traceback" not in err
    assert needle in err


def test_bad_inputs_exit_2(tmp_path: Path, demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "x.gguf"
    text.write_text("hello")
    _one_line_error(capsys, ["plan", str(text), "--layout", str(LAYOUTS / "cpu-demo.toml")], "not a GGUF")
    small = tmp_path / "small.toml"
    small.write_text('[[cards]]\nbackend = "sycl"\nmemory_mib = 64\n')
    _one_line_error(capsys, ["plan", str(demo_model), "--layout", str(small)], "short by")
    zero = tmp_path / "zero.toml"
    zero.write_text('[[cards]]\nbackend = "sycl"\nmemory_mib = 0\n')
    _one_line_error(capsys, ["plan", str(demo_model), "--layout", str(zero)], "must be positive")
    neg = tmp_path / "neg.toml"
    neg.write_text('[[cards]]\nbackend = "sycl"\nmemory_mib = -5\n')
    _one_line_error(capsys, ["plan", str(demo_model), "--layout", str(neg)], "must be positive")
    _one_line_error(capsys, ["plan", str(demo_model), "--layout", str(LAYOUTS / "cpu-demo.toml"), "--ctx", "-3"], "--ctx")
    shard = synth.write_sharded_llama(tmp_path / "s.gguf", n_shards=2)
    (tmp_path / "s-00002-of-00002.gguf").unlink()
    _one_line_error(capsys, ["plan", str(shard), "--layout", str(LAYOUTS / "cpu-demo.toml")], "s-00002-of-00002.gguf")
    _one_line_error(capsys, ["plan", str(demo_model), "--layout", str(tmp_path / "none.toml")], "does not exist")


def test_a_shipped_layout_goes_by_name_and_a_path_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_name = load_layout("2x-arc-pro-b70")
    assert by_name == load_layout(LAYOUTS / "2x-arc-pro-b70.toml")
    own = tmp_path / "mine.toml"
    own.write_text('[[cards]]\nbackend = "cpu"\nindex = 0\nname = "a"\nmemory_mib = 4096\n')
    assert load_layout(own).name == "mine"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-demo").write_text(own.read_text())  # a file here of a shipped name: the file, as before
    assert load_layout("cpu-demo").name == "cpu-demo" and len(load_layout("cpu-demo").cards) == 1


def test_an_unknown_layout_name_is_one_line_naming_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "model.gguf", "--layout", "3x-imaginary"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3x-imaginary" in err[0] and "arcsplit layouts" in err[0], err


def test_layouts_lists_each_shipped_one_on_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layouts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(p.stem for p in LAYOUTS.glob("*.toml"))
    assert any("2 hosts" in line for line in lines if line.startswith("two-hosts"))


def test_the_wheel_maps_the_top_level_layouts_into_the_package() -> None:
    """The top-level layouts/ is the one copy: pyproject.toml maps it to arcsplit/data/layouts (tests/test_package.py
    builds the wheel), and its package list names every folder of arcsplit/, as `packages.find` would have."""
    root = LAYOUTS.parent
    tool = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert tool["package-dir"] == {"arcsplit.data.layouts": "layouts"}
    folders = {".".join(p.relative_to(root).parts) for p in [root / "arcsplit", *(root / "arcsplit").rglob("*")]
               if p.is_dir() and p.name != "__pycache__"}
    assert sorted(tool["packages"]) == sorted(folders | {"arcsplit.data.layouts"})
    assert not (root / "arcsplit" / "data" / "layouts").exists()  # a copy there would win over layouts/
