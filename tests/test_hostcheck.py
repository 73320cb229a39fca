"""Host checks: the pure judgements on recorded and composed sysfs/procfs texts, the gatherer on trees of our own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from arcsplit.llama import hostcheck as H
from arcsplit.llama.facts import CardFact

FX = Path(__file__).parent / "fixtures" / "runtime"
GiB = H.GiB
MiB = H.MiB


def resource(*sizes: int) -> str:
    """A sysfs PCI ``resource`` file with one region per size (the format of this_machine_pci_resource.txt)."""
    lines, base = [], 0x4000000000
    for n in sizes:
        lines.append(f"0x{base:016x} 0x{base + n - 1:016x} 0x000000000014220c" if n else "0x" + "0" * 16 + " 0x"
                     + "0" * 16 + " 0x" + "0" * 16)
        base += max(n, 1 << 20)
    return "\n".join(lines) + "\n"


def test_resource_parser_on_a_real_file():
    sizes = H.parse_resource((FX / "this_machine_pci_resource.txt").read_text())
    assert len(sizes) >= 6 and max(sizes) == 0x80000 and sizes.count(0) >= 5


def test_rebar_on_and_off():
    b70 = 32 * GiB
    on = H.rebar_check("card0", resource(16 * MiB, 0, 32 * GiB), b70)
    assert on.status == "ok" and "32.0 GiB" in on.detail
    off = H.rebar_check("card0", resource(16 * MiB, 0, 256 * MiB), b70)
    assert off.status == "warn" and "256 MiB" in off.detail and "Resizable BAR" in off.fix
    assert H.rebar_check("card0", resource(16 * MiB, 0, 256 * MiB)).status == "warn"  # memory unknown
    assert H.rebar_check("card0", resource(0, 0)).status == "skip"


def test_render_node_access():
    ok = H.groups_check([("/dev/dri/renderD128", True, "render")], ["render", "wheel"])
    assert ok.status == "ok" and "render" in ok.detail
    bad = H.groups_check([("/dev/dri/renderD128", False, "render"), ("/dev/dri/renderD129", True, "render")], ["wheel"])
    assert bad.status == "fail" and "renderD128" in bad.detail and "renderD129" not in bad.detail
    assert bad.fix.startswith("sudo usermod -aG render $USER")
    assert H.groups_check([], []).status == "skip"


def test_fdinfo_of_a_real_amdgpu_client():
    info = H.parse_fdinfo((FX / "fdinfo_amdgpu.txt").read_text())
    assert info["drm-pdev"] == "0000:08:00.0" and H.fdinfo_vram(info) == 2068 * 1024


def test_a_card_held_by_another_process_is_named():
    # xe's keys (drm-usage-stats.rst): drm-total-<region> and drm-resident-<region>, per memory region
    xe = ("drm-driver:\txe\ndrm-client-id:\t12\ndrm-pdev:\t0000:03:00.0\n"
          "drm-total-system:\t4 KiB\ndrm-total-vram0:\t20971520 KiB\ndrm-resident-vram0:\t20971520 KiB\n")
    amd = (FX / "fdinfo_amdgpu.txt").read_text()
    c = H.holders_check([(4242, "llama-server", xe), (7, "gnome-shell", amd)], ["0000:03:00.0", "0000:04:00.0"])
    assert c.status == "warn" and "pid 4242 llama-server on 0000:03:00.0 holds 20.0 GiB" in c.detail
    assert "gnome-shell" not in c.detail  # another card
    small = xe.replace("20971520 KiB", "2068 KiB")
    assert H.holders_check([(9, "Xorg", small)], ["0000:03:00.0"]).status == "ok"  # a display client, not a model


def test_ldd_missing_lines():
    text = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibsycl.so.8 => not found\n"
            "\tlibggml-base.so => /opt/b/bin/libggml-base.so (0x7f)\n\tlibmkl_sycl_blas.so.5 => not found\n")
    assert H.parse_ldd(text) == ["libsycl.so.8", "libmkl_sycl_blas.so.5"]


@pytest.mark.slow
def test_ldd_of_a_real_binary_without_its_libraries(llama_bins, tmp_path):
    if shutil.which("ldd") is None:
        pytest.skip("no ldd on this machine")
    alone = tmp_path / "llama-server"
    shutil.copy(llama_bins.server, alone)
    missing = H.parse_ldd(subprocess.run(["ldd", str(alone)], capture_output=True, text=True).stdout)
    assert any(m.startswith("libllama") for m in missing), missing


def test_oneapi_check():
    found = {"libsycl.so": "/opt/intel/oneapi/compiler/latest/lib/libsycl.so.8", "libze_loader.so.1": "/usr/lib/x",
             "libze_intel_gpu.so.1": "/usr/lib/y"}
    assert H.oneapi_check(found, None).status == "ok"
    c = H.oneapi_check({**found, "libsycl.so": None}, "/opt/intel/oneapi/setvars.sh")
    assert c.status == "fail" and "libsycl.so" in c.detail and c.fix.startswith("source /opt/intel/oneapi/setvars.sh")
    c = H.oneapi_check(found, None, ["libmkl_sycl_blas.so.5"])
    assert c.status == "fail" and "libmkl_sycl_blas.so.5" in c.detail and "oneAPI" in c.fix


def test_ram_floor_and_the_load_guard():
    text = (FX / "this_machine_meminfo.txt").read_text()
    m = H.parse_meminfo(text)
    assert m["MemTotal"] > m["MemAvailable"] > 0
    total = m["MemTotal"]
    assert H.ram_floor(total, {}) == max(512 * MiB, min(12 * GiB, int(total * 0.4)))
    assert H.ram_floor(64 * GiB, {}) == 12 * GiB and H.ram_floor(1 * GiB, {}) == 512 * MiB
    assert H.low_memory(text, {H.RAM_ENV: "0"}) is None
    why = H.low_memory(text, {H.RAM_ENV: str(10 ** 9)})
    assert why and "host memory is running out" in why and "\n" not in why
    assert H.low_memory("MemTotal: 5 kB\n", {}) is None  # no MemAvailable: no reason to stop
    assert H.ram_check(text, "cpu", {}).status == "ok" and "stops" not in H.ram_check(text, "cpu", {}).detail
    assert H.ram_check(text, "sycl", {H.RAM_ENV: str(10 ** 9)}).status == "warn"
    assert H.guard_floor_applies("sycl", {}) and not H.guard_floor_applies("cpu", {})
    assert H.guard_floor_applies("cpu", {H.RAM_ENV: "100"})


def test_host_checks_on_a_tree_of_our_own(tmp_path):
    sysfs, proc, dev, root = (tmp_path / n for n in ("sys", "proc", "dev", "root"))
    d = sysfs / "class" / "drm" / "card0" / "device"
    d.mkdir(parents=True)
    (d / "resource").write_text(resource(16 * MiB, 0, 256 * MiB))
    proc.mkdir()
    shutil.copy(FX / "this_machine_meminfo.txt", proc / "meminfo")
    (dev / "dri").mkdir(parents=True)
    (root / "opt/intel/oneapi").mkdir(parents=True)
    (root / "opt/intel/oneapi/setvars.sh").touch()
    card = CardFact("card0", "8086:e223", "0000:03:00.0", "xe", "intel", None)
    checks = {c.name: c for c in H.host_checks("sycl", [card], sysfs=sysfs, proc=proc, dev=dev, root=root,
                                               environ={"LD_LIBRARY_PATH": ""})}
    assert checks["Resizable BAR"].status == "warn"
    assert checks["render nodes"].status == "skip"
    assert checks["cards in use"].status == "ok"
    assert checks["oneAPI runtime"].status == "fail" and "setvars.sh" in checks["oneAPI runtime"].fix
    assert checks["host RAM"].status in ("ok", "warn")
    assert checks["shared memory"].status == "warn" and "no /dev/shm" in checks["shared memory"].detail
    (dev / "shm").mkdir()  # a directory on this test's file system: its free space is statvfs's
    checks = {c.name: c for c in H.host_checks("sycl", [card], sysfs=sysfs, proc=proc, dev=dev, root=root,
                                               environ={})}
    free = os.statvfs(dev / "shm").f_bavail * os.statvfs(dev / "shm").f_frsize
    assert checks["shared memory"].status == ("ok" if free >= H.SHM_LINK_BYTES else "warn")
    assert "1 RPC link(s) on this host need 8 MiB" in checks["shared memory"].detail
    (root / "usr/lib").mkdir(parents=True)
    for lib in ("libsycl.so.8", "libze_loader.so.1", "libze_intel_gpu.so.1"):
        (root / "usr/lib" / lib).touch()
    checks = {c.name: c for c in H.host_checks("sycl", [card], sysfs=sysfs, proc=proc, dev=dev, root=root, environ={})}
    assert checks["oneAPI runtime"].status == "ok" and "/usr/lib/libsycl.so.8" in checks["oneAPI runtime"].detail
    only_ram = H.host_checks("cpu", [], sysfs=sysfs, proc=proc, dev=dev, root=root, environ={})
    assert [c.name for c in only_ram] == ["host RAM"]


def test_drm_clients_reads_fds_on_dri_nodes_only(tmp_path):
    proc = tmp_path / "proc"
    p = proc / "4242"
    (p / "fd").mkdir(parents=True)
    (p / "fdinfo").mkdir()
    (p / "comm").write_text("llama-server\n")
    os.symlink("/dev/dri/renderD128", p / "fd" / "5")
    os.symlink("/dev/null", p / "fd" / "0")
    (p / "fdinfo" / "5").write_text((FX / "fdinfo_amdgpu.txt").read_text())
    (p / "fdinfo" / "0").write_text("pos: 0\n")
    clients = H.drm_clients(proc, me=1)
    assert [(pid, name) for pid, name, _ in clients] == [(4242, "llama-server")]
    assert H.drm_clients(proc, me=4242) == []


@pytest.mark.slow
def test_a_load_that_would_run_the_host_out_of_memory_is_stopped(llama_bins, demo_model, tmp_path):
    """A real CPU serve with the floor set above this machine's RAM: the load stops with the reason, exit 1, and
    no process is left behind (the guard is SYCL's by default; ARCSPLIT_MIN_FREE_RAM_MIB turns it on anywhere)."""
    import sys

    import psutil

    from arcsplit.proc.ports import free_port

    port = free_port()
    env = {**os.environ, H.RAM_ENV: str(10 ** 9), "ARCSPLIT_STATE_DIR": str(tmp_path / "state"),
           "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt"), "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    r = subprocess.run([sys.executable, "-m", "arcsplit", "serve", str(demo_model), "--backend", "cpu", "--gpus", "0,1",
                        "--port", str(port), "--cpu-memory", "1024", "--no-bus"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "host memory is running out during the load" in last and "before the machine swaps" in last
    assert "Traceback" not in r.stderr
    assert "restart 1 in" not in r.stderr  # given up at once: a retry would swap again
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ARCSPLIT_STATE_DIR") == str(tmp_path / "state"):
                left.append(p.pid)
        except (psutil.Error, OSError):
            pass
    assert left == []


def test_a_small_dev_shm_warns_that_the_rpc_links_fall_back_to_tcp():
    two_cards = 2 * H.SHM_LINK_BYTES
    assert H.shm_check(64 * MiB, 2, {}).status == "ok"
    small = H.shm_check(two_cards - 1, 2, {})
    assert small.status == "warn" and "loopback TCP" in small.detail and small.fix and "--shm-size" in small.fix
    assert "2 RPC link(s) on this host need 16 MiB" in small.detail
    assert H.shm_check(None, 2, {}).status == "warn"
    off = H.shm_check(0, 2, {H.SHM_ENV: "0"})
    assert off.status == "skip" and "ARCSPLIT_RPC_SHM=0" in off.detail
