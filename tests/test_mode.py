"""choose_mode: the fastest mode that works, from the verdict and the probe; forced modes honoured with warnings."""

from __future__ import annotations

import pytest

from arcsplit.errors import BadInput
from arcsplit.llama.mode import NEO_WORKAROUND_ENV, choose_mode
from arcsplit.llama.probe import ProbeResult
from arcsplit.llama.verdict import judge

BAD = judge("sycl", 37435, "6.19.10-300.fc44.x86_64", False)       # the machine of ggml-org/llama.cpp#22885
GOOD = judge("sycl", 37435, "7.1.0", None)
UNKNOWN = judge("sycl", 37435, "6.19.10-300.fc44.x86_64", None)
SEGV = judge("sycl", 39122, "7.2", True)


def probe(mode: str, ok: bool, status: str | None = None) -> ProbeResult:
    return ProbeResult(mode, ok, status or ("ok" if ok else "alloc_failed"), "")


def test_good_runtime_runs_one_context():
    d = choose_mode("sycl", 2, verdict=GOOD)
    assert d.mode == "multi" and d.env == {} and not d.verified
    assert any("7.1" in r for r in d.reasons)


def test_known_bad_without_probe_goes_hybrid_not_workaround():
    # the workaround env is only used once a probe has shown it works on this machine
    d = choose_mode("sycl", 2, verdict=BAD)
    assert d.mode == "hybrid"
    assert any(r.startswith("skipped multi") and "#916" in r for r in d.reasons)


def test_probe_beats_the_versions():
    d = choose_mode("sycl", 2, verdict=BAD, probe_results=[probe("multi", True)])
    assert d.mode == "multi" and d.verified
    d = choose_mode("sycl", 2, verdict=GOOD, probe_results=[probe("multi", False)])
    assert d.mode == "hybrid" and not d.verified
    assert any("probe: multi failed (alloc_failed)" in r for r in d.reasons)


def test_verified_workaround_carries_its_env():
    d = choose_mode("sycl", 2, verdict=BAD, probe_results=[probe("multi", False), probe("multi+workaround", True)])
    assert d.mode == "multi+workaround" and d.verified
    assert d.env == NEO_WORKAROUND_ENV == BAD.env


def test_all_probes_fail_is_said():
    results = [probe(m, False) for m in ("multi", "multi+workaround", "hybrid", "rpc")]
    d = choose_mode("sycl", 2, verdict=BAD, probe_results=results)
    assert d.mode == "rpc" and not d.verified and "no mode worked" in d.reasons[-1]


def test_hybrid_probe_failing_falls_to_rpc():
    d = choose_mode("sycl", 3, verdict=BAD, probe_results={"multi": False, "multi+workaround": False, "hybrid": False})
    assert d.mode == "rpc"


def test_unknown_verdict_tries_multi_and_says_how_to_check():
    d = choose_mode("sycl", 2, verdict=UNKNOWN)
    assert d.mode == "multi" and any("arcsplit doctor" in r for r in d.reasons)


def test_runtime_broken_for_every_mode_is_a_warning():
    d = choose_mode("sycl", 2, verdict=SEGV)
    assert d.reasons[0].startswith("warning:") and "#971" in d.reasons[0]


@pytest.mark.parametrize("backend", ["cuda", "vulkan"])
def test_other_gpu_backends(backend):
    v = judge(backend, None, None, None)
    assert choose_mode(backend, 2, verdict=v).mode == "multi"
    assert choose_mode(backend, 2, verdict=v, probe_results=[probe("multi", False)]).mode == "hybrid"
    with pytest.raises(BadInput, match="multi\\+workaround"):
        choose_mode(backend, 2, forced="multi+workaround")


def test_cpu_backend():
    assert choose_mode("cpu", 2).mode == "rpc"
    assert choose_mode("cpu", 2, forced="hybrid").mode == "hybrid"
    assert choose_mode("cpu", 2, probe_results=[probe("rpc", True)]).verified
    assert choose_mode("cpu", 1).mode == "single"
    for forced in ("multi", "multi+workaround"):
        with pytest.raises(BadInput, match="CPU"):
            choose_mode("cpu", 2, forced=forced)


def test_single_card():
    assert choose_mode("sycl", 1, verdict=BAD).mode == "single"
    assert choose_mode("sycl", 1, forced="rpc").mode == "rpc"
    with pytest.raises(BadInput, match="at least 2 cards"):
        choose_mode("sycl", 1, forced="hybrid")
    with pytest.raises(BadInput, match="exactly one card"):
        choose_mode("sycl", 2, forced="single")


def test_forced_mode_is_honoured_with_a_warning():
    d = choose_mode("sycl", 2, forced="multi", verdict=BAD)
    assert d.mode == "multi" and any(r.startswith("warning:") for r in d.reasons)
    d = choose_mode("sycl", 2, forced="multi", verdict=GOOD, probe_results=[probe("multi", False)])
    assert d.mode == "multi" and not d.verified and any("warning: probe: multi failed" in r for r in d.reasons)
    d = choose_mode("sycl", 2, forced="multi+workaround", verdict=BAD)
    assert d.env == NEO_WORKAROUND_ENV
    assert choose_mode("sycl", 2, forced="rpc", verdict=GOOD).mode == "rpc"


@pytest.mark.parametrize("backend, n, mode", [("cpu", 2, "hybrid"), ("cpu", 2, "rpc"), ("sycl", 2, "multi"),
                                             ("cuda", 1, "rpc"), ("cuda", 1, "single")])
def test_a_mode_tune_picked_says_so_not_forced_by_mode(backend, n, mode):
    """A tuned pick reaches choose_mode as a forced mode: its reason is tune's line (RouteChoice.line), with any
    warning kept."""
    line = "route: x, chosen by arcsplit tune (decode, 2025-01-01 00:00)"
    d = choose_mode(backend, n, forced=mode, verdict=BAD if backend == "sycl" else None, forced_by=line)
    assert d.mode == mode and d.reasons[-1] == line and not any("--mode" in r for r in d.reasons)
    assert (backend == "sycl") == any(r.startswith("warning:") for r in d.reasons)


@pytest.mark.parametrize("args, match", [
    (("rocm", 2), "unknown backend"), (("sycl", 0), "no cards"), (("sycl", 2, "fast"), "unknown mode"),
])
def test_bad_input(args, match):
    with pytest.raises(BadInput, match=match):
        choose_mode(*args)


def test_decision_is_a_frozen_value():
    d = choose_mode("sycl", 2, verdict=GOOD)
    with pytest.raises(AttributeError):
        d.mode = "rpc"  # type: ignore[misc]
    assert d.to_dict()["mode"] == "multi"
