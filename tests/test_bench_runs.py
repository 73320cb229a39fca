"""Repeated-run figures of the throughput bench: each run against its own native, spread over runs, runs spread over
several device calls (bench/merge_runs.py), and the one-GPU rig (--same-card). Fixtures: the verbatim logs of the
one-H200 runs in bench/results/gpu/onecard/ (bench/throughput.py's own output on that machine)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ONECARD = ROOT / "bench" / "results" / "gpu" / "onecard"
sys.path.insert(0, str(ROOT / "bench"))

import merge_runs  # noqa: E402
import throughput  # noqa: E402


def test_a_mode_cut_off_by_the_time_limit_is_left_out_of_its_run():
    runs = merge_runs.read_log(ONECARD / "moe_call1.log", reps=5)
    assert len(runs) == 2
    assert list(runs[0]) == ["native", "hybrid", "hybrid-stock", "rpc", "rpc-stock"]
    assert list(runs[1]) == ["native", "hybrid", "hybrid-stock"]  # rpc of run 2 was killed mid-repetitions
    assert runs[0]["rpc"].decode == [480.59, 461.15, 458.30, 491.02, 485.04]  # the warm-up (rep 0) is not kept


def test_merged_ratios_are_per_run_against_that_runs_native(tmp_path):
    out = tmp_path / "merged.md"
    merge_runs.main([str(ONECARD / "moe_call1.log"), str(ONECARD / "moe_call2.log"), "--greedy",
                     str(ONECARD / "throughput_moe_call1.md"), "--title", "t", "--out", str(out)])
    rows = {r.split("|")[1].strip().split(" ")[0]: [c.strip() for c in r.split("|")[1:-1]]
            for r in out.read_text().splitlines() if r.startswith("| ") and "(" in r.split("|")[1]}
    assert rows["native"][1] == "4" and rows["hybrid"][1] == "4" and rows["rpc"][1] == "3"
    runs = [run for log in ("moe_call1.log", "moe_call2.log") for run in merge_runs.read_log(ONECARD / log, 5)]
    decode = sorted(run["rpc"].median("decode") / run["native"].median("decode") for run in runs if "rpc" in run)
    assert rows["rpc"][8] == f"{decode[0]:.2f} / **{decode[1]:.2f}** / {decode[2]:.2f}"
    assert rows["rpc"][10] == "yes (3/3)"  # the greedy check of the result file
    # the figure the fix of issue 19 rests on: all-RPC decode with the patches is not below stock in any run
    stock = [run["rpc-stock"].median("decode") for run in runs if "rpc-stock" in run]
    patched = [run["rpc"].median("decode") for run in runs if "rpc" in run]
    assert min(patched) > max(stock)


def test_same_card_rig_gives_one_gpu_to_every_card_of_a_route(monkeypatch):
    from arcsplit.rig import Card, Rig
    from arcsplit.decide import prepare

    seen = []

    def discover(backend, gpus, *args, **kw):
        seen.append(gpus)
        return Rig(tuple(Card("cuda", g, "H200", 100 << 30, 90 << 30) for g in gpus))

    monkeypatch.setattr(prepare, "discover_rig", discover)
    with throughput.same_card_rig(3, 2):
        shared = prepare.discover_rig("cuda", [0, 1])
        alone = prepare.discover_rig("cuda", [3])
    assert prepare.discover_rig is discover  # put back
    assert [c.index for c in shared.cards] == [3, 3]
    assert all(c.free_bytes == 45 << 30 and c.total_bytes == 50 << 30 for c in shared.cards)
    assert [c.index for c in alone.cards] == [3] and alone.cards[0].free_bytes == 90 << 30
    assert seen == [[3], [3]]


def test_same_card_routes_start_every_process_on_the_one_gpu():
    """The shared rig must get through Route's one-card-once check (a plain [3, 3] is refused, which cost a device
    call on 2026-12-02) and still give every rpc-server and llama-server GPU 3 alone."""
    from arcsplit.errors import BadInput
    from arcsplit.rig import Card
    from arcsplit.route import Route

    with pytest.raises(BadInput, match="twice"):
        Route.build("rpc", "cuda", [3, 3])  # users are still protected
    twins = [throughput._Twin(3), throughput._Twin(3)]
    assert Card("cuda", twins[0], "H200", 1 << 30, 1 << 30).index == 3
    hybrid = Route.build("hybrid", "cuda", twins)
    assert {p.name: (p.devices, dict(p.env)["CUDA_VISIBLE_DEVICES"]) for p in hybrid.processes} == {
        "rpc0": (("RPC0",), "3"), "server": (("CUDA0",), "3")}
    rpc = Route.build("rpc", "cuda", twins)
    assert {p.name: (p.devices, dict(p.env)["CUDA_VISIBLE_DEVICES"]) for p in rpc.processes} == {
        "rpc0": (("RPC0",), "3"), "rpc1": (("RPC1",), "3"), "server": ((), "")}


def test_same_card_needs_one_gpu_card():
    assert throughput.serve_mode("native", "cuda", same_card=True) == ("single", True)
    with pytest.raises(SystemExit):
        throughput.parse(["--backend", "cuda", "--gpus", "0,1", "--same-card"])
    with pytest.raises(SystemExit):
        throughput.parse(["--backend", "cpu", "--gpus", "0", "--same-card"])


def test_a_mode_may_name_its_own_ubatch():
    """native-ub256 / hybrid-ub512: what a route's micro-batch costs, against native at its default."""
    a = throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card"])
    assert throughput.parse_mode("hybrid-nospin-ub512") == throughput.Variant("hybrid", "auto", "nospin", 512)
    assert throughput.serve_kwargs(a, "native-ub256", ())[1]["ubatch"] == 256
    assert throughput.serve_kwargs(a, "hybrid-ub512", ())[1]["ubatch"] == 512
    assert throughput.serve_kwargs(a, "hybrid", ())[1]["ubatch"] is None  # the route's own choice
    assert throughput.serve_kwargs(a, "hybrid-ub512", (), ubatch=256)[1]["ubatch"] == 256  # the greedy check's
    assert throughput.parse_mode("rpc-norelay") == throughput.Variant("rpc", "auto", "norelay")
    for bad in ("native-stock", "hybrid-ub0", "hybrid-ub512-stock", "native-ubx", "native-norelay"):
        with pytest.raises(SystemExit):
            throughput.parse_mode(bad)


