"""Fact parsers on verbatim tool output (tests/fixtures/runtime/SOURCES.md names each file's source)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from arcsplit.errors import BadInput
from arcsplit.llama import facts as F
from arcsplit.llama.locate import parse_version

FX = Path(__file__).parent / "fixtures" / "runtime"


def read(name: str) -> str:
    return (FX / name).read_text()


@pytest.mark.parametrize("text, build, release", [
    ("1.15.38308+1", 38308, None),            # sycl-ls L0 driver string (sycl_ls_b70_fedora44.txt)
    ("1.14.37020", 37020, None),              # older sycl-ls form
    ("1.14.37020+3", 37020, None),            # dpctl, IntelPython/dpnp#2800
    ("1.3.30049.600000", 30049, None),        # sycl-ls --verbose Driver (A770)
    ("1.6.33578+15", 33578, None),            # 25.18 style
    ("OpenCL 3.0 NEO  [26.18.38308.1]", 38308, "26.18.38308.1"),
    ("26.27.39122.12-1~26.04~ppa1", 39122, "26.27.39122.12"),   # kobuk PPA deb version
    ("22.05.22297", 22297, "22.05.22297"),    # dpctl GPU OpenCL, numba-dpex#700
    ("libze_intel_gpu.so.1.15.38308", 38308, None),  # readlink -f of the soname
])
def test_neo_version_forms(text, build, release):
    v = F.parse_neo_version(text, "t")
    assert v is not None and v.build == build and v.release == release


@pytest.mark.parametrize("text", ["1.28.2", "2026.0.0", "2026.21.3.0.31_160000", "20.2.0", "OpenCL 3.0 (Build 0)"])
def test_non_neo_versions_are_not_neo(text):
    # the L0 loader, oneAPI and the CPU OpenCL runtime must never be read as NEO
    assert F.parse_neo_version(text, "t") is None


def test_sycl_ls_concise_b70():
    devs = F.parse_sycl_ls(read("sycl_ls_b70_fedora44.txt"))
    assert [(d.backend, d.type, d.index) for d in devs] == [("level_zero", "gpu", 0), ("opencl", "cpu", 0), ("opencl", "gpu", 1)]
    l0 = devs[0]
    assert l0.name == "Intel(R) Arc(TM) Pro B70 Graphics" and l0.version == "20.2.0" and l0.driver == "1.15.38308+1"
    assert l0.platform == "Intel(R) oneAPI Unified Runtime over Level-Zero V2"
    assert devs[2].name == "Intel(R) Arc(TM) Pro B70 Graphics" and devs[2].driver == "26.18.38308.1"
    readings = F.neo_from_sycl(devs, "sycl-ls")
    # the CPU OpenCL runtime (2026.21.3.0.31) is skipped; both GPU lines agree on the build
    assert [r.build for r in readings] == [38308, 38308]
    assert readings[1].release == "26.18.38308.1"


def test_sycl_ls_b390_and_old_and_filtered():
    b390 = F.parse_sycl_ls(read("sycl_ls_b390_fedora43.txt"))
    assert b390[0].version == "30.0.4" and b390[0].driver == "1.15.38308+4"
    old = F.parse_sycl_ls(read("sycl_ls_old_neo_b70.txt"))
    assert old[0].name == "Intel(R) Graphics [0xe223]" and F.neo_from_sycl(old, "s")[0].build == 37020
    filtered = F.parse_sycl_ls(read("sycl_ls_filtered.txt"))
    assert len(filtered) == 1 and filtered[0].index is None and filtered[0].driver == "1.15.38308+1"


def test_sycl_ls_verbose_block():
    devs = F.parse_sycl_ls(read("sycl_ls_verbose_a770.txt"))
    assert len(devs) == 1
    d = devs[0]
    assert (d.backend, d.type, d.name, d.version, d.driver) == (
        "level_zero", "gpu", "Intel(R) Arc(TM) A770 Graphics", "12.55.8", "1.3.30049.600000")
    assert F.neo_from_sycl(devs, "s")[0].build == 30049


def test_ggml_sycl_device_table():
    rows = F.parse_ggml_sycl_table(read("ggml_sycl_init_b50.txt"))
    assert len(rows) == 1  # the "Optimization Feature" table is not a device table
    r = rows[0]
    assert (r.backend, r.type, r.index, r.name, r.version, r.driver) == (
        "level_zero", "gpu", 0, "Intel Arc Pro B50 Graphics", "20.1", "1.15.37833+4")
    # a llama-server log prefix ("[53193] ") does not hide the row
    prefixed = "\n".join("[53193] " + l for l in read("ggml_sycl_init_b50.txt").splitlines())
    assert F.parse_ggml_sycl_table(prefixed)[0].driver == "1.15.37833+4"


def test_clinfo():
    assert [v.release for v in F.parse_clinfo(read("clinfo_neo_23.35.txt"))] == ["23.35.27191.42"]
    assert F.parse_clinfo(read("clinfo_list.txt")) == []  # `clinfo -l` carries no version


def test_dpctl_only_gpu_platforms_count():
    readings = F.parse_dpctl(read("dpctl_numba_dpex_700.txt"))
    # FPGA emulation and the CPU runtime (2021.13.11.0.23) are not NEO; the HD Graphics platform is
    assert [(r.build, r.release) for r in readings] == [(22297, "22.05.22297")]
    # IntelPython/dpnp#2800: the same NEO under the L0 platform and under OpenCL Graphics
    l0 = "Platform  0 ::\n    Name        Intel(R) Level-Zero\n    Backend     level_zero\n      # 0\n        Version     1.14.37020+3\n"
    assert F.parse_dpctl(l0)[0].build == 37020


def test_packages_each_distro():
    # version strings as the kobuk-team PPA and Intel's GitHub debs publish them; line layout = the query arcsplit runs
    dpkg = "libze-intel-gpu1\t26.27.39122.12-1~26.04~ppa1\nlibze1\t1.28.2-1\nintel-opencl-icd\t26.27.39122.11-0\n"
    pk = F.parse_packages(dpkg)
    assert [v.release for v in F.neo_from_packages(pk, "dpkg")] == ["26.27.39122.12", "26.27.39122.11"]
    assert F.loader_from_packages(pk) == "1.28.2"
    rpm = "intel-level-zero\t24.35.30872.24-1.fc42\n"
    assert F.neo_from_packages(F.parse_packages(rpm), "rpm")[0].build == 30872
    suse = "libze_intel_gpu1\t26.09.37435.1-2.4\n"
    assert F.neo_from_packages(F.parse_packages(suse), "rpm")[0].release == "26.09.37435.1"
    legacy = "intel-level-zero-gpu\t1.3.30049.10-950~24.04\n"
    assert F.neo_from_packages(F.parse_packages(legacy), "dpkg")[0].build == 30049
    # recorded here: no Intel packages installed -> dpkg-query's complaints parse to nothing
    assert F.parse_packages(read("this_machine_dpkg_query.txt")) == {}


def test_uevent():
    ue = F.parse_uevent(read("uevent_b70.txt"))
    assert ue == {"DRIVER": "xe", "PCI_ID": "8086:E223", "PCI_SLOT_NAME": "0000:03:00.0"}


@pytest.mark.parametrize("release, version", [
    ("6.19.10-300.fc44.x86_64", (6, 19, 10)), ("7.0.4-200.fc44.x86_64", (7, 0, 4)), ("7.0.0-10-generic", (7, 0, 0)),
    ("7.1-rc1", (7, 1)), ("6.17.0-35-generic", (6, 17, 0)), ("junk", None),
])
def test_kernel_release(release, version):
    assert F.parse_kernel_release(release) == version


def test_kernel_config_this_machine():
    # recorded on the dev machine: the DMABUF section of /proc/config.gz says the option is off
    assert F.parse_kernel_config(read("this_machine_kernel_config_dmabuf.txt")) is False
    assert F.parse_kernel_config("CONFIG_DMABUF_MOVE_NOTIFY=y\n") is True
    assert F.parse_kernel_config("CONFIG_DMA_SHARED_BUFFER=y\n") is None  # not mentioned: unknown, not "off"
    assert F.parse_kernel_release(read("this_machine_uname_r.txt")) is not None


def test_llama_version_of_this_build_reaches_the_facts():
    info = parse_version(read("this_machine_llama_server_version.txt"))
    f = F.gather_facts("cpu", info, kernel="6.19.10-300.fc44.x86_64", sysfs_root="/nonexistent")
    assert f.llama_build is not None and "GNU" in f.llama_build


def make_card(root: Path, name: str, uevent: str | None, vendor: str | None = None, device: str | None = None) -> None:
    dev = root / "class" / "drm" / name / "device"
    dev.mkdir(parents=True)
    if uevent is not None:
        (dev / "uevent").write_text(uevent)
    if vendor:
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "device").write_text(device + "\n")


def test_discover_cards_fake_sysfs(tmp_path):
    make_card(tmp_path, "card0", read("uevent_b70.txt"))
    make_card(tmp_path, "card1", "DRIVER=i915\nPCI_ID=8086:A780\nPCI_SLOT_NAME=0000:00:02.0\n")  # iGPU
    make_card(tmp_path, "card2", None, "0x8086", "0xe223")  # no uevent: vendor/device files
    make_card(tmp_path, "card10", "DRIVER=xe\nPCI_ID=8086:E20B\nPCI_SLOT_NAME=0000:05:00.0\n")
    (tmp_path / "class" / "drm" / "card0-DP-1").mkdir()  # a connector, not a card
    (tmp_path / "class" / "drm" / "renderD128").mkdir()
    cards, why = F.discover_cards(tmp_path)
    assert why is None
    assert [c.drm for c in cards] == ["card0", "card1", "card2", "card10"]
    assert cards[0].pci_id == "8086:e223" and cards[0].driver == "xe" and "B70" in cards[0].name
    assert cards[1].name is None and cards[1].vendor == "intel"
    assert cards[2].pci_id == "8086:e223" and cards[2].driver is None
    assert "B580" in cards[3].name


def test_discover_cards_missing_sysfs(tmp_path):
    cards, why = F.discover_cards(tmp_path)
    assert cards == [] and "does not exist" in why


def test_gather_from_bug_report_files(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text("# CONFIG_DMABUF_MOVE_NOTIFY is not set\n")
    f = F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", "6.19.10-300.fc44.x86_64", cfg,
                       sysfs_root=tmp_path)
    assert f.neo.build == 38308 and f.neo.release == "26.18.38308.1"  # L0 reading completed by the OpenCL one
    assert f.kernel.version == (6, 19, 10) and f.kernel.move_notify is False
    assert f.oneapi is None  # this machine's oneAPI is not the reporter's


def test_gather_kernel_without_config_does_not_read_this_machine(tmp_path):
    f = F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", "6.19.10-300.fc44.x86_64", None, sysfs_root=tmp_path)
    assert f.kernel.move_notify is None and any("--kernel-config" in u for u in f.unread)


def test_gather_bad_files(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        F.gather_facts("sycl", None, tmp_path / "nope.txt")
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    with pytest.raises(BadInput, match="no sycl-ls device lines"):
        F.gather_facts("sycl", None, junk)
    with pytest.raises(BadInput, match="not a kernel version"):
        F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", "banana")


def _bare_machine(monkeypatch, root: Path) -> None:
    """This process sees ``root`` as the machine: no tools on PATH, no library or oneAPI variables."""
    monkeypatch.setenv("PATH", str(root / "bin"))
    for var in ("LD_LIBRARY_PATH", "CMPLR_ROOT", "ONEAPI_ROOT"):
        monkeypatch.delenv(var, raising=False)


def test_gather_live_tolerates_missing_tools(monkeypatch, tmp_path):
    # a machine with no sycl-ls, clinfo, Intel packages, libraries, kernel config or DRM cards (whatever the
    # host running the test has): every gap is named, nothing raises
    _bare_machine(monkeypatch, tmp_path)
    f = F.gather_facts("sycl", None, sysfs_root=tmp_path / "sys", host_root=tmp_path)
    joined = " | ".join(f.unread)
    assert f.neo is None and f.oneapi is None and f.kernel.move_notify is None
    for src in ("sycl-ls", "libze_intel_gpu.so.1", "packages", "clinfo", "NEO version", "cards", "kernel config"):
        assert src in joined
    assert f.kernel.release  # uname works without any tool


def test_gather_live_reads_the_machine_it_is_given(monkeypatch, tmp_path):
    # the same gathering on a tree laid out like an Intel machine: NEO from the soname, the loader, oneAPI, the
    # kernel config and the card, all from under host_root and sysfs_root
    _bare_machine(monkeypatch, tmp_path)
    lib = tmp_path / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libze_intel_gpu.so.1.15.38308").write_bytes(b"")
    (lib / "libze_intel_gpu.so.1").symlink_to("libze_intel_gpu.so.1.15.38308")
    (lib / "libze_loader.so.1.28.2").write_bytes(b"")
    (lib / "libze_loader.so.1").symlink_to("libze_loader.so.1.28.2")
    compiler = tmp_path / "opt/intel/oneapi/compiler"
    (compiler / "2026.0").mkdir(parents=True)
    (compiler / "latest").symlink_to("2026.0")
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / f"config-{platform.release()}").write_text("# CONFIG_DMABUF_MOVE_NOTIFY is not set\n")
    make_card(tmp_path / "sys", "card0", read("uevent_b70.txt"))
    f = F.gather_facts("sycl", None, sysfs_root=tmp_path / "sys", host_root=tmp_path)
    assert f.neo is not None and f.neo.build == 38308 and "libze_intel_gpu" in f.neo.source
    assert f.level_zero_loader == "1.28.2" and f.oneapi == "2026.0"
    assert f.kernel.move_notify is False and f.kernel.config_source == f"/boot/config-{platform.release()}"
    assert [c.pci_id for c in f.cards] == ["8086:e223"]
    assert not any(u.startswith(("libze_intel_gpu", "kernel config", "oneAPI", "cards")) for u in f.unread)


def test_a_kernel_named_by_hand_never_reads_this_machines_config(monkeypatch, tmp_path):
    # on the reporter's own machine (same kernel as the report) the report still decides, not /boot
    _bare_machine(monkeypatch, tmp_path)
    (tmp_path / "boot").mkdir()
    (tmp_path / "boot" / f"config-{platform.release()}").write_text("CONFIG_DMABUF_MOVE_NOTIFY=y\n")
    f = F.gather_facts("cpu", None, kernel=platform.release(), sysfs_root=None, host_root=tmp_path)
    assert f.kernel.move_notify is None and any("--kernel-config" in u for u in f.unread)


def _modinfo_F(fixture: str, field: str) -> str:
    """What ``modinfo -F FIELD`` prints for a module whose ``modinfo`` listing is the fixture: the value alone."""
    for line in (FX / fixture).read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return value.strip() + "\n"
    raise AssertionError(f"{fixture} has no {field}")


def test_xe_module_in_tree_or_dkms(tmp_path, monkeypatch):
    """The running xe module from sysfs, and DKMS's install path (updates/dkms) as the out-of-tree signal
    (intel-gpu/xekmd-backports#451 ships the 7.1 xe driver that way for older kernels). The module paths are
    verbatim `modinfo xe` output (SOURCES.md); the sysfs version/srcversion values are composed: no public
    reading of /sys/module/xe/{version,srcversion} was found."""
    from arcsplit.llama.facts import parse_xe_module, xe_module_facts

    in_tree = _modinfo_F("modinfo_xe_in_tree_926.txt", "filename")
    dkms = _modinfo_F("modinfo_xe_dkms_truenas.txt", "filename")
    assert parse_xe_module(None, "8F1C0D5E2A0B\n", in_tree) == ("srcversion 8F1C0D5E2A0B", False)
    assert parse_xe_module("7.1.4.25\n", "X", dkms) == ("version 7.1.4.25", True)
    assert parse_xe_module(None, None, None) == (None, None)
    assert xe_module_facts(tmp_path) == (None, None)  # xe not loaded

    # the reader itself: sysfs in tmp, and a modinfo on PATH answering -F filename as the real one does
    (tmp_path / "module" / "xe").mkdir(parents=True)
    (tmp_path / "module" / "xe" / "srcversion").write_text("8F1C0D5E2A0B\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for answer, backport in ((dkms, True), (in_tree, False)):
        modinfo = bin_dir / "modinfo"
        modinfo.write_text(f"#!/bin/sh\n[ \"$1 $2 $3\" = \"-F filename xe\" ] || exit 1\nprintf '%s' '{answer}'\n")
        modinfo.chmod(0o755)
        assert xe_module_facts(tmp_path) == ("srcversion 8F1C0D5E2A0B", backport)
