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
    ("sycl", 37435, FEDORA, False, "bad", "neo-25.44-multi-device-alloc"),
    ("sycl", 37020, "7.0.4-200.fc44.x86_64", False, "bad", "neo-25.44-multi-device-alloc"),
    ("sycl", 37833, FEDORA, False, "bad", "neo-25.44-multi-device-alloc"),
    ("sycl", 38308, "6.17.0-35-generic", False, "bad", "neo-25.44-multi-device-alloc"),
    # the regression starts at 25.44.36015.5 (compute-runtime dd252e7852), not at 26.05
    ("sycl", 36015, FEDORA, False, "bad", "neo-25.44-multi-device-alloc"),
    ("sycl", 39121, FEDORA, False, "bad", "neo-25.44-multi-device-alloc"),
    # Intel (#916): fixed by the kernel, v7.1-rc1 and later
    ("sycl", 37435, "7.1-rc1", False, "good", "neo-25.44-kernel-fixed"),
    ("sycl", 38646, "7.2.3-100.fc45.x86_64", None, "good", "neo-25.44-kernel-fixed"),
    ("sycl", 37020, "6.19.10", True, "good", "neo-25.44-move-notify-on"),
    # ... and by NEO itself from 26.27 (compute-runtime e91243a9d0, first in 26.27.39122.10); #27168: 2x B60 on 26.31
    ("sycl", 39395, FEDORA, False, "good", "neo-26.31"),  # 26.31.39395.13: fixed, #953 still open
    ("sycl", 39758, FEDORA, False, "good", "neo-26.35"),  # 26.35.39758.10 fixes compute-runtime#953
    ("sycl", 39122, FEDORA, False, "bad", "neo-26.27-segv"),  # 26.27.39122.12: the segfault of compute-runtime#972
    ("sycl", 39200, FEDORA, False, "good", "neo-26.27-fixed"),
    ("sycl", 39123, "6.8.0-50-generic", None, "good", "neo-26.27-fixed"),
    # Ubuntu 26.04 kernels: reports disagree (#22885: 7.0.0-10 + NEO 26.09 fine; #25286: 7.0.0-27 + NEO 26.18 fails)
    ("sycl", 37435, "7.0.0-10-generic", None, "unknown", "neo-25.44-ubuntu-26.04"),
    ("sycl", 38308, "7.0.0-27-generic", None, "unknown", "neo-25.44-ubuntu-26.04"),
    # config unreadable on an old kernel: the probe decides
    ("sycl", 37435, FEDORA, None, "unknown", "neo-25.44-kernel-config-unread"),
    ("sycl", 37435, None, None, "unknown", "neo-25.44-kernel-config-unread"),
    # before the regression
    ("sycl", 35563, FEDORA, False, "good", "neo-25.40-or-older"),
    ("sycl", 30049, FEDORA, False, "good", "neo-25.40-or-older"),
    ("sycl", 36000, FEDORA, False, "unknown", "neo-25.40-25.44-gap"),
    ("sycl", 36014, FEDORA, False, "unknown", "neo-25.40-25.44-gap"),
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


def test_counterexample_keeps_the_choice_probe_led():
    """#25286 (dual B70, Ubuntu kernel 7.0.0-27, NEO 26.18: fails) contradicts #22885's working 7.0.0-10: the table
    says "unknown", so one context is tried only until a probe or a failed load says otherwise."""
    from arcsplit.llama.mode import choose_mode

    v = judge("sycl", 38308, "7.0.0-27-generic", None)
    assert v.status == "unknown" and "ggml-org/llama.cpp#25286" in v.sources
    unprobed = choose_mode("sycl", 2, verdict=v)
    assert unprobed.mode == "multi" and not unprobed.verified
    assert any("versions cannot tell" in r and "--mode hybrid" in r for r in unprobed.reasons)
    probed = choose_mode("sycl", 2, verdict=v, probe_results={"multi": False, "multi+workaround": False, "hybrid": True})
    assert probed.mode == "hybrid" and probed.verified


def test_report_says_when_probe_and_table_disagree():
    from arcsplit.llama.mode import choose_mode
    from arcsplit.llama.probe import ProbeResult
    from arcsplit.llama.runtime import RuntimeReport

    facts = F.gather_facts("sycl", None, FX / "sycl_ls_b70_fedora44.txt", "7.2.0", None, sysfs_root=None)
    good = judge("sycl", 38308, "7.2.0", None)
    failed = ProbeResult("multi", False, "alloc_failed", "alloc_tensor_range: failed to allocate SYCL0 buffer")
    r = RuntimeReport("sycl", (0, 1), facts, good, choose_mode("sycl", 2, verdict=good, probe_results=[failed]),
                      (failed,))
    assert r.decision.mode != "multi"
    assert "neo-25.44-kernel-fixed" in r.disagreement and "follows the probe" in r.disagreement
    assert r.to_dict()["disagreement"] == r.disagreement
    worked = ProbeResult("multi", True, "ok", "loaded on SYCL0, SYCL1")
    agree = RuntimeReport("sycl", (0, 1), facts, good, choose_mode("sycl", 2, verdict=good, probe_results=[worked]),
                          (worked,))
    assert agree.disagreement is None


def test_xe_backport_on_an_old_kernel_is_not_judged_by_uname_alone():
    """intel-gpu/xekmd-backports#451: the 7.1 xe driver as DKMS on a 6.x kernel; the probe decides, not 'bad'."""
    plain = judge("sycl", 37435, FEDORA, False)
    backport = judge("sycl", 37435, FEDORA, False, xe_backport=True)
    assert plain.status == "bad"
    assert (backport.status, backport.rule) == ("unknown", "neo-25.44-xe-backport")
    assert "intel-gpu/xekmd-backports#451" in backport.sources
    assert judge("sycl", 37435, "7.1.0", None, xe_backport=True).status == "good"  # a 7.1 kernel needs no signal
    assert judge("sycl", 37435, FEDORA, False, xe_backport=False).status == "bad"