def test_a_mode_may_switch_the_shared_memory_link_or_the_prompt_cache_off(monkeypatch):
    """-noshm: the RPC link over loopback TCP (patch 0008 off, in the processes' environment); -nopin, -syncread,
    -gate and -gatenohost likewise; -nocram: llama-server with --cache-ram 0, native included, so an RPC row and
    native can be compared without the prompt cache."""
    from arcsplit.llama.patches import (ASYNC_READ_ENV, GATE_ENV, GATE_HOST_ENV, PINNED_ENV, QUEUED_SETS_ENV,
                                        SHM_ENV)

    for name in (ASYNC_READ_ENV, GATE_ENV, GATE_HOST_ENV, PINNED_ENV, QUEUED_SETS_ENV, SHM_ENV):  # a user may set
        monkeypatch.delenv(name, raising=False)

    a = throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card"])
    assert throughput.parse_mode("hybrid-noshm") == throughput.Variant("hybrid", "auto", "noshm")
    with throughput.mode_env("rpc-noshm"):
        assert os.environ[SHM_ENV] == "0"
    with throughput.mode_env("hybrid-nopin"):  # patch 0001's page-locked reads of llama-server's card, off
        assert os.environ[PINNED_ENV] == "0"
    with throughput.mode_env("hybrid-syncread"):  # patch 0001's queued read of llama-server's card, off
        assert os.environ[ASYNC_READ_ENV] == "0"
    with throughput.mode_env("rpc-syncset"):  # patch 0003's queued sets on the rpc-servers, off
        assert os.environ[QUEUED_SETS_ENV] == "0"
    assert QUEUED_SETS_ENV not in os.environ
    assert PINNED_ENV not in os.environ
    with throughput.mode_env("rpc-gate"):  # gated sets on, host inputs at the patch's own size
        assert os.environ[GATE_ENV] == "1" and GATE_HOST_ENV not in os.environ
    with throughput.mode_env("rpc-gatenohost"):  # ... and host inputs never gated: the A/B of that change
        assert os.environ[GATE_ENV] == "1" and int(os.environ[GATE_HOST_ENV]) >= 1 << 22
    assert GATE_ENV not in os.environ and GATE_HOST_ENV not in os.environ
    for mode in ("native-nocram", "rpc-nocram-ub512"):
        args = throughput.serve_kwargs(a, mode, ())[1]["extra_args"]
        assert args[-2:] == ("--cache-ram", "0"), (mode, args)
    assert "--cache-ram" not in throughput.serve_kwargs(a, "hybrid", ())[1]["extra_args"]
    for bad in ("native-noshm", "hybrid-nocram-noshm"):
        with pytest.raises(SystemExit):
            throughput.parse_mode(bad)


