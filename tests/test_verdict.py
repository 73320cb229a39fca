"""The version rule: NEO build x kernel x CONFIG_DMABUF_MOVE_NOTIFY -> good / bad / unknown, with sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from arcsplit.errors import ArcsplitError
from arcsplit.llama import facts as F
from arcsplit.llama.verdict import judge, known_rules, parse_rules, verdict_for

FX = Path(__file__).parent / "fixtures" / "runtime"
FEDORA = "6.19.10-300.fc44.x86_64"


@pytest.mark.parametrize("backend, neo, kernel, notify, status, rule", [
    # ggml-org/llama.cpp#22885: Fedora 44, NEO 26.09.37435.12, 26.05.37020.3 and 26.14 all fail
    ("sycl", 37435, FEDORA, False, "bad", "neo-26.05-multi-device-alloc"),
    ("sycl", 37020, "7.0.4-200.fc44.x86_64", False, "bad", "neo-26.05-multi-device-alloc"),
    ("sycl", 37833, FEDORA, False, "bad", "neo-26.05-multi-device-alloc"),
    ("sycl", 38308, "6.17.0-35-generic", False, "bad", "neo-26.05-multi-device-alloc"),
    # Intel (#916): fixed by the kernel, v7.1-rc1 and later
    ("sycl", 37435, "7.1-rc1", False, "good", "neo-26.05-kernel-fixed"),
    ("sycl", 38646, "7.2.3-100.fc45.x86_64", None, "good", "neo-26.05-kernel-fixed"),
    ("sycl", 37020, "6.19.10", True, "good", "neo-26.05-move-notify-on"),
    # Ubuntu 26.04 kernels reported fine (PMZFX: 7.0.0-10 + NEO 26.09)
    ("sycl", 37435, "7.0.0-10-generic", None, "good", "neo-26.05-ubuntu-26.04"),
    # config unreadable on an old kernel: the probe decides
    ("sycl", 37435, FEDORA, None, "unknown", "neo-26.05-kernel-config-unread"),
    ("sycl", 37435, None, None, "unknown", "neo-26.05-kernel-config-unread"),
    # before the regression
    ("sycl", 35563, FEDORA, False, "good", "neo-25.40-or-older"),
    ("sycl", 30049, FEDORA, False, "good", "neo-25.40-or-older"),
    ("sycl", 36000, FEDORA, False, "unknown", "neo-25.44-26.01"),
    ("sycl", 37019, FEDORA, False, "unknown", "neo-25.44-26.01"),
    # 26.27.39122 segfaults everywhere, whatever the kernel (#971/#972)
    ("sycl", 39122, "7.2", True, "bad", "neo-26.27-segv"),
    ("sycl", None, FEDORA, False, "unknown", "neo-unread"),
    ("cuda", None, FEDORA, None, "good", "no-known-bug"),
    ("vulkan", 37435, FEDORA, False, "good", "no-known-bug"),  # Vulkan does not go through NEO's L0 driver
    ("cpu", None, None, None, "good", "cpu-no-context"),
])
def test_rule_table(backend, neo, kernel, notify, status, rule):
    v = judge(backend, neo, kernel, notify)
    assert (v.status, v.rule) == (status, rule)
    if backend == "sycl" and status != "good":
        assert v.sources, "a sycl verdict that is not good must cite where it comes from"


def test_bad_verdict_carries_intels_workaround_and_sources():
    v = judge("sycl", 37435, FEDORA, False)
    assert v.env == {"NEOReadDebugKeys": "1", "ForceZeDeviceCanAccessPerReturnValue": "0"}
    assert "intel/compute-runtime#916" in v.sources and "ggml-org/llama.cpp#22885" in v.sources
    assert v.to_dict()["inputs"]["neo_build"] == "37435"


def test_verdict_from_a_pasted_bug_report(tmp_path):
    cfg = tmp_path / "config-6.19.10"
    cfg.write_text("CONFIG_DMA_SHARED_BUFFER=y\n# CONFIG_DMABUF_MOVE_NOTIFY is not set\n")
    facts = F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", FEDORA, cfg, sysfs_root=tmp_path)
    assert verdict_for("sycl", facts).status == "bad"
    facts = F.gather_facts("sycl", None, FX / "sycl_ls_verbose_a770.txt", FEDORA, cfg, sysfs_root=tmp_path)
    assert verdict_for("sycl", facts).status == "good"  # NEO 1.3.30049: long before 26.05


def test_table_is_data_and_extensible():
    rules = known_rules()
    assert len({r.id for r in rules}) == len(rules)
    extra = parse_rules('[[rule]]\nid = "x"\nbackend = "sycl"\nneo_build_min = 40000\nstatus = "bad"\nsummary = "s"\n')
    assert judge("sycl", 40001, "7.5", True, extra + rules).rule == "x"
    assert judge("sycl", 39999, "7.5", True, extra + rules).rule != "x"


@pytest.mark.parametrize("text, match", [
    ('[[rule]]\nid = "x"\nneo_bulid_min = 1\nstatus = "bad"\nsummary = "s"\n', "unknown keys"),
    ('[[rule]]\nid = "x"\nstatus = "broken"\nsummary = "s"\n', "status"),
    ('[[rule]]\nid = "x"\nkernel_min = "seven"\nstatus = "bad"\nsummary = "s"\n', "not a version"),
    ("[[rule]\n", "not valid TOML"),
])
def test_bad_rule_tables_fail_loudly(text, match):
    with pytest.raises(ArcsplitError, match=match):
        parse_rules(text)
