"""``arcsplit doctor``: is this machine's GPU runtime able to run one model across these cards, and if not, what to do.

Written for users like the reporter of ggml-org/llama.cpp#22885, who spent hours learning that "failed to allocate SYCL0 buffer" on two Arc
cards is NEO >= 26.05 on a kernel < 7.1, not a lack of memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from .. import backends, durations
from ..errors import ArcsplitError, BadInput
from ..llama import detect
from ..llama.detect import BackendChoice, is_integrated
from ..llama.hostcheck import Check, host_checks
from ..llama.devices import discover_rig, parse_gpus
from ..llama.facts import parse_sycl_ls, read_text
from ..llama.locate import find_llama
from ..llama.logs import PINNED_OUTPUT_ENV
from ..llama.patches import build_patches
from ..llama.mode import NEO_WORKAROUND_ENV
from ..modes import MODES, Mode
from ..proc.rundir import newest_run, read_state
from ..llama.probe import DEFAULT_TIMEOUT_S, ProbeResult
from ..llama.runtime import RuntimeReport, check_runtime
from . import print_json, say
from .options import add_llama_dir

_STATUS = {"good": "known good", "bad": "KNOWN BAD", "unknown": "unknown"}
_CHECK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "-"}


# Vulkan against SYCL at generation on Arc, as reported: faster in some (llama.cpp #26010: 20.1 vs 7.0 t/s, Gemma 4,
# -fa on; #22413: 2x B580), slower in others (kyuz0/ai-toolbox-cockpit#9: Q6_K 5x slower on a B50; a single B70,
# Qwen2.5-1.5B Q4_K_M: 102 vs 229 t/s in PMZFX/intel-arc-pro-b70-benchmarks). docs/runtime.md has the trade.
VULKAN_TRADE = ("generation speed against SYCL depends on the model and quant: 2.9x faster (llama.cpp#26010) to 5x "
                "slower (Q6_K) in users' reports; measure yours with llama-bench")


def _vulkan_remedy(gpus: str, vulkan: str | None) -> dict[str, str]:
    if vulkan == "works":
        return {"title": "Vulkan backend, one context: Mesa's driver, not NEO, so the bug does not apply; its probe "
                         f"worked here ({VULKAN_TRADE})",
                "command": f"arcsplit serve model.gguf --gpus {gpus} --backend vulkan --mode multi"}
    build = "" if vulkan in ("built", "fails") else "arcsplit llama build --backend vulkan && "
    what = "its probe failed here too" if vulkan == "fails" else "not probed: `arcsplit doctor --reprobe` after building"
    return {"title": f"Vulkan backend: a different driver stack (Mesa), not NEO; {what} ({VULKAN_TRADE})",
            "command": f"{build}arcsplit serve model.gguf --gpus {gpus} --backend vulkan"}


def remedies(report: RuntimeReport, vulkan: str | None = None) -> list[dict[str, str]]:
    """Ordered fixes for a broken multi-device context: the best first, each with the exact command.

    ``vulkan``: the Vulkan route here, "works"/"fails" (probed), "built" (not probed) or None (no Vulkan build). One
    Vulkan context that probed fine comes before hybrid: no RPC hop, and the reports put it anywhere from 5x slower
    to 2.9x faster than SYCL (see VULKAN_TRADE); hybrid's cost (~0.87x of SYCL's one context) is known.
    """
    if not report.multi_broken:
        return []
    gpus = ",".join(str(g) for g in report.gpus) or "0,1"
    out: list[dict[str, str]] = []
    multi = report.multi_probe
    if multi is not None and multi.status == "pinned_output":
        # Not NEO or the kernel: llama.cpp's pinned output buffer sits on device 0 (ggml-org/llama.cpp#28765).
        return [
            {"title": "llama.cpp bug #28765 (builds with PR #26789 and without its fix, PR #28895): use a llama.cpp "
                      "with the fix; arcsplit's managed build has it",
             "command": f"arcsplit llama build --backend sycl && arcsplit serve model.gguf --gpus {gpus} --backend sycl"},
            {"title": "Its workaround: no pinned host memory for outputs",
             "command": f"{PINNED_OUTPUT_ENV}=0 arcsplit serve model.gguf --gpus {gpus}"},
            {"title": "Hybrid: llama-server holds only card 0, where the bug does not strike",
             "command": f"arcsplit serve model.gguf --gpus {gpus} --mode hybrid"},
        ]
    if report.backend == backends.SYCL:
        env = " ".join(f"{k}={v}" for k, v in (report.verdict.env or NEO_WORKAROUND_ENV).items())
        out += [
            {"title": "Update NEO past 26.27.39122 (Intel's own fix, compute-runtime e91243a9d0, first in 26.27.39122.10; "
                      "26.27.39122 itself segfaults, intel/compute-runtime#971)",
             "command": "install intel-opencl-icd and libze-intel-gpu1 26.31 or later from "
                        "https://github.com/intel/compute-runtime/releases, then `arcsplit doctor --reprobe`"},
            {"title": "Run Linux >= 7.1 (the kernel fix: drm/xe dma-buf, torvalds/linux 609fc8766d68; intel/compute-runtime#916)",
             "command": "uname -r   # then install your distribution's 7.1+ kernel and reboot"},
            {"title": "Intel's workaround: NEO debug keys that turn off peer access, keeping one context",
             "command": f"{env} llama-server ...   # or: arcsplit serve model.gguf --gpus {gpus} --mode multi+workaround"},
            *([_vulkan_remedy(gpus, vulkan)] if vulkan == "works" else []),
            {"title": "Hybrid: card 0 in llama-server, one rpc-server per other card (~0.87x decode)",
             "command": f"arcsplit serve model.gguf --gpus {gpus} --mode hybrid"},
            {"title": "All-RPC: one rpc-server per card, each ONEAPI_DEVICE_SELECTOR=level_zero:N (~0.75x decode)",
             "command": f"arcsplit serve model.gguf --gpus {gpus} --mode rpc"},
            {"title": "Downgrade NEO to 25.40.35563.10, the last known good (what llama.cpp's Intel image pins, #22968; "
                      "~20% slower decode, #23160)",
             "command": "install libze-intel-gpu1 and intel-opencl-icd 25.40.35563.10 (with IGC 2.20.5) from "
                        "https://github.com/intel/compute-runtime/releases/tag/25.40.35563.10"},
            *([] if vulkan == "works" else [_vulkan_remedy(gpus, vulkan)]),
        ]
    else:
        out += [
            {"title": "Hybrid: card 0 in llama-server, one rpc-server per other card",
             "command": f"arcsplit serve model.gguf --gpus {gpus} --backend {report.backend} --mode hybrid"},
            {"title": "All-RPC: one rpc-server per card",
             "command": f"arcsplit serve model.gguf --gpus {gpus} --backend {report.backend} --mode rpc"},
        ]
    return out


def _vulkan_route(args: argparse.Namespace, report: RuntimeReport, offline: bool) -> tuple[str | None, ProbeResult | None]:
    """When SYCL's one context is broken here and a Vulkan build exists, probe Vulkan's one context like the others."""
    if report.backend != backends.SYCL or not report.multi_broken or len(report.gpus) < 2:
        return None, None
    try:
        vk = find_llama(args.llama_dir, backend=backends.VULKAN)
    except ArcsplitError:
        return None, None
    if vk.found_by != "managed" and backends.VULKAN not in detect.build_backends(vk.bin_dir):
        return None, None  # the located build is not a Vulkan one
    if offline or args.no_probe:
        return "built", None
    vr = check_runtime(backends.VULKAN, list(report.gpus), vk, reprobe=args.reprobe, probe=True, timeout=args.timeout,
                       sysfs_root=detect.SYSFS_ROOT, progress=say)
    multi = next((p for p in vr.probes if p.mode == Mode.MULTI), None)
    return ("built" if multi is None else "works" if multi.ok else "fails"), multi


def _cards(args: argparse.Namespace, backend: str, gpus: list[int] | None, binaries: Any) -> tuple[list[int], list[str], str | None]:
    """(gpus, card labels for the cache key and the report, note). Discovery failing is a finding, not a crash."""
    if args.sycl_ls is not None:
        devs = [d for d in parse_sycl_ls(read_text(args.sycl_ls, "sycl-ls"))
                if d.backend == "level_zero" and d.type == "gpu"]
        labels = [f"level_zero:{d.index if d.index is not None else i} {d.name}" for i, d in enumerate(devs)]
        return (gpus if gpus is not None else list(range(len(devs)))), labels, None
    try:
        rig = discover_rig(backend, gpus, binaries)
    except ArcsplitError as exc:
        if gpus is None:
            return [0], [], f"cards: {exc}"
        return gpus, [], f"cards: {exc}"
    return [c.index for c in rig.cards], [f"{c.index}: {c.name}" for c in rig.cards], None


def _doctor(args: argparse.Namespace) -> int:
    data, text = diagnose(args)
    if args.verify:
        data["verify"], lines = _verify(args, data)
        text += "\n\n" + "\n".join(lines)
    if args.json:
        print_json(data)
    else:
        print(text)
    return 0


def _verify(args: argparse.Namespace, data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """--verify MODEL: each route's output against a reference (docs/tune.md), and what tune kept for this rig.
    Rigs of 3+ cards need it before a one-context route is trusted (intel/compute-runtime#942, #957)."""
    from ..tuning import picks, runner  # start-up: the serving stack and httpx, only with --verify

    req = runner.ServeRequest(model=args.verify, gpus=args.gpus, backend=args.backend, llama_dir=args.llama_dir,
                              build=args.build)
    results = runner.verify_routes(req, say=say)
    lines = [f"output check with {args.verify} (greedy tokens against a reference; docs/tune.md):"]
    lines += [f"  {r['label']:<40} {'WRONG' if r['status'] == 'wrong' else r['status']:<9} {r.get('reason', '')[:100]}"
              for r in results]
    return results, lines + picks.summary(req)


def diagnose(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The doctor's findings as --json data and as text (``arcsplit report`` bundles both)."""
    backend = args.backend
    choice: BackendChoice | None = None
    if backend == backends.AUTO:  # a pasted sycl-ls or kernel is about the Intel case
        offline = args.sycl_ls or args.kernel or args.kernel_config
        if offline:
            backend = backends.SYCL
        else:
            backend, choice = detect.resolve(backend, args.llama_dir, purpose="check")
    gpus = parse_gpus(args.gpus)
    for opt, value in (("--sycl-ls", args.sycl_ls), ("--kernel-config", args.kernel_config)):
        if value is not None and not Path(value).is_file():
            raise BadInput(f"{opt} {value} is not a file", "pass the path of a saved output file")
    binaries = None
    try:
        binaries = find_llama(args.llama_dir, backend=backend, build=args.build)
    except ArcsplitError:
        if args.llama_dir:
            raise
    gpus_used, labels, card_note = _cards(args, backend, gpus, binaries)
    report = check_runtime(backend, gpus_used, binaries, reprobe=args.reprobe,
                           probe=False if args.no_probe else (True if args.reprobe else None), forced=args.mode,
                           sycl_ls_file=args.sycl_ls, kernel=args.kernel, kernel_config=args.kernel_config,
                           timeout=args.timeout, cards=labels, sysfs_root=detect.SYSFS_ROOT, progress=say)
    offline = args.sycl_ls or args.kernel or args.kernel_config  # another machine's files: this host is not it
    vulkan, vulkan_probe = _vulkan_route(args, report, bool(offline))
    fixes = remedies(report, vulkan)
    applied = build_patches(binaries.bin_dir) if binaries is not None else None
    host = [] if offline else host_checks(backend, [c for c in report.facts.cards if c.vendor and not is_integrated(c)],
                                          binaries.bin_dir if binaries is not None else None, sysfs=detect.SYSFS_ROOT)
    data = report.to_dict()
    data["remedies"] = fixes
    data["llama_patches"] = applied
    data["build_command"] = f"arcsplit llama build --backend {backend}" if binaries is None else None
    data["detected"] = None if choice is None else {"reason": choice.reason, "notes": list(choice.notes)}
    data["host"] = [c.to_dict() for c in host]
    data["vulkan"] = {"route": vulkan, "probe": vulkan_probe.to_dict() if vulkan_probe else None}
    if card_note:
        data["facts"]["unread"] = [*data["facts"]["unread"], card_note]  # to_dict's is a tuple
    text = _render(report, labels, card_note, fixes, applied, choice, host, vulkan_probe, data["build_command"])
    data["resets"], reset_text = (None, "") if offline else _last_run_resets()
    return data, text + reset_text


def _last_run_resets() -> tuple[dict[str, Any] | None, str]:
    """The cards the last run here lost again and again, from its state file (run/faults.py writes them): each
    needs a driver reset, and the line says how. (None, "") when it lost none that often."""
    run = newest_run()
    state = read_state(run) if run is not None else None
    cards = [r for r in (state or {}).get("resets") or [] if isinstance(r, dict)]
    if run is None or not cards:
        return None, ""
    lines = ["", "", f"Cards that need a driver reset (arcsplit run {run.name})"]
    return {"run": run.name, "cards": cards}, "\n".join(lines + [f"  {r.get('line')}" for r in cards])


def _render(r: RuntimeReport, labels: list[str], card_note: str | None, fixes: list[dict[str, str]],
            applied: list[str] | None = None, choice: BackendChoice | None = None, host: Sequence[Check] = (),
            vulkan_probe: ProbeResult | None = None, build_command: str | None = None) -> str:
    f = r.facts
    lines = [f"arcsplit doctor: backend {r.backend}, cards {','.join(map(str, r.gpus)) or '-'}"]
    if choice is not None:
        lines += [f"  auto: {choice.reason}"] + [f"  note: {n}" for n in choice.notes]
    lines += ["", "Facts"]
    row = lambda k, v: lines.append(f"  {k:<22} {v}")  # noqa: E731
    if r.backend == backends.SYCL or f.neo:
        row("NEO (compute-runtime)", f"{f.neo.label}   [{f.neo.source}]" if f.neo else "not read")
        for extra in f.neo_readings[1:]:
            if f.neo is not None and extra.build != f.neo.build:
                row("", f"but {extra.label}   [{extra.source}]")
        row("Level Zero loader", f.level_zero_loader or "not read")
        row("oneAPI", f.oneapi or "not read")
    k = f.kernel
    notify = {True: "CONFIG_DMABUF_MOVE_NOTIFY=y", False: "CONFIG_DMABUF_MOVE_NOTIFY is not set",
              None: "CONFIG_DMABUF_MOVE_NOTIFY unknown"}[k.move_notify]
    row("kernel", f"{k.release or 'not read'}, {notify}" + (f" ({k.config_source})" if k.config_source else ""))
    if k.xe_module or k.xe_backport:
        row("xe module", f"{k.xe_module or 'version not read'}" + (
            ", an out-of-tree (DKMS) build: the driver may be newer than the kernel (intel-gpu/xekmd-backports#451)"
            if k.xe_backport else ", the kernel's own"))
    if build_command:  # nothing serves without one: the command that makes it, where the build would be
        row("llama.cpp", f"no build found: run `{build_command}`")
    else:
        row("llama.cpp", f.llama_build or "not read")
        row("arcsplit patches", ", ".join(applied) if applied else
            ("none (stock build; docs/patches.md)" if applied == [] else "unknown (not an arcsplit build; docs/patches.md)"))
    for c in f.cards:
        row(f"sysfs {c.drm}", f"{c.pci_id or '?'} {c.name or ''} driver {c.driver or '?'} {c.pci_slot or ''}".strip())
    for label in labels:
        row("card", label)
    unread = [u for u in f.unread if not (build_command and u.startswith("llama.cpp build:"))]  # said above
    unread += [card_note] if card_note else []
    if unread:
        lines.append("  could not read:")
        lines += [f"    - {u}" for u in unread]
    lines += [f"  note: {n}" for n in f.notes]
    if host:
        lines += ["", "Host"]
        for check in host:
            lines.append(f"  {check.name:<22} {_CHECK[check.status]:<5} {check.detail}")
            if check.fix:
                lines.append(f"  {'':<22}       fix: {check.fix}")
    v = r.verdict
    lines += ["", f"Verdict from versions: {_STATUS[v.status]}  (rule {v.rule})", f"  {v.summary}"]
    if v.sources:
        lines.append(f"  sources: {', '.join(v.sources)}")
    if r.disagreement:
        lines.append(f"  note: {r.disagreement}")
    if r.env_dropped:
        lines += ["", "Environment arcsplit changes for llama.cpp's processes (ARCSPLIT_KEEP_ENV=VAR keeps one)"]
        lines += [f"  - {d.line()}" for d in r.env_dropped]
    lines += ["", "Probe" + (f" ({'cached' if r.probe_cached else 'run'} {r.probed_at}"
                             + ("; --reprobe for a new one" if r.probe_cached else "") + ")" if r.probed_at else "")]
    if r.probe_note:
        lines.append(f"  {r.probe_note}")
    for p in r.probes:
        env = " with " + " ".join(f"{a}={b}" for a, b in p.env) if p.env else ""
        lines.append(f"  {p.mode:<17} {'works' if p.ok else 'FAILS'}  {p.status}: {p.detail}  ({p.seconds:.1f} s{env})")
    if vulkan_probe is not None:
        p = vulkan_probe
        lines.append(f"  {'vulkan multi':<17} {'works' if p.ok else 'FAILS'}  {p.status}: {p.detail}  ({p.seconds:.1f} s)")
    d = r.decision
    lines += ["", f"Mode: {d.mode}" + ("  (verified by the probe)" if d.verified else "")]
    if d.env:
        lines.append("  env: " + " ".join(f"{a}={b}" for a, b in d.env.items()))
    lines += [f"  - {reason}" for reason in d.reasons]
    if fixes:
        multi = r.multi_probe
        what = ("llama.cpp fails copying the output off a card other than 0 (not the NEO/kernel bug)"
                if multi is not None and multi.status == "pinned_output" else "The multi-device context is broken here")
        lines += ["", f"{what}. Remedies, best first:"]
        for i, fx in enumerate(fixes, 1):
            lines += [f"  {i}. {fx['title']}", f"       {fx['command']}"]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the GPU runtime for multi-card use and say what to do",
                       description="Gather runtime facts (NEO, Level Zero, oneAPI, kernel, cards, llama.cpp build), judge "
                                   "them against known-bad runtimes, probe the real llama.cpp on the cards, and pick the "
                                   "fastest mode that works. For a bug report, pass saved outputs with --sycl-ls, "
                                   "--kernel and --kernel-config.")
    p.add_argument("--backend", choices=backends.choices(), default=backends.AUTO,
                   help="ggml backend (default auto: what serve would pick here; sycl for Intel Arc cards)")
    p.add_argument("--gpus", metavar="LIST", help="cards to check, e.g. 0,1 (default: all)")
    p.add_argument("--mode", choices=MODES, help="show the decision for a forced mode")
    add_llama_dir(p)
    p.add_argument("--sycl-ls", metavar="FILE", help="read sycl-ls output from FILE (e.g. from a bug report)")
    p.add_argument("--kernel", metavar="VERSION", help="judge this kernel version (uname -r) instead of this machine's")
    p.add_argument("--kernel-config", metavar="FILE", help="kernel config file to read CONFIG_DMABUF_MOVE_NOTIFY from")
    p.add_argument("--reprobe", action="store_true", help="ignore the cached probe and run a new one")
    p.add_argument("--no-probe", action="store_true", help="versions only, run nothing")
    p.add_argument("--timeout", type=durations.argtype("--timeout"), default=DEFAULT_TIMEOUT_S, metavar="TIME",
                   help=f"limit of each probe: {durations.HELP} (default {durations.format_s(DEFAULT_TIMEOUT_S)})")
    p.add_argument("--verify", metavar="MODEL",
                   help="also serve MODEL on every route and check its output against a reference (the whole model "
                        "on one card, else the routes' agreement): a route that loads but computes wrong is named")
    p.add_argument("--json", action="store_true", help="machine-readable output (verdict, mode, reasons, facts, ...)")
    p.set_defaults(func=_doctor)