def test_every_mode_but_the_baseline_changes_place_from_run_to_run():
    modes = ["native", "hybrid", "hybrid-noshm", "rpc", "rpc-noshm"]
    orders = [throughput.run_order(modes, k) for k in range(1, 5)]
    assert orders[0] == modes  # run 1 as listed
    assert all(o[0] == "native" and sorted(o) == sorted(modes) for o in orders)
    for m in modes[1:]:  # over 4 runs each other mode takes each of the 4 places once
        assert sorted(o.index(m) for o in orders) == [1, 2, 3, 4]
    assert throughput.run_order(["native"], 3) == ["native"]


SHM2 = ROOT / "bench" / "results" / "gpu" / "shm2"


def test_a_merge_pairs_each_mode_with_its_variant_within_each_run(tmp_path):
    """The shared-memory A/B on one H200 (2026-12-03): a call cut short in run 4, merged from its log. Each
    variant is read against its mode in the same run, and the greedy column is found in a table that ends with
    the ready columns."""
    out = tmp_path / "merged.md"
    merge_runs.main([str(SHM2 / "pipeline_moe.log"), "--greedy", str(SHM2 / "throughput_call1.md"),
                     "--title", "t", "--out", str(out)])
    text = out.read_text()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in text.splitlines() if r.startswith("| ")}
    assert rows["hybrid (hybrid)"][0] == "4" and rows["rpc (rpc)"][0] == "3"  # run 4 ended during rpc
    assert rows["hybrid (hybrid)"][-1] == "yes (3/3)" and rows["rpc-noshm (rpc)"][-1] == "yes (3/3)"
    runs = [run for run in merge_runs.read_log(SHM2 / "pipeline_moe.log", 5) if "rpc" in run]
    pair = sorted(run["rpc"].median("decode") / run["rpc-noshm"].median("decode") for run in runs)
    cell = rows["rpc / rpc-noshm"][1]
    assert cell == f"{pair[0]:.2f} / **{pair[1]:.2f}** / {pair[2]:.2f} (3 of 3)"
    assert rows["hybrid / hybrid-noshm"][1].endswith("(2 of 4)")


def test_twins_are_a_mode_and_its_variant_both_in_the_list():
    assert throughput.twins(["native", "native-ub256", "hybrid", "hybrid-noshm", "rpc-nocram"]) == [
        ("native", "native-ub256"), ("hybrid", "hybrid-noshm")]
    assert throughput.twins(["native", "rpc-gate", "rpc-gatenohost"]) == [("rpc-gate", "rpc-gatenohost")]


