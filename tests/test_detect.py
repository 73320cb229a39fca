"""``--backend auto``: the pure choice, the gatherer on recorded sysfs trees, and the headline command on a simulated
Arc machine (recorded sysfs, sycl-ls and llama-server outputs; no Intel card)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from arcsplit import synth
from arcsplit.cli import main
from arcsplit.errors import BadInput
from arcsplit.llama import detect as D
from arcsplit.llama.build import TARGETS, BuildConfig
from arcsplit.llama.facts import CardFact

FX = Path(__file__).parent / "fixtures" / "runtime"
B70 = (FX / "uevent_b70.txt").read_text()
B70_2 = B70.replace("0000:03:00.0", "0000:04:00.0")
IGPU = "DRIVER=i915\nPCI_ID=8086:A780\nPCI_SLOT_NAME=0000:00:02.0\n"
RTX = "DRIVER=nvidia\nPCI_ID=10DE:2684\nPCI_SLOT_NAME=0000:01:00.0\n"


def card(pci: str, slot: str) -> CardFact:
    vendor = {"8086": "intel", "10de": "nvidia", "1002": "amd"}[pci[:4]]
    return CardFact("card0", pci, slot, "xe", vendor, None)


ARC2 = (card("8086:e223", "0000:03:00.0"), card("8086:e223", "0000:04:00.0"))


def test_two_arc_cards_and_a_sycl_build_pick_sycl_and_say_why():
    c = D.decide(D.DetectFacts(ARC2, ("sycl", "vulkan")))
    assert c.backend == "sycl"
    assert c.reason == "backend sycl: 2 Intel cards (8086:e223) and a SYCL build"
    assert any("vulkan" in n for n in c.notes)  # the other route is named


def test_arc_cards_with_only_a_vulkan_build_pick_vulkan():
    c = D.decide(D.DetectFacts(ARC2, ("vulkan",)))
    assert c.backend == "vulkan" and "Vulkan build" in c.reason


def test_arc_cards_without_a_build_is_one_line_naming_both_builds():
    with pytest.raises(BadInput) as e:
        D.decide(D.DetectFacts(ARC2, ()))
    text = str(e.value)
    assert "\n" not in text and "2 Intel cards" in text
    assert "arcsplit llama build --backend sycl" in text and "oneAPI" in text
    assert "arcsplit llama build --backend vulkan" in text and "--backend cpu" in text


def test_sycl_ls_seeing_no_level_zero_gpu_moves_to_the_vulkan_build():
    c = D.decide(D.DetectFacts(ARC2, ("sycl", "vulkan"), sycl_gpus=0))
    assert c.backend == "vulkan" and any("Level Zero" in n for n in c.notes)
    # without another build, SYCL stays (doctor says more), rather than refusing to try
    assert D.decide(D.DetectFacts(ARC2, ("sycl",), sycl_gpus=0)).backend == "sycl"


def test_no_gpu_or_only_an_igpu_is_cpu_with_a_note():
    c = D.decide(D.DetectFacts((), ("sycl",)))
    assert c.backend == "cpu" and "no GPU" in c.reason
    c = D.decide(D.DetectFacts((card("8086:a780", "0000:00:02.0"),), ("sycl",)))
    assert c.backend == "cpu" and "integrated" in c.reason and "--backend sycl" in c.reason


def test_igpu_beside_arc_cards_is_not_counted():
    c = D.decide(D.DetectFacts((card("8086:a780", "0000:00:02.0"), *ARC2), ("sycl",)))
    assert c.reason.startswith("backend sycl: 2 Intel cards (8086:e223)")


def test_other_vendors():
    nv = (card("10de:2684", "0000:01:00.0"),)
    assert D.decide(D.DetectFacts(nv, ("cuda", "vulkan"))).backend == "cuda"
    assert D.decide(D.DetectFacts(nv, ("vulkan", "sycl"))).backend == "vulkan"
    # Intel and NVIDIA in one group: only Vulkan drives both
    assert D.decide(D.DetectFacts((*ARC2, *nv), ("sycl", "cuda", "vulkan"))).backend == "vulkan"
    with pytest.raises(BadInput, match="Vulkan"):
        D.decide(D.DetectFacts((*ARC2, *nv), ("sycl", "cuda")))


def test_no_sysfs_but_sycl_ls_sees_level_zero_gpus():
    c = D.decide(D.DetectFacts((), ("sycl",), sycl_gpus=2))
    assert c.backend == "sycl" and "2 Intel cards" in c.reason


def test_build_purpose_names_the_missing_toolchains():
    assert D.decide(D.DetectFacts(ARC2, ("vulkan",)), "build").reason.endswith("a Vulkan toolchain")
    with pytest.raises(BadInput) as e:
        D.decide(D.DetectFacts(ARC2, ()), "build")
    assert "icpx (sycl)" in str(e.value) and "glslc (vulkan)" in str(e.value) and "setvars.sh" in str(e.value)
    assert D.decide(D.DetectFacts(ARC2, ()), "check").backend == "sycl"  # doctor: diagnose without a build


def test_build_backends_from_the_libraries_of_a_build_dir(tmp_path):
    (tmp_path / "bin").mkdir()
    assert D.build_backends(tmp_path / "bin") == ()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libggml-vulkan.so").touch()
    (tmp_path / "bin" / "libggml-sycl.so").touch()
    assert D.build_backends(tmp_path / "bin") == ("sycl", "vulkan")


def sysfs(root: Path, cards: dict[str, str]) -> Path:
    for name, uevent in cards.items():
        dev = root / "class" / "drm" / name / "device"
        dev.mkdir(parents=True)
        (dev / "uevent").write_text(uevent)
    return root


def test_gather_reads_sysfs_and_sycl_ls(tmp_path, monkeypatch):
    root = sysfs(tmp_path / "sys", {"card0": B70, "card1": IGPU, "card2": B70_2})
    ran = []

    def run(argv):
        ran.append(argv)
        return (FX / "sycl_ls_b70_fedora44.txt").read_text(), ""

    f = D.gather("run", sysfs_root=root, run=run, managed=lambda: ("sycl",), environ={"PATH": str(tmp_path)})
    assert [c.drm for c in f.cards] == ["card0", "card1", "card2"] and f.usable == ("sycl",)
    assert ran == [["sycl-ls"]] and f.sycl_gpus == 1  # that report's machine had one B70 in Level Zero
    # no SYCL build: sycl-ls would not change the choice, so it is not run
    ran.clear()
    D.gather("run", sysfs_root=root, run=run, managed=lambda: ("vulkan",), environ={"PATH": str(tmp_path)})
    assert ran == []


def test_a_located_build_decides_over_managed_ones(tmp_path):
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "llama-server").touch()
    (tmp_path / "own" / "libggml-vulkan.so").touch()
    root = sysfs(tmp_path / "sys", {"card0": B70})
    f = D.gather("run", llama_dir=str(tmp_path / "own"), sysfs_root=root, managed=lambda: ("sycl",),
                 environ={"PATH": ""})
    assert f.usable == ("vulkan",)
    f = D.gather("run", sysfs_root=root, managed=lambda: ("sycl",),
                 environ={"PATH": "", "ARCSPLIT_LLAMA_DIR": str(tmp_path / "own")})
    assert f.usable == ("vulkan",)


# ---------------------------------------------------------------------------------------------------------------
# The simulated Arc machine: 2x Arc Pro B70 in sysfs (+ an iGPU), sycl-ls on PATH, a managed SYCL build whose
# llama-server prints what a real one printed on such a machine. Everything but the cards is arcsplit's real code.


def _script(path: Path, outputs: dict[str, Path]) -> None:
    table = {k: str(v) for k, v in outputs.items()}
    path.write_text(f"#!{sys.executable}\nimport sys\ntable = {table!r}\n"
                    "arg = sys.argv[1] if len(sys.argv) > 1 else ''\n"
                    "sys.stdout.write(open(table[arg]).read() if arg in table else '')\n")
    path.chmod(0o755)


@pytest.fixture
def arc_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "SYSFS_ROOT", str(sysfs(tmp_path / "sys", {"card0": B70, "card1": IGPU, "card2": B70_2})))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ARCSPLIT_LLAMA_DIR", raising=False)
    monkeypatch.delenv(D.ENV, raising=False)  # conftest pins cpu for the rest of the suite
    tools = tmp_path / "tools"
    tools.mkdir()
    _script(tools / "sycl-ls", {"": FX / "sycl_ls_b70_fedora44.txt"})
    monkeypatch.setenv("PATH", str(tools))  # no llama-server of the host's
    bin_dir = BuildConfig("sycl").bin_dir
    bin_dir.mkdir(parents=True)
    for t in TARGETS:
        _script(bin_dir / t, {"--list-devices": FX / "list_devices_2x_b70.txt",
                              "--version": FX / "llama_server_version_sycl.txt"})
    return tmp_path


def test_devices_without_a_flag_lists_the_arc_cards(arc_machine, capsys):
    assert main(["devices", "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["backend"] == "sycl" and [c["device"] for c in data["cards"]] == ["SYCL0", "SYCL1"]
    assert "arcsplit: backend sycl: 2 Intel cards (8086:e223) and a SYCL build" in err


def test_plan_without_a_flag_plans_for_the_arc_cards(arc_machine, capsys):
    model = synth.write_llama(arc_machine / "m.gguf")
    assert main(["plan", str(model), "--gpus", "0,1", "--json"]) == 0
    out, err = capsys.readouterr()
    planned = json.loads(out)
    assert [c["backend"] for c in planned["cards"]] == ["sycl", "sycl"] and planned["cards"][0]["device"] == "SYCL0"
    # the mode serve would pick here: this runtime's verdict says one context over both cards fails -> hybrid
    assert planned["mode"] == "hybrid" and planned["cards"][1]["device"] == "RPC0"
    assert "backend sycl" in err


def test_the_headline_command_resolves_to_sycl_before_starting_anything(arc_machine, capsys, monkeypatch):
    """`arcsplit serve model.gguf --gpus 0,1` with no --backend: the config handed to the runner is SYCL.
    (--mode hybrid: mode auto would probe one multi-device context, which needs the cards.)"""
    from arcsplit.cli import serve_run as serve_cli
    from arcsplit.proc.ports import free_port

    seen = []

    async def runner(prepared, args):
        seen.append(prepared)
        return 0

    monkeypatch.setattr(serve_cli, "_run", runner)
    model = synth.write_llama(arc_machine / "m.gguf")
    assert main(["serve", str(model), "--gpus", "0,1", "--mode", "hybrid", "--port", str(free_port())]) == 0
    cfg = seen[0].config
    assert cfg.backend == "sycl" and cfg.mode == "hybrid"
    assert Path(cfg.server_bin).parent == BuildConfig("sycl").bin_dir
    assert "backend sycl: 2 Intel cards (8086:e223) and a SYCL build" in capsys.readouterr().err


def test_an_arc_machine_without_a_build_says_what_to_build(arc_machine, capsys):
    import shutil

    shutil.rmtree(BuildConfig("sycl").build_dir)
    model = synth.write_llama(arc_machine / "m.gguf")
    assert main(["serve", str(model), "--gpus", "0,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "arcsplit llama build --backend sycl" in err and "Traceback" not in err


def test_arcsplit_backend_pins_what_auto_means(arc_machine, monkeypatch, capsys):
    monkeypatch.setenv(D.ENV, "cpu")
    assert main(["devices", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "cpu"
    assert main(["doctor", "--no-probe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "cpu"
    monkeypatch.setenv(D.ENV, "rocm")
    assert main(["devices"]) == 2 and "ARCSPLIT_BACKEND" in capsys.readouterr().err


def test_llama_build_on_the_arc_machine_names_the_missing_toolchains_before_anything(arc_machine, capsys):
    from arcsplit.llama.source import llama_root

    before = sorted(p.name for p in llama_root().iterdir())
    assert main(["llama", "build"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "icpx (sycl)" in err and "glslc (vulkan)" in err
    assert sorted(p.name for p in llama_root().iterdir()) == before  # nothing fetched, nothing compiled


@pytest.mark.slow  # about 2 s: the doctor runs the simulated machine's tools
def test_doctor_on_the_arc_machine_shows_the_choice_and_the_host_checks(arc_machine, capsys):
    from test_hostcheck import resource

    drm = Path(D.SYSFS_ROOT) / "class" / "drm"
    (drm / "card0" / "device" / "resource").write_text(resource(16 * 2**20, 0, 32 * 2**30))
    (drm / "card2" / "device" / "resource").write_text(resource(16 * 2**20, 0, 256 * 2**20))
    assert main(["doctor", "--no-probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "sycl" and data["detected"]["reason"].startswith("backend sycl: 2 Intel cards")
    assert data["facts"]["llama_build"].startswith("build 10068")  # the SYCL build's own --version
    rebar = [c for c in data["host"] if c["name"] == "Resizable BAR"]
    assert [c["status"] for c in rebar] == ["ok", "warn"] and "card2" in rebar[1]["detail"]
    assert {c["name"] for c in data["host"]} >= {"render nodes", "cards in use", "oneAPI runtime", "host RAM"}
    assert main(["doctor", "--no-probe"]) == 0
    text = capsys.readouterr().out
    assert "auto: backend sycl" in text and "Host" in text and "Resizable BAR" in text and "WARN" in text


def test_doctor_for_sycl_on_a_machine_whose_cards_cannot_be_listed_reports_it(arc_machine, capsys, monkeypatch):
    """No SYCL build to list the cards with: the doctor says so in its findings (both forms) instead of crashing."""
    import shutil as sh

    sh.rmtree(BuildConfig("sycl").bin_dir)
    assert main(["doctor", "--backend", "sycl", "--no-probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(u.startswith("cards: ") for u in data["facts"]["unread"])
    assert main(["doctor", "--backend", "sycl", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "could not read:" in out and "    - cards: " in out


def test_the_cpu_demo_stays_explicit(arc_machine, monkeypatch):
    from arcsplit.cli import demo, serve as serve_cli

    seen = []
    monkeypatch.setattr(demo, "ensure_demo_model", lambda: arc_machine / "m.gguf")
    monkeypatch.setattr(demo, "_ensure_cpu_build", lambda: None)  # this machine has only a SYCL build
    monkeypatch.setattr(serve_cli, "serve_from_args", lambda ns, demo=False: seen.append(ns.backend) or 0)
    assert main(["demo"]) == 0 and seen == ["cpu"]


# ---------------------------------------------------------------------------------------------------------------
# Vulkan as a route on Arc: when SYCL's one context is broken, a Vulkan context that probed fine ranks before hybrid.


@pytest.fixture
def broken_sycl(tmp_path):
    """The runtime report of the ggml-org/llama.cpp#22885 machine, from its bug report's files."""
    from arcsplit.llama.runtime import check_runtime

    cfg = tmp_path / "config"
    cfg.write_text("# CONFIG_DMABUF_MOVE_NOTIFY is not set\n")
    return check_runtime("sycl", [0, 1], None, probe=False, sycl_ls_file=FX / "sycl_ls_b70_fedora44.txt",
                         kernel="6.19.10-300.fc44.x86_64", kernel_config=cfg)


