"""Compute buffers from llama.cpp itself: ``plan --measure`` runs llama-fit-params' dry run once, caches each card's
compute buffer, and every later plan with the same model file and options uses it without starting anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from arcsplit import memory, synth
from arcsplit.llama import compute_cache, fitparams
from arcsplit.model import load_profile
from arcsplit.planner import PlanOptions, plan_for_split
from arcsplit.rig import Card
from arcsplit.decide.prepare import ServeRequest, measure_plan, preview

MiB = 1024 * 1024


def _gh(tmp: Path, ctx: int = 4096) -> Path:
    """qwen2 (Llama's tensors): a family the formulas are not checked on (model.FAMILIES), so they add their margin."""
    return synth.write_llama(tmp / f"q2_{ctx}.gguf", n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816,
                             n_vocab=32000, ctx=ctx, header_only=True, arch="qwen2")


def _cards(n: int, backend: str = "cpu") -> list[Card]:
    return [Card(backend, i, f"card{i}", 8192 * MiB, 8192 * MiB, 0) for i in range(n)]


def test_context_classes_bound_every_context_in_them():
    assert [memory.ctx_class(n) for n in (1, 4096, 4097, 6144, 6145, 8193, 40000)] == \
        [4096, 4096, 6144, 6144, 8192, 12288, 49152]
    for n in range(256, 300_000, 4864):
        c = memory.ctx_class(n)
        assert c >= n and c % 256 == 0 and c < 1.5 * n + 4096


def test_a_measured_range_replaces_the_formula_and_says_so(tmp_path: Path):
    prof = load_profile(_gh(tmp_path))
    opts = PlanOptions(n_ctx=4096, n_outputs=1)
    ts = [4, 9]
    formula = plan_for_split(prof, _cards(2), opts, ts, ["RPC0", "RPC1"])
    assert [c.compute_source for c in formula.cards] == ["formula +50%"] * 2
    measured = memory.MeasuredCompute("cpu", {(4096, 0, 0, 0, 4): 40 * MiB})  # only the first card's range
    plan = plan_for_split(prof, _cards(2), opts, ts, ["RPC0", "RPC1"], measured=measured)
    assert plan.cards[0].compute == 40 * MiB and plan.cards[0].compute_source == "measured cpu"
    assert plan.cards[1].compute == formula.cards[1].compute and plan.cards[1].compute_source == "formula +50%"
    # another context class, or another split of that card: not measured, the formula again
    other = plan_for_split(prof, _cards(2), PlanOptions(n_ctx=8192, n_outputs=1), ts, ["RPC0", "RPC1"],
                           measured=measured)
    assert other.cards[0].compute_source == "formula +50%"
    assert plan_for_split(prof, _cards(2), opts, [5, 8], ["RPC0", "RPC1"],
                          measured=measured).cards[0].compute_source == "formula +50%"


def test_inside_a_context_class_the_line_between_two_measurements_is_used(tmp_path: Path):
    """Compute buffers grow linearly with the context in each of their terms; their largest is convex, so the line
    between the measurements at the class's two ends never runs under it, and is far closer than the top alone."""
    prof = load_profile(_gh(tmp_path))
    opts = PlanOptions(n_ctx=5120, n_outputs=1)
    top_only = memory.MeasuredCompute("cpu", {(6144, 0, 0, 0, 4): 60 * MiB})
    both = memory.MeasuredCompute("cpu", {**top_only.entries, (4096, 0, 0, 0, 4): 40 * MiB})
    card = lambda m: plan_for_split(prof, _cards(2), opts, [4, 9], ["RPC0", "RPC1"], measured=m).cards[0]  # noqa: E731
    assert card(top_only).compute == 60 * MiB
    assert card(both).compute == 50 * MiB and card(both).compute_source == "measured cpu"
    assert memory.ctx_class_below(6144) == 4096 and memory.ctx_class_below(4096) is None


def test_the_output_card_drops_the_logits_rows_llama_fit_params_reserves_beyond_the_slots(tmp_path: Path):
    prof = load_profile(synth.write_llama(tmp_path / "l.gguf", n_layer=8, n_embd=1024, n_head=16, n_head_kv=4,
                                          n_ff=2816, n_vocab=65536, header_only=True))
    # llama-fit-params reserves n_ubatch logits rows on the output card, llama-server one per slot
    raw = plan_for_split(prof, _cards(2), PlanOptions(n_ctx=4096, n_outputs=512), [3, 6], ["RPC0", "RPC1"]).cards[1]
    one = plan_for_split(prof, _cards(2), PlanOptions(n_ctx=4096, n_outputs=1), [3, 6], ["RPC0", "RPC1"]).cards[1]
    logits = 511 * prof.n_vocab * 4
    assert raw.compute - one.compute >= 0.9 * logits  # a large vocabulary: the logits rows size that card
    measured = memory.MeasuredCompute("cpu", {(4096, 0, 1, 3, 9): 400 * MiB})
    got = plan_for_split(prof, _cards(2), PlanOptions(n_ctx=4096, n_outputs=1), [3, 6], ["RPC0", "RPC1"],
                         measured=measured).cards[1]
    assert got.compute_source == "measured cpu" and got.compute == 400 * MiB - (raw.compute - one.compute)


def test_backends_without_measurements_keep_a_stated_margin(tmp_path: Path):
    prof = load_profile(synth.write_llama(tmp_path / "l.gguf", n_layer=8, n_embd=1024, n_head=16, n_head_kv=4,
                                          n_ff=2816, n_vocab=32000, header_only=True))
    cpu_row, cuda, sycl = (memory.backend_compute(b) for b in ("cpu", "cuda", "sycl"))
    assert (cpu_row.factor, cpu_row.add_mib, cpu_row.label()) == (1.0, 0, "")
    # measured on an H200: CUDA needs more on some cards (growing with -ub and n_embd, and with a quantized cache)
    assert cuda.measured and cuda.embd_rows > 0 and cuda.quant_kv_cell > 0
    # never measured: a margin, at least what CUDA needs on every term
    assert sycl.factor > 1.0 and not sycl.measured and sycl.add_mib > cuda.add_mib
    assert sycl.embd_rows >= cuda.embd_rows and sycl.quant_kv_cell >= cuda.quant_kv_cell
    assert memory.backend_compute("metal") == memory.BackendCompute(
        "metal", max(r.factor for r in (cpu_row, cuda, sycl)), sycl.add_mib, "", sycl.embd_rows, sycl.quant_kv_cell)
    opts = PlanOptions(n_ctx=4096, n_outputs=512)  # the rows llama-fit-params reserves: its numbers as they are
    cpu = plan_for_split(prof, _cards(2), opts, [4, 5], ["RPC0", "RPC1"])
    on_sycl = plan_for_split(prof, _cards(2, "sycl"), opts, [4, 5], ["SYCL0", "SYCL1"])
    rows = prof.n_embd * 512 * 4  # n_embd x the ubatch's tokens x f32
    for c, s in zip(cpu.cards, on_sycl.cards):
        assert s.compute == int(c.compute * sycl.factor) + int(sycl.embd_rows * rows) + sycl.add_mib * MiB
        assert s.compute_source == f"formula {sycl.factor - 1:+.0%} +{sycl.embd_rows:g} rows +{sycl.add_mib} MiB sycl"
    # a quantized cache adds its term on top
    q8 = plan_for_split(prof, _cards(2, "sycl"), PlanOptions(n_ctx=4096, n_outputs=512, cache_type_k="q8_0",
                                                             cache_type_v="q8_0"), [4, 5], ["SYCL0", "SYCL1"])
    cpu_q8 = plan_for_split(prof, _cards(2), PlanOptions(n_ctx=4096, n_outputs=512, cache_type_k="q8_0",
                                                          cache_type_v="q8_0"), [4, 5], ["RPC0", "RPC1"])
    for c, s in zip(cpu_q8.cards, q8.cards):
        assert s.compute == (int(c.compute * sycl.factor) + int(sycl.embd_rows * rows) + sycl.add_mib * MiB
                             + sycl.quant_kv_cell * 4096)  # bytes per cell of the context
        assert s.compute_source.endswith(f"+{sycl.quant_kv_cell} B/cell quantized KV sycl")
    # a measurement on CPU devices standing in for absent Intel cards keeps the backend's row
    m = memory.MeasuredCompute("cpu", {(4096, 0, j, c.first_layer, c.end_layer): 50 * MiB
                                       for j, c in enumerate(on_sycl.cards)})
    again = plan_for_split(prof, _cards(2, "sycl"), opts, [4, 5], ["SYCL0", "SYCL1"], measured=m)
    assert [c.compute for c in again.cards] == [int(50 * MiB * sycl.factor) + int(sycl.embd_rows * rows)
                                                + sycl.add_mib * MiB] * 2
    assert {c.compute_source for c in again.cards} == {f"measured cpu {sycl.label()}"}
    # ... and one taken on the backend's own cards is used as it is
    own = plan_for_split(prof, _cards(2, "sycl"), opts, [4, 5], ["SYCL0", "SYCL1"],
                         measured=memory.MeasuredCompute("sycl", m.entries))
    assert [(c.compute, c.compute_source) for c in own.cards] == [(50 * MiB, "measured sycl")] * 2


def test_a_corrupt_cache_file_is_ignored_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    prof = load_profile(_gh(tmp_path))
    key = compute_cache.cache_key(prof, "cpu", "rpc", ["RPC0", "RPC1"], PlanOptions())
    assert compute_cache.load(key) == (None, None)  # nothing measured: no warning either
    stored = compute_cache.store(key, "cpu", {(4096, 0, 0, 0, 4): 7 * MiB})
    assert compute_cache.load(key) == (stored, None) and key.path.parent == tmp_path / "cache" / "compute"
    key.path.write_text('{"version": 1, "key": ', encoding="utf-8")
    got, warning = compute_cache.load(key)
    assert got is None and warning and "ignored compute cache" in warning and "--measure" in warning
    # a different model file (same path, rewritten) is another key: its old measurement never applies
    path = _gh(tmp_path)
    assert compute_cache.cache_key(load_profile(path), "cpu", "rpc", ["RPC0", "RPC1"], PlanOptions()) != key


@pytest.mark.slow
def test_measure_once_then_plan_from_the_cache(llama_bins, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    model = _gh(tmp_path)
    req = ServeRequest(model=str(model), gpus="0,1", backend="cpu", mode="rpc", ctx=4096, cpu_memory_mib=4096,
                       llama_dir=str(llama_bins.bin_dir))
    before = preview(req).config.plan
    assert [c.compute_source for c in before.offloaded] == ["formula +50%"] * 2

    prepared = preview(req)
    plan, runs = measure_plan(prepared.profile, prepared.rig, req, "rpc")
    assert runs >= 1 and [c.compute_source for c in plan.offloaded] == ["measured cpu"] * 2
    files = list((tmp_path / "cache" / "compute").glob("*.json"))
    assert len(files) == 1 and files[0].stat().st_size < 4096

    # llama.cpp's own numbers: each card's compute is what llama-fit-params reserves for that split (the output
    # card less the logits rows beyond one slot), never below it otherwise, and under the +50% formula
    ts = list(plan.tensor_split)
    with fitparams.RpcServers(llama_bins, 2) as rpc:
        rows, _ = fitparams.fit_print(llama_bins, model, rpc, ["-c", "4096", "-np", "1", "-ub", "256", "-fa", "on",
                                                               "-ngl", str(sum(ts)), "-ts", ",".join(map(str, ts)),
                                                               "--device", "RPC0,RPC1"])
    for c, f in zip(plan.offloaded, before.offloaded):
        fit = rows[c.device].compute_mib * MiB
        assert c.compute < f.compute
        if not c.has_output:
            assert fit <= c.compute <= fit + MiB

    # the second plan is the cache's: no process may start (the dry run's servers raise if asked)
    def no_processes(*a, **k):
        raise AssertionError("a cached plan started a process")

    monkeypatch.setattr(fitparams.RpcServers, "__enter__", no_processes)
    again, runs = measure_plan(prepared.profile, prepared.rig, req, "rpc")
    assert runs == 0 and again.cards == plan.cards
    served = preview(req)  # what serve plans with: the cached value, automatically
    assert [c.compute_source for c in served.config.plan.offloaded] == ["measured cpu"] * 2
    assert any("from the cache" in n for n in preview(ServeRequest(**{**req.__dict__, "measure": True})).notes)

    files[0].write_text("not json", encoding="utf-8")
    spoiled = preview(req).config.plan
    assert [c.compute_source for c in spoiled.offloaded] == ["formula +50%"] * 2
    assert any("ignored compute cache" in w for w in spoiled.warnings)


@pytest.mark.slow
def test_the_cli_measures_once_and_says_where_each_cards_compute_comes_from(llama_bins, tmp_path: Path):
    model = _gh(tmp_path)
    env = {**os.environ, "ARCSPLIT_CACHE_DIR": str(tmp_path / "cache"), "ARCSPLIT_STATE_DIR": str(tmp_path / "state")}
    base = [sys.executable, "-m", "arcsplit", "plan", str(model), "--backend", "cpu", "--gpus", "0,1", "--mode", "rpc",
            "--ctx", "4096", "--cpu-memory", "4096", "--llama-dir", str(llama_bins.bin_dir)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *extra], env=env, capture_output=True, text=True, timeout=300)

    first = run("--measure")
    assert first.returncode == 0, first.stderr
    assert "llama-fit-params dry run(s) now, cached" in first.stderr
    rows = [ln for ln in first.stdout.splitlines() if re.search(r"  RPC[01]  +\d", ln)]  # the table's card rows
    assert len(rows) == 2 and all(ln.rstrip().endswith("measured cpu") for ln in rows), first.stdout
    second = run()  # no --measure: the cache is used as it is, and nothing is run
    assert second.returncode == 0 and "dry run" not in second.stderr
    assert second.stdout.count("measured cpu") == 2
    bad = run("--measure", "--parallel", "2")
    assert bad.returncode == 2 and "--kv-unified" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) <= 2