def test_a_mode_may_run_on_a_second_build_beside_the_first():
    """-alt: the same mode on --alt-llama-dir's build, in the same runs (a library swapped in, say), paired with
    the mode on the main build; without --alt-llama-dir it is a one-line usage error, before anything runs."""
    a = throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card", "--llama-dir", "/new",
                          "--alt-llama-dir", "/old", "--modes", "native,hybrid,hybrid-alt"])
    assert throughput.parse_mode("hybrid-alt") == throughput.Variant("hybrid", "auto", "alt")
    assert throughput.serve_kwargs(a, "hybrid-alt", ())[1]["llama_dir"] == "/old"
    assert throughput.serve_kwargs(a, "hybrid", ())[1]["llama_dir"] == "/new"
    assert throughput.serve_kwargs(a, "native-alt", ())[1]["llama_dir"] == "/old"
    assert throughput.twins(a.mode_list) == [("hybrid", "hybrid-alt")]
    before = dict(os.environ)
    with throughput.mode_env("hybrid-alt"):  # a build, not a switch: the environment is left as it is
        assert dict(os.environ) == before
    with pytest.raises(SystemExit):
        throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card", "--modes", "native,hybrid-alt"])


def test_one_switch_at_a_time_for_the_all_rpc_prefill_a_b(monkeypatch):
    """-nokvu (a KV stream per slot), -lv3 (llama.cpp's default log verbosity) append llama-server's own flag after
    arcsplit's, so it wins; -card shows an all-RPC llama-server the rpc-servers' card, and only in that mode's
    block: arcsplit hides every card from it."""
    from arcsplit.run import supervisor
    from arcsplit.proc.spec import ProcessSpec

    a = throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card"])
    assert throughput.serve_kwargs(a, "rpc-nokvu", ())[1]["extra_args"][-1:] == ("--no-kv-unified",)
    assert throughput.serve_kwargs(a, "native-lv3", ())[1]["extra_args"][-2:] == ("-lv", "3")
    assert throughput.twins(["native", "rpc", "rpc-nokvu", "rpc-card"]) == [("rpc", "rpc-nokvu"), ("rpc", "rpc-card")]
    for bad in ("hybrid-card", "native-card", "rpc-card-nokvu"):
        with pytest.raises(SystemExit):
            throughput.parse_mode(bad)

    class Config:
        backend = "cuda"

    def specs(config, *args, **kw):
        return (ProcessSpec("rpc0", "rpc", ("rpc",), (("CUDA_VISIBLE_DEVICES", "3"),), "127.0.0.1", 1, (0,)),
                ProcessSpec("server", "server", ("srv",), (("CUDA_VISIBLE_DEVICES", ""),), "127.0.0.1", 2, ()))

    monkeypatch.setattr(supervisor, "build_specs", specs)
    with throughput.mode_env("rpc-card"):
        shown = supervisor.build_specs(Config())
    assert dict(shown[1].env)["CUDA_VISIBLE_DEVICES"] == "3" and shown[0] == specs(Config())[0]
    assert supervisor.build_specs is specs  # put back
    with throughput.mode_env("rpc-nokvu"):
        assert supervisor.build_specs is specs


def test_repetitions_of_one_mode_apart_by_more_than_the_limit_are_named():
    """The all-RPC MoE prefill of 2026-12-06 (3,475 / 15,481 / 3,070 / 16,412 / 3,219 t/s in one run) fails the
    2x check; an ordinary spread (native's 22.7k to 23.0k) passes it."""
    bimodal = throughput.ModeResult("rpc", "rpc", prefill=[3475.0, 15481.0, 3070.0, 16412.0, 3219.0],
                                    decode=[450.0, 460.0], streams=[900.0, 950.0])
    steady = throughput.ModeResult("native", "single", prefill=[22685.0, 22601.9, 22856.1], decode=[205.9, 208.1])
    assert throughput.uneven_reps([[steady, bimodal]], 2.0) == ["run 1, rpc, prefill: 3070.0 to 16412.0 t/s (5.3x)"]
    assert throughput.uneven_reps([[steady], [steady, bimodal]], 6.0) == []


