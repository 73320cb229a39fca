"""arcsplit tune's deciding parts, without processes: candidates, the correctness rule, fingerprints, the pick."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from arcsplit.modes import Mode
from arcsplit.tuning import fingerprint as fpmod
from arcsplit.tuning import verify
from arcsplit.llama.locate import LlamaBinaries
from arcsplit.tuning import runner
from arcsplit.tuning.candidates import BuildFacts, Candidate, Settings, rank, routes, settings_variants, split_modes

FIX = Path(__file__).parent / "fixtures"


def _samples() -> dict[str, verify.Sample]:
    data = json.loads((FIX / "tune" / "cpu_routes_gemma3_270m.json").read_text())
    return {k: verify.from_json(v) for k, v in data.items()}


def test_routes_cpu_two_cards_in_default_order() -> None:
    keys = [c.route_key for c in routes("cpu", 2)]
    assert keys == ["single-1card", "hybrid-last", "hybrid-local", "rpc"]


def test_routes_sycl_tensor_variants_cite_their_source() -> None:
    cands = routes("sycl", 2, BuildFacts(tensor_split=True, vulkan=True))
    keys = [c.key for c in cands]
    assert keys.index("sycl:multi:defaults") < keys.index("sycl:multi+workaround-debugkey:defaults") \
        < keys.index("vulkan:multi:defaults") < keys.index("sycl:hybrid-last:defaults") < keys.index("sycl:rpc:defaults")
    tensor = [c for c in cands if c.split == "tensor"]
    assert {c.variant for c in tensor} == {"", "vmm0", "d2d2"}
    assert all("ggml-org/llama.cpp#26409" in c.source for c in tensor if c.variant)
    assert dict(next(c for c in tensor if c.variant == "vmm0").env) == {"GGML_SYCL_ENABLE_VMM": "0"}
    assert all(c.server_args == ("-sm", "tensor") for c in tensor)
    debug = next(c for c in cands if c.variant == "debugkey")
    assert dict(debug.env)["ForceZeDeviceCanAccessPerReturnValue"] == "0"


def test_tensor_split_always_runs_with_flash_attention() -> None:
    """llama.cpp refuses -sm tensor without flash attention ("SPLIT_MODE_TENSOR requires flash_attn to be enabled";
    on two lavapipe devices tune's -fa off variant of it failed to load): SYCL, whose default is off, gets it on, and
    no settings variant of a tensor route turns it off."""
    for backend, fa_default in (("sycl", False), ("vulkan", True), ("cuda", True)):
        tensor = [c for c in routes(backend, 2, BuildFacts(tensor_split=True)) if c.split == "tensor"]
        assert tensor and all(c.settings.flash_attn in (True, None) for c in tensor)
        assert all((c.settings.flash_attn is True) != fa_default for c in tensor), backend
        for c in tensor:
            variants = settings_variants(c, 512, fa_default)
            assert variants and all(v.settings.flash_attn is not False for v in variants)
            assert all(v.split == "tensor" for v in variants)
    layer = next(c for c in routes("sycl", 2, BuildFacts(tensor_split=True)) if c.key == "sycl:multi:defaults")
    assert any(v.settings.flash_attn is True for v in settings_variants(layer, 512, False))  # -sm layer: both tried


def test_routes_without_tensor_build_or_on_cuda() -> None:
    assert not [c for c in routes("sycl", 2, BuildFacts()) if c.split == "tensor"]
    cuda = routes("cuda", 2, BuildFacts(tensor_split=True))
    assert [c for c in cuda if c.split == "tensor"] and not [c for c in cuda if c.variant]
    assert [c.route_key for c in routes("cpu", 1)] == ["single"]


def test_split_modes_from_help() -> None:
    assert "tensor" in split_modes((FIX / "tune" / "help_split_mode_cpu.txt").read_text())
    assert split_modes((FIX / "tune" / "help_server_00dc8057.md").read_text()) == ("none", "layer", "row", "tensor")
    old = split_modes((FIX / "runtime" / "help_server_53dd4beb.md").read_text())
    assert old == ("none", "layer", "row")
    assert split_modes("no such line") == ()


def _recorded_server(tmp_path: Path, help_file: Path) -> LlamaBinaries:
    """A SYCL build's llama-server cannot run here: one that prints upstream's recorded --help instead."""
    d = tmp_path / help_file.stem
    d.mkdir(parents=True)
    server = d / "llama-server"
    server.write_text(f"#!/bin/sh\n[ \"$1\" = --help ] || exit 1\ncat '{help_file}'\n")
    server.chmod(0o755)
    return LlamaBinaries(server, d / "ggml-rpc-server", None, None, None, "test")


@pytest.mark.parametrize("help_file, tensor", [(FIX / "tune" / "help_server_00dc8057.md", True),
                                               (FIX / "runtime" / "help_server_53dd4beb.md", False)])
def test_sycl_candidates_from_recorded_help(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, help_file: Path,
                                            tensor: bool) -> None:
    """What tune tries on a SYCL rig follows the build's --help: -sm tensor and its two environment variants
    (each citing #26409) only where the build lists tensor; the other routes either way."""
    monkeypatch.setattr(runner, "managed_builds", lambda backend: [])  # no Vulkan build beside it
    facts = runner.build_facts("sycl", _recorded_server(tmp_path, help_file))
    assert facts == BuildFacts(tensor_split=tensor, vulkan=False)
    keys = [c.route_key for c in routes("sycl", 2, facts)]
    with_tensor = ["multi-tensor", "multi-tensor-vmm0", "multi-tensor-d2d2"]
    assert keys == ["single-1card", "multi", *(with_tensor if tensor else []), "multi+workaround-debugkey",
                    "hybrid-last", "hybrid-local", "rpc"]
    assert runner.build_facts("sycl", _recorded_server(tmp_path / "x", tmp_path / "missing.txt")) \
        == BuildFacts()  # a --help that says nothing: no tensor candidates


def test_settings_vary_one_at_a_time() -> None:
    base = Candidate(Mode.HYBRID, "cpu", output_layer="last")
    out = settings_variants(base, route_ubatch=256, flash_default=True, moe_layers=3)
    assert [c.settings for c in out] == [Settings(ubatch=512), Settings(ubatch=1024), Settings(flash_attn=False),
                                        Settings(cache_type="q8_0", flash_attn=True), Settings(moe_offload=5)]
    assert len({c.key for c in out} | {base.key}) == len(out) + 1
    assert not [c for c in settings_variants(base, 256, True) if c.settings.moe_offload]


def test_expert_offload_variant_stays_within_the_model() -> None:
    """Two more layers than the planner's, but never more than the model has (the planner refuses those)."""
    base = Candidate(Mode.SINGLE, "cpu", one_card=True)
    offload = [[c.settings.moe_offload for c in settings_variants(base, 512, True, moe_layers=n, moe_max=12)
                if c.settings.moe_offload] for n in (3, 11, 12)]
    assert offload == [[5], [12], []]


def test_sampling_on_the_card_is_one_more_setting_where_the_build_has_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned build's --help lists --backend-sampling (recorded verbatim): tune then tries it as one more setting
    of the best route on a GPU rig (a token id instead of the logits a token: a real vocabulary's 600 KiB over the
    link), and the pick carries the flag to llama-server. Not on CPU cards, nor with a build without the flag."""
    monkeypatch.setattr(runner, "managed_builds", lambda backend: [])
    facts = runner.build_facts("cuda", _recorded_server(tmp_path, FIX / "tune" / "help_backend_sampling_cpu.txt"))
    assert facts == BuildFacts(tensor_split=True, vulkan=False, backend_sampling=True)
    base = Candidate(Mode.RPC, "cuda")
    bs = [c for c in settings_variants(base, 256, True, backend_sampling=facts.backend_sampling)
          if c.settings.backend_sampling]
    assert len(bs) == 1 and bs[0].server_args == ("--backend-sampling",) and bs[0].key == "cuda:rpc:bs"
    assert Candidate.from_dict(json.loads(json.dumps(bs[0].to_dict()))) == bs[0]
    assert not [c for c in settings_variants(Candidate(Mode.RPC, "cpu"), 256, True, backend_sampling=True)
                if c.settings.backend_sampling]
    assert not [c for c in settings_variants(base, 256, True) if c.settings.backend_sampling]
    tensor = replace(base, mode=Mode.MULTI, split="tensor", settings=Settings(backend_sampling=True))
    assert tensor.server_args == ("-sm", "tensor", "--backend-sampling")


def test_candidate_round_trips() -> None:
    c = routes("sycl", 2, BuildFacts(tensor_split=True))[3]
    assert Candidate.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_real_noise_between_cpu_routes_is_accepted() -> None:
    s = _samples()
    for name in ("hybrid", "rpc"):
        check = verify.compare(s["single"], s[name])
        assert check.ok, check.reason
        assert check.near_ties >= 1  # the texts do part: the rule is what keeps them correct
        assert 0 < check.noise < verify.LOGPROB_TOL


def test_corruption_is_rejected() -> None:
    s = _samples()
    ref = s["single"]
    # a confident position answered with another token
    steps = list(ref[0])
    k = max(range(len(steps)), key=lambda i: steps[i].top[0][1] - steps[i].top[1][1])
    wrong = replace(steps[k], token=steps[k].top[-1][0] + 1)
    bad = (tuple(steps[:k]) + (wrong,) + tuple(steps[k + 1:]), *ref[1:])
    check = verify.compare(ref, bad)
    assert not check.ok and f"token {k + 1}" in check.reason
    # the same tokens with their probabilities moved far
    shifted = tuple(tuple(replace(st, logprob=st.logprob - 2.0) for st in p) for p in ref)
    assert not verify.compare(ref, shifted).ok
    # an answer that stops short
    assert not verify.compare(ref, (ref[0][:2], *ref[1:])).ok


def test_agreement_needs_a_majority() -> None:
    s = _samples()
    ref = s["single"]
    garbage = tuple(tuple(replace(st, token=st.token + 7, logprob=-9.0) for st in p) for p in ref)
    assert verify.agreement({"a": ref, "b": s["rpc"], "c": garbage}) in ("a", "b")
    assert verify.agreement({"a": ref, "c": garbage}) is None


def test_rank_only_correct_measured() -> None:
    results = {"a": {"status": "ok", "decode": 10.0, "prefill": 90.0},
               "b": {"status": "wrong", "decode": 99.0, "prefill": 999.0},
               "c": {"status": "ok", "decode": 12.0, "prefill": 50.0},
               "d": {"status": "pruned"}}
    assert rank(results, "decode") == ["c", "a"]
    assert rank(results, "prefill") == ["a", "c"]


@pytest.mark.parametrize("pick_ms, default_ms, stands", [(20.0, 30.0, True), (31.0, 30.0, False),
                                                         (None, 30.0, False), (20.0, None, True)])
def test_second_round_by_time_to_first_token_keeps_the_shorter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              pick_ms: float | None, default_ms: float | None,
                                                              stands: bool) -> None:
    """The second round compares times the other way round from rates; a candidate that failed it (None) loses."""
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path))
    served: list[str] = []

    def second(p: object, c: Candidate, budget_s: float, reference: object, measure: bool = True) -> dict:
        served.append(c.key)
        ms = pick_ms if c.mode is Mode.HYBRID else default_ms
        return {"status": "ok", "ttft": ms} if ms is not None else {"status": "failed", "reason": "did not start"}

    monkeypatch.setattr(runner, "run_candidate", second)
    pick, default = (Candidate(Mode.HYBRID, "cpu"), Candidate(Mode.RPC, "cpu"))
    results = {c.key: {"candidate": c.to_dict(), "label": c.key, "status": "ok", "ttft": 25.0} for c in (pick, default)}
    report = runner.TuneReport(_fp(backend="cpu"), "ttft", results, list(results), default.key, None)
    lines: list[str] = []
    run = runner._Run(None, runner.TuneRequest(None, "ttft", budget_s=600), report, lines.append,  # type: ignore[arg-type]
                      time.monotonic())
    assert runner._confirmed(run, pick.key) == (pick.key if stands else default.key)
    assert sorted(served) == sorted([pick.key, default.key])
    assert results[pick.key]["confirm_ttft"] == pick_ms and "ms" in lines[-1]
    served.clear()
    assert runner._confirmed(run, pick.key) == (pick.key if stands else default.key) and not served  # kept, not rerun


def test_serve_without_objective_runs_the_pick_of_the_objective_last_tuned() -> None:
    """A rig tuned by ttft (or streams) only: serve without --objective must find that pick, as plan does, not look
    for a decode pick that was never made; tune and serve --tune still measure by decode unless told."""
    from arcsplit.cli import build_parser
    from arcsplit.tuning.picks import choice_of

    assert build_parser("serve").parse_args(["serve", "m.gguf"]).objective is None
    assert build_parser("tune").parse_args(["tune", "m.gguf"]).objective == "decode"
    assert build_parser("serve").parse_args(["serve", "m.gguf", "--objective", "ttft"]).objective == "ttft"
    data = {"objective": "ttft", "picks": {"ttft": "k"},
            "results": {"k": {"candidate": {"mode": "rpc"}, "status": "ok", "decode": 1.0, "prefill": 2.0,
                              "streams": 3.0, "ttft": 40.0}}}
    got = choice_of(data, None)
    assert got is not None and got.objective == "ttft" and choice_of(data, "decode") is None


def _fp(**kw: object) -> fpmod.Fingerprint:
    base = dict(backend="sycl", cards=("0:Arc B70:32", "1:Arc B70:32"), driver="", neo="26.35.39758.10",
                xe="version 1.0-backport", kernel="6.8.0", build="/b/llama-server@1:2", model="abc:1:2",
                ctx=4096, parallel=1)
    return fpmod.Fingerprint(**{**base, **kw})  # type: ignore[arg-type]


def test_fingerprint_changes_with_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    fp = _fp()
    assert fpmod.store(fp, {"results": {"k": {"status": "ok"}}})
    assert fpmod.load(fp)["results"] == {"k": {"status": "ok"}}
    for change in (dict(neo="26.27.39122.12"), dict(xe="version 2"), dict(build="/b/llama-server@3:2"),
                   dict(model="def:1:2"), dict(ctx=8192), dict(parallel=4), dict(cards=("0:Arc B70:32",))):
        other = _fp(**change)
        assert other.digest != fp.digest and fpmod.load(other) == {}
        assert fp.changed(other) == list(change)


def test_model_digest_follows_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    first = fpmod.model_digest(f)
    os.utime(f, ns=(1, 1))
    assert fpmod.model_digest(f) != first
    f.write_bytes(b"GGUF" + bytes(101))
    assert fpmod.model_digest(f).split(":")[1] == "105"


def test_module_version_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "module" / "xe").mkdir(parents=True)
    (tmp_path / "module" / "xe" / "srcversion").write_text("8F1C0D5E2A\n")
    assert fpmod.module_version("xe", tmp_path) == "srcversion 8F1C0D5E2A"
    (tmp_path / "module" / "xe" / "version").write_text("1.0.0-backport\n")
    assert fpmod.module_version("xe", tmp_path) == "version 1.0.0-backport"
    assert fpmod.module_version("nvidia", tmp_path) == ""


def test_three_cards_in_one_context_are_checked_first() -> None:
    """intel/compute-runtime#942: 4x B70 peer copies corrupt data while the route loads."""
    from arcsplit.decide.prepare import ServeRequest, unchecked_one_context

    req = ServeRequest(model="m.gguf", backend="sycl")
    line = unchecked_one_context(req, Mode.MULTI, 4)
    assert line is not None and "compute-runtime#942" in line and "doctor --verify" in line
    assert unchecked_one_context(req, Mode.MULTI, 2) is None
    assert unchecked_one_context(req, Mode.HYBRID, 4) is None
    assert unchecked_one_context(replace(req, verified=True), Mode.MULTI, 4) is None
    assert unchecked_one_context(replace(req, backend="cpu"), Mode.RPC, 4) is None


def test_auto_does_not_trust_one_context_on_three_sycl_cards_unchecked() -> None:
    """Where a one-context route loads on 4 Arc cards (the probe says so), auto still runs hybrid until tune has
    checked one context's output (verified) or the user asks for it with --mode, which runs it and warns."""
    from arcsplit.decide.prepare import ServeRequest, unchecked_one_context
    from arcsplit.llama.mode import choose_mode

    loads = {"multi": True, "multi+workaround": True, "hybrid": True}
    req = ServeRequest(model="m.gguf", backend="sycl")
    assert choose_mode("sycl", 4, probe_results=loads).mode is Mode.MULTI  # loading alone would pick it
    why = unchecked_one_context(req, Mode.MULTI, 4)
    decision = choose_mode("sycl", 4, probe_results=loads, distrust_one_context=why)
    assert decision.mode is Mode.HYBRID
    assert any(r.startswith("skipped multi:") and "compute-runtime#942" in r for r in decision.reasons)
    assert choose_mode("sycl", 4, forced="multi", probe_results=loads, distrust_one_context=why).mode is Mode.MULTI
    assert unchecked_one_context(replace(req, verified=True), Mode.MULTI, 4) is None  # tune's pick: trusted
    assert choose_mode("sycl", 2, probe_results=loads,
                       distrust_one_context=unchecked_one_context(req, Mode.MULTI, 2)).mode is Mode.MULTI


def test_serve_looks_nothing_up_when_nothing_was_tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve asks for a tuned pick on every start: with no results kept it must not plan twice."""
    from arcsplit.decide.prepare import ServeRequest
    from arcsplit.tuning import picks

    monkeypatch.setenv("ARCSPLIT_TUNE_DIR", str(tmp_path / "tune"))
    monkeypatch.setattr(picks, "preview", lambda *a, **k: pytest.fail("planned with nothing tuned"))
    assert picks.tuned(ServeRequest(model=str(tmp_path / "m.gguf"))) is None
    assert fpmod.store(_fp(), {"results": {}})
    assert fpmod.anything_kept()