@pytest.mark.slow
def test_measuring_makes_room_the_formulas_do_not_see(llama_bins, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The formulas are an upper bound (+50 % here, an unchecked family): where they say the model does not fit,
    or stop --ctx max early, llama.cpp's own numbers decide."""
    from arcsplit.errors import DoesNotFit

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    model = _gh(tmp_path)
    req = ServeRequest(model=str(model), gpus="0,1", backend="cpu", mode="rpc", ctx=4096, cpu_memory_mib=234,
                       llama_dir=str(llama_bins.bin_dir))
    with pytest.raises(DoesNotFit):
        preview(req)
    fits = preview(ServeRequest(**{**req.__dict__, "measure": True})).config.plan
    assert fits.n_ctx == 4096 and [c.compute_source for c in fits.offloaded] == ["measured cpu"] * 2
    assert all(c.free_after >= 0 for c in fits.cards)

    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache2"))  # (the split above is measured there now)
    roomier = ServeRequest(**{**req.__dict__, "ctx": None, "cpu_memory_mib": 239})
    formula = preview(roomier).config.plan
    assert formula.n_ctx < 4096 and formula.ctx_limit.startswith("RPC")
    measured = preview(ServeRequest(**{**roomier.__dict__, "measure": True})).config.plan
    assert measured.n_ctx == 4096 and measured.ctx_limit.startswith("the model's training context")

    # a longer training context: each round measures the next context class on the same split while a card,
    # not the training context, stops --ctx max, so the context grows past the class the formulas stopped in
    long = _gh(tmp_path, ctx=32768)
    grow = ServeRequest(**{**roomier.__dict__, "model": str(long), "cpu_memory_mib": 300})
    formula = preview(grow).config.plan
    prepared = preview(grow)
    measured, runs = measure_plan(prepared.profile, prepared.rig, grow, "rpc")
    assert runs >= 2 and memory.ctx_class(measured.n_ctx) > memory.ctx_class(formula.n_ctx)
    assert measured.n_ctx > formula.n_ctx and measured.ctx_limit.startswith("RPC")


@pytest.mark.slow
def test_a_refused_argument_is_named_not_the_usage_line_after_it(llama_bins, demo_model: Path):
    """llama-fit-params ends an argument error with its usage text; the error arcsplit raises names the argument and
    why (the first "error" line), not "to show complete usage, run with -h"."""
    from arcsplit.errors import LlamaError

    with pytest.raises(LlamaError) as err:
        fitparams.fit_print(llama_bins, demo_model, fitparams.RpcServers(llama_bins, 0), ["--device", "NOPE"])
    assert 'error while handling argument "--device": invalid device: NOPE' in str(err.value)
    assert "show complete usage" not in str(err.value)