def test_a_token_costs_the_difference_of_the_inverse_speeds_and_ttft_pairs_invert():
    """decode us/token over native is 1e6 / mode's t/s minus 1e6 / native's, per run; in the paired table a TTFT
    reads variant over mode (ms: lower is faster), so above 1 still means the mode is faster."""
    def run(native_d: float, rpc_d: float, rpc_ttft: float, nospan_ttft: float) -> list:
        return [throughput.ModeResult("native", "single", decode=[native_d], ttft=[10.0]),
                throughput.ModeResult("rpc", "rpc", decode=[rpc_d], ttft=[rpc_ttft]),
                throughput.ModeResult("rpc-nospan", "rpc", decode=[rpc_d], ttft=[nospan_ttft])]
    runs = [run(1000.0, 500.0, 20.0, 200.0), run(1000.0, 800.0, 25.0, 100.0)]
    assert [round(x) for x in throughput.token_cost_us(runs, "rpc")] == [1000, 250]
    assert throughput.us_cell(throughput.token_cost_us(runs, "rpc")) == "+250 / **+625** / +1000"
    paired = throughput.paired_table(runs, ["native", "rpc", "rpc-nospan"])
    row = next(line for line in paired if line.startswith("| rpc / rpc-nospan"))
    assert row.split(" | ")[4].startswith("4.00 / **7.00** / 10.00 (2 of 2)"), row