def test_a_vulkan_context_that_probed_fine_ranks_before_hybrid(broken_sycl):
    from arcsplit.cli.doctor import remedies

    assert broken_sycl.multi_broken
    def where(fixes, word):
        return next(i for i, f in enumerate(fixes) if f["title"].startswith(word))

    fixes = remedies(broken_sycl, "works")
    vk, hybrid = where(fixes, "Vulkan"), where(fixes, "Hybrid")
    assert vk == hybrid - 1 and "debug keys" in fixes[vk - 1]["title"]  # after NEO's own fixes, before hybrid
    assert fixes[vk]["command"] == "arcsplit serve model.gguf --gpus 0,1 --backend vulkan --mode multi"
    assert "#26010" in fixes[vk]["title"]  # the trade is stated, not hidden
    for state, command in (("built", "arcsplit serve model.gguf --gpus 0,1 --backend vulkan"),
                           ("fails", "arcsplit serve model.gguf --gpus 0,1 --backend vulkan"),
                           (None, "arcsplit llama build --backend vulkan && arcsplit serve")):
        fixes = remedies(broken_sycl, state)
        assert where(fixes, "Vulkan") == len(fixes) - 1 > where(fixes, "Hybrid")
        assert fixes[-1]["command"].startswith(command)
    assert "failed here too" in remedies(broken_sycl, "fails")[-1]["title"]


def test_doctor_names_a_present_vulkan_build_without_probing_another_machine(arc_machine, capsys):
    bin_dir = BuildConfig("vulkan").bin_dir
    bin_dir.mkdir(parents=True)
    for t in TARGETS:
        _script(bin_dir / t, {})
    cfg = arc_machine / "config"
    cfg.write_text("# CONFIG_DMABUF_MOVE_NOTIFY is not set\n")
    assert main(["doctor", "--gpus", "0,1", "--sycl-ls", str(FX / "sycl_ls_b70_fedora44.txt"), "--kernel",
                 "6.19.10-300.fc44.x86_64", "--kernel-config", str(cfg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vulkan"] == {"route": "built", "probe": None}
    assert data["remedies"][-1]["command"] == "arcsplit serve model.gguf --gpus 0,1 --backend vulkan"