@pytest.mark.slow  # a real ggml-rpc-server of the managed build
def test_a_neighbour_mode_holds_an_idle_rpc_server_for_its_run_and_leaves_nothing(llama_bins):
    """-neighbour: while the mode runs, one idle ggml-rpc-server of the mode's build listens on loopback (holding the
    card, one more MPS client on a GPU); when the mode's block ends it is gone. Native takes the tag too."""
    import psutil

    a = throughput.parse(["--backend", "cpu", "--gpus", "0", "--llama-dir", str(llama_bins.bin_dir),
                          "--modes", "native,native-neighbour"])
    assert throughput.parse_mode("native-neighbour") == throughput.Variant("native", "auto", "neighbour")
    rpc = str(llama_bins.rpc_server)

    def neighbours() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline", "ppid"])
                if (p.info["cmdline"] or [""])[0] == rpc and p.info["ppid"] == os.getpid()]

    assert neighbours() == []
    with throughput.mode_env("native-neighbour", a):
        (proc,) = neighbours()
        listening = [c for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert [c.laddr.ip for c in listening] == ["127.0.0.1"]
    assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    assert neighbours() == []
    with pytest.raises(SystemExit, match="-neighbour"):
        throughput.mode_env("native-neighbour")  # the trace bench passes no arguments: one line, nothing started


def test_graph_spans_reads_a_kept_light_trace_and_sums_each_mode_against_native(tmp_path, capsys):
    """bench/graph_spans.py on the H100 light trace kept in bench/results (MoE, native and all-RPC under MPS): a row
    per process that ran graphs (all-RPC's llama-server ran none), and each mode's summed median span against
    native's. A folder without kept records is one line and a non-zero exit."""
    import graph_spans

    raw = ROOT / "bench/results/gpu/ttft/raw_moe16x32_mps_gate_queued"
    assert graph_spans.main([str(raw)]) == 0
    out = capsys.readouterr().out
    assert [m.group(1, 2) for m in re.finditer(r"^\| (\w+) \| (\w+) \| 60 \|", out, re.M)] == [
        ("native", "server"), ("rpc", "rpc0"), ("rpc", "rpc1")]
    native, rpc = (float(x) for x in re.findall(r"^- (?:native|rpc): (\d+) us", out, re.M))
    assert rpc > native and re.search(r"^- rpc: \d+ us \(\+\d+\)$", out, re.M)
    with pytest.raises(SystemExit, match="no MODE_PROCESS"):
        graph_spans.main([str(tmp_path)])


def test_the_embeddings_mode_moves_token_embd_to_the_first_rpc_server_and_nopp_moves_nothing():
    """-embd: llama-server's argv gets an -ot naming the first rpc-server's buffer type (RPC0[endpoint], as
    ggml-rpc.cpp names it); -nopp one onto the card that holds the output norm anyway (the last). Only all-RPC has a
    first rpc-server holding the first layers, so hybrid-embd is refused."""
    assert throughput.parse_mode("rpc-embd") == throughput.Variant("rpc", "auto", "embd")
    assert throughput.parse_mode("hybrid-nopp") == throughput.Variant("hybrid", "auto", "nopp")
    with pytest.raises(SystemExit, match="-embd"):
        throughput.parse_mode("hybrid-embd")
    argv = ["llama-server", "--rpc", "127.0.0.1:5001,127.0.0.1:5002", "--device", "RPC0,RPC1"]
    assert throughput.override_args(argv, "embd")[-2:] == ["-ot", r"^token_embd\.weight$=RPC0[127.0.0.1:5001]"]
    assert throughput.override_args(argv, "nopp")[-2:] == ["-ot", r"^output_norm\.weight$=RPC0[127.0.0.1:5002]"]
    assert argv[-1] == "RPC0,RPC1"  # the spec's own argv is left as it was
    a = throughput.parse(["--backend", "cuda", "--gpus", "0", "--same-card"])
    assert throughput.serve_kwargs(a, "native-bs", ())[1]["extra_args"][-1] == "--backend-sampling"


def test_graph_spans_kernels_sums_each_kernel_name_per_token_inside_the_last_burst(tmp_path, capsys):
    """--kernels on full-trace records (a K line per kernel, as bench/gpu/cupti_trace.c writes them): only the last
    burst of GPU work counts (a warm-up a second earlier does not), names lose their template arguments, and each
    mode's per-name time per token is set against native's."""
    import gzip

    import graph_spans

    def write(name: str, kernels: list[tuple[int, int, str]]) -> None:
        with gzip.open(tmp_path / name, "wt") as fh:
            for s, e, k in kernels:
                fh.write(f"K\t{s}\t{e}\t7\t1\tvoid {k}<float, 4>(float const*)\n")

    warm = [(0, 50_000, "mul_mat_vec")]  # 2 s before the request: not in the burst
    t0 = 2_000_000_000
    write("native_server.tsv.gz", warm + [(t0 + i * 20_000, t0 + i * 20_000 + 10_000, "mul_mat_vec")
                                          for i in range(4)])
    write("rpc_rpc0.tsv.gz", warm + [(t0 + i * 40_000, t0 + i * 40_000 + 6_000, "mul_mat_vec") for i in range(4)])
    write("rpc_rpc1.tsv.gz", [(t0 + 10_000 + i * 40_000, t0 + 10_000 + i * 40_000 + 6_000, "mul_mat_vec")
                              for i in range(4)] + [(t0 + 200_000, t0 + 202_000, "k_get_rows")])
    assert graph_spans.main([str(tmp_path), "--kernels", "--tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "| native | server | 2 | 20.0 | 0.0 |" in out  # 4 kernels of 10 us over 2 tokens
    assert "| rpc | rpc0 | 2 | 12.0 | 0.0 |" in out and "| rpc | rpc1 | 2 | 13.0 | 0.0 |" in out
    assert "| `mul_mat_vec` | 20.0 | 24.0 | +4.0 |" in out and "| `k_get_rows` | 0.0 | 1.0 | +1.0 |" in out
    assert "total +5.0 us" in out


def test_rpc_trace_extra_adds_a_patched_row_per_mode_with_the_flags(tmp_path, monkeypatch):
    """--extra=FLAGS: each mode gets a third row, patches on, its llama-server run with FLAGS (what the
    backend-sampling figure in docs/patches.md came from); without it, the two rows as before."""
    import rpc_trace

    calls = []

    def fake_measure(model, mode, stock, tokens, extra=()):
        calls.append((mode, stock, extra))
        return {"rpc1": ({"get_tensor": 1.0}, {"get_tensor": 14.0 if extra else 986895.0})}

    monkeypatch.setattr(rpc_trace, "measure", fake_measure)
    out = tmp_path / "t.md"
    assert rpc_trace.main(["--model", "m.gguf", "--modes", "rpc", "--extra=--backend-sampling", "--out", str(out)]) == 0
    assert calls == [("rpc", True, ()), ("rpc", False, ()), ("rpc", False, ("--backend-sampling",))]
    assert "| rpc | on, `--backend-sampling` | rpc1 | get_tensor 1.0 | 0 | 14 |" in out.read_text()
    calls.clear()
    assert rpc_trace.main(["--model", "m.gguf", "--modes", "rpc", "--out", str(out)]) == 0
    assert [c[1] for c in calls] == [True, False]
