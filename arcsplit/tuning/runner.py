"""``arcsplit tune``: start each candidate route through the supervisor, check its output, measure it, pick.

Routes first, at their default settings, in the fixed default order; then one setting at a time on the fastest
correct route. Each candidate is planned first (the planner's memory bounds prune what does not fit: nothing
over-commits a card), served with ``arcsplit.serve`` on free ports, sampled for correctness (tuning/verify.py),
measured within ``per_candidate_s`` (tuning/measure.py), stopped, and its result kept at once under the rig's
fingerprint: an interrupted or budget-limited run resumes where it stopped. The reference for correctness is the
whole model on one card where it fits there, else the agreement of the other routes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import httpx

from .. import backends
from .._api import serve
from ..errors import ArcsplitError, BadInput, arg, given
from ..decide.prepare import Prepared, ServeRequest, plan_for_mode, preview
from ..llama.answers import run_flag
from ..llama.build import managed_builds
from ..llama.features import parse_help
from ..llama.locate import LlamaBinaries, find_llama
from ..modes import AUTO, Mode
from ..objectives import OBJECTIVES, better_first, unit
from ..proc.ports import free_port
from ..rig import Rig
from ..route import NATIVE_UBATCH, Route
from . import fingerprint as fpmod
from . import verify
from .candidates import (DEBUG_KEY, BuildFacts, Candidate, Outcome, Settings, rank, routes,
                         settings_variants, split_modes)
from .measure import measure_all
from .picks import fingerprint_of, label, measured, request_for
from .result import TuneResult

Say = Callable[[str], None]
DONE = (Outcome.OK, Outcome.WRONG, Outcome.FAILED, Outcome.PRUNED)  # results a later run reuses


@dataclass(frozen=True)
class TuneRequest:
    serve: ServeRequest
    objective: str = "decode"  # decode | prefill | streams (throughput at serve.parallel streams) | ttft (ms)
    budget_s: float = 300.0  # the whole run, start-ups included
    per_candidate_s: float = 15.0  # measuring one started candidate
    settings: bool = True  # after the routes, vary settings on the best one
    fresh: bool = False  # ignore results kept for this fingerprint


@dataclass
class TuneReport:
    fingerprint: fpmod.Fingerprint
    objective: str
    results: dict[str, dict[str, Any]]
    order: list[str]  # candidate keys in the order tried
    default: str | None  # what serve runs untuned (mode auto, default settings)
    pick: str | None
    reused: int = 0  # results read from the cache instead of measured
    not_tried: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint.to_dict(), "objective": self.objective, "pick": self.pick,
                "default": self.default, "reused": self.reused, "not_tried": self.not_tried, "wall_s": self.wall_s,
                "results": [{k: v for k, v in self.results[key].items() if k != "sample"} for key in self.order
                            if key in self.results]}

    def result(self) -> TuneResult:
        """The frozen view ``arcsplit.tune()`` returns."""
        rows = {k: measured(self.results[k], k, self.pick, self.default, self.objective) for k in self.order
                if k in self.results}
        return TuneResult(self.objective, tuple(rows.values()), rows.get(self.pick or ""),
                          rows.get(self.default or ""), self.wall_s, self.reused, tuple(self.not_tried),
                          self.fingerprint.digest)


def build_facts(backend: str, binaries: LlamaBinaries) -> BuildFacts:
    """-sm tensor and --backend-sampling where llama-server's --help lists them; a Vulkan build beside a GPU
    backend's."""
    try:
        help_text = run_flag(binaries.server, "--help", "check the llama.cpp build")[0]
    except ArcsplitError:  # an unreadable --help only loses the tensor candidates
        help_text = ""
    vulkan = backend != backends.VULKAN and not backends.get(backend).on_cpu and bool(managed_builds(backends.VULKAN))
    return BuildFacts(tensor_split="tensor" in split_modes(help_text), vulkan=vulkan,
                      backend_sampling=parse_help(help_text).has("--backend-sampling"))


def default_key(p: Prepared, cands: list[Candidate]) -> str | None:
    """The candidate serve runs untuned: the mode auto picks, default settings, output layer auto."""
    mode = p.decision.mode
    for c in cands:
        if c.mode == mode and not c.one_card and c.split == "layer" and c.output_layer in ("auto", "last") \
                and c.backend == p.request.backend:
            return c.key
    return None


def plan_check(p: Prepared, c: Candidate) -> tuple[str | None, dict[str, Any]]:
    """(why it is pruned or None, what its plan chose): the planner's bounds, before any process starts."""
    req = request_for(replace(p.request, mode=AUTO), c, p.rig)
    try:
        if c.backend != p.request.backend:
            plan = preview(req).config.plan
        else:
            rig = Rig(p.rig.cards[:1], p.rig.name) if c.one_card else p.rig
            plan = plan_for_mode(p.profile, rig, req, c.mode)
            Route.build(c.mode, c.backend, [card.index for card in rig.cards])
    except ArcsplitError as exc:
        return exc.problem if hasattr(exc, "problem") else str(exc), {}
    o = plan.options
    return None, {"ubatch": o.n_ubatch, "flash_attn": o.flash_attn, "moe_offload": o.moe_offload or 0,
                  "n_ctx": plan.n_ctx}


def serve_options(req: ServeRequest) -> dict[str, Any]:
    """``req`` as arcsplit.serve's keyword arguments (its ServeRequest fields but model and gpus)."""
    return {f.name: getattr(req, f.name) for f in fields(req) if f.name not in ("model", "gpus")}


def run_candidate(p: Prepared, c: Candidate, budget_s: float, reference: verify.Sample | None,
                  measure: bool = True) -> dict[str, Any]:
    """Serve ``c``, sample its output, and (unless it disagrees with ``reference``, or not ``measure``) measure
    it; always stopped."""
    req = replace(request_for(p.request, c, p.rig), port=free_port(), rpc_ports=None)
    out: dict[str, Any] = {"candidate": c.to_dict(), "label": label(c)}
    t0 = time.monotonic()
    try:
        # one retry covers a transient start failure (a port taken meanwhile); a candidate that cannot load (llama.cpp
        # refuses -sm tensor without flash attention) is then failed at once, not after serve's five restarts
        with serve(req.model, req.gpus, bus=False, max_restarts=1, **{**serve_options(req), "canary": False}) as server, \
                httpx.Client(timeout=120.0) as client:
            out["ready_s"] = round(time.monotonic() - t0, 2)
            out["argv"] = list(server.status()["processes"]["server"].get("argv", []))
            sample = verify.sample(client, server.url)
            out["sample"] = verify.to_json(sample)
            check = verify.compare(reference, sample) if reference is not None else None
            if check is not None and not check.ok:
                return {**out, "status": Outcome.WRONG, "reason": check.reason}
            if not measure:
                return {**out, "status": Outcome.OK if check else Outcome.UNCHECKED,
                        "reason": check.reason if check else ""}
            figs = measure_all(client, server.url, budget_s, streams=req.parallel)
    except ArcsplitError as exc:
        return {**out, "status": Outcome.FAILED, "reason": str(exc)}
    except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:  # the group died or answered nonsense
        return {**out, "status": Outcome.FAILED,
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    status = Outcome.OK if check is not None else Outcome.UNCHECKED
    return {**out, "status": status, "reason": check.reason if check else "", "prefill": round(figs.prefill, 2),
            "decode": round(figs.decode, 2), "streams": round(figs.streams, 2), "ttft": round(figs.ttft, 1),
            "reps": figs.reps,
            "noise": round(check.noise, 3) if check else None}


class _Run:
    """One tune run's state: the budget, the results kept so far, the reference sample."""

    def __init__(self, p: Prepared, treq: TuneRequest, report: TuneReport, say: Say, t0: float) -> None:
        self.p, self.treq, self.report, self.say, self.t0 = p, treq, report, say, t0
        self.starts: list[float] = []
        self.reference: verify.Sample | None = None
        self.reference_key: str | None = None

    def keep(self) -> None:
        r = self.report
        old = fpmod.load(r.fingerprint)
        picks = dict(old.get("picks") or {})
        if r.pick:
            picks[r.objective] = r.pick
        fpmod.store(r.fingerprint, {"results": r.results, "picks": picks, "objective": r.objective,
                                    "default": r.default})

    def estimate(self) -> float:
        start = sum(self.starts) / len(self.starts) if self.starts else 15.0
        return start + self.treq.per_candidate_s + 5.0

    def try_all(self, cands: list[Candidate], phase: str) -> None:
        for i, c in enumerate(cands, 1):
            self.one(c, f"{phase} {i}/{len(cands)}")

    def one(self, c: Candidate, where: str) -> None:
        r = self.report
        if c.key in r.order:
            return
        r.order.append(c.key)
        had = r.results.get(c.key)
        # a correct result kept before tune measured this objective's figure (ttft) is measured again
        if had and had.get("status") in DONE and not self.treq.fresh \
                and (had.get("status") != Outcome.OK or self.treq.objective in had):
            r.reused += 1
            self.adopt(c, had)
            self.say(f"{where} {label(c)}: {line(had)} (kept from an earlier run)")
            return
        why, planned = plan_check(self.p, c)
        if why:
            r.results[c.key] = {"candidate": c.to_dict(), "label": label(c), "status": Outcome.PRUNED, "reason": why}
            self.say(f"{where} {label(c)}: skipped, the planner says: {why}")
            self.keep()
            return
        if time.monotonic() - self.t0 + self.estimate() > self.treq.budget_s:
            r.not_tried.append(c.key)
            r.order.remove(c.key)
            self.say(f"{where} {label(c)}: not tried, --budget {self.treq.budget_s:.0f} s would be exceeded")
            return
        self.say(f"{where} {label(c)}: starting")
        res = {**run_candidate(self.p, c, self.treq.per_candidate_s, self.reference), "planned": planned}
        if "ready_s" in res:
            self.starts.append(float(res["ready_s"]))
        r.results[c.key] = res
        self.adopt(c, res)
        self.say(f"{where} {label(c)}: {line(res)}")
        self.keep()

    def adopt(self, c: Candidate, res: dict[str, Any]) -> None:
        """The first whole-model-on-one-card result that ran is the reference for every later candidate."""
        if self.reference is None and res.get("sample") and (c.one_card or c.mode is Mode.SINGLE) \
                and res.get("status") in (Outcome.OK, Outcome.UNCHECKED):
            self.reference, self.reference_key = verify.from_json(res["sample"]), c.key
            res["status"], res["reason"] = Outcome.OK, "reference (the whole model on one card)"


def line(res: dict[str, Any]) -> str:
    """One progress line's verdict for a result."""
    st = res.get("status")
    if st in (Outcome.OK, Outcome.UNCHECKED) and "decode" not in res:
        return "correct" if st == Outcome.OK else "not yet checked"
    if st in (Outcome.OK, Outcome.UNCHECKED):
        ttft = f", first token in {res['ttft']:.1f} ms" if res.get("ttft") is not None else ""
        figs = (f"prefill {res['prefill']:.1f}, decode {res['decode']:.1f}, {res['streams']:.1f} with all slots "
                f"busy (t/s){ttft}, ready in {res.get('ready_s', 0):.1f} s")
        return f"{'correct' if st == 'ok' else 'not yet checked'}; {figs}"
    if st == Outcome.WRONG:
        return f"REJECTED, loads but computes wrong: {res.get('reason')}"
    return f"{st}: {res.get('reason')}"


def _checked(treq: TuneRequest) -> None:
    if treq.objective not in OBJECTIVES:
        raise BadInput(f"unknown objective {treq.objective!r}", f"use one of {', '.join(OBJECTIVES)}")
    if not treq.budget_s > 0:
        raise BadInput(f"{given('--budget', treq.budget_s)} must be positive", "give the seconds tune may take, e.g. 300")
    if not treq.per_candidate_s > 0:
        raise BadInput(f"{given('--per-candidate', treq.per_candidate_s)} must be positive", "give seconds, e.g. 15")


def tune(treq: TuneRequest, say: Say = lambda line: None) -> TuneReport:
    """Try the candidates within ``treq.budget_s`` and pick the fastest correct one for ``treq.objective``."""
    t0 = time.monotonic()
    _checked(treq)
    p = preview(replace(treq.serve, mode=AUTO))
    if p.rig.hosts:
        raise BadInput("tune measures this machine's cards, but the layout has other hosts",
                       "run tune on each machine's own cards, without --layout")
    binaries = find_llama(p.request.llama_dir, backend=p.request.backend, build=p.request.build)
    fp = fingerprint_of(p, binaries)
    kept = {} if treq.fresh else fpmod.load(fp)
    say(f"fingerprint {fp.digest}: {len(kept.get('results') or {})} result(s) kept from earlier runs"
        if kept else f"fingerprint {fp.digest}: nothing measured for it yet")
    facts = build_facts(p.request.backend, binaries)
    cands = routes(p.request.backend, len(p.rig.cards), facts)
    report = TuneReport(fp, treq.objective, dict(kept.get("results") or {}), [], default_key(p, cands), None)
    run = _Run(p, treq, report, say, t0)
    run.try_all(cands, "route")
    _by_agreement(run)  # no card holds the model alone (a MoE that does not fit one): the routes judge each other
    best = _best_route(report, treq.objective)
    if treq.settings and best is not None:
        c = Candidate.from_dict(report.results[best]["candidate"])
        planned = report.results[best].get("planned") or {}
        fa = backends.flash_attn_default(c.backend, c.settings.cache_type)
        run.try_all(settings_variants(c, int(planned.get("ubatch") or NATIVE_UBATCH), fa,
                                      int(planned.get("moe_offload") or 0), p.profile.n_layer_main,
                                      facts.backend_sampling), "setting")
    _by_agreement(run)
    ranked = rank({k: report.results[k] for k in report.order if k in report.results}, treq.objective)
    report.pick = _confirmed(run, ranked[0]) if ranked else None
    report.wall_s = round(time.monotonic() - t0, 1)
    run.keep()
    return report


def _confirmed(run: _Run, pick: str) -> str:
    """Deviate from the default order only on evidence: the pick and the default route are served again, back to
    back, and the pick stays only if it wins that round too (short measurements on a busy machine vary by more than
    the routes differ). Kept with the results, so a resumed run does not repeat it."""
    r, objective = run.report, run.report.objective
    default = r.default
    base = r.results.get(default or "")
    if default is None or pick == default or not base or base.get("status") != Outcome.OK:
        return pick
    figs = {k: r.results[k].get(f"confirm_{objective}") for k in (default, pick)}
    if any(f"confirm_{objective}" not in r.results[k] for k in (default, pick)):  # kept as None where it failed
        if time.monotonic() - run.t0 + 2 * run.estimate() > run.treq.budget_s:
            run.say(f"pick {r.results[pick]['label']} not confirmed: --budget leaves no time for a second round")
            return pick
        for k in (default, pick):
            res = run_candidate(run.p, Candidate.from_dict(r.results[k]["candidate"]), run.treq.per_candidate_s,
                                run.reference, measure=True)
            ok = res.get("status") in (Outcome.OK, Outcome.UNCHECKED) and res.get(objective) is not None
            figs[k] = res.get(objective) if ok else None
            r.results[k][f"confirm_{objective}"] = figs[k]
        run.keep()
    mine, theirs = figs[pick], figs[default]
    # a round in which the pick did not run loses; one in which only the default failed is the pick's
    won = mine is not None and (theirs is None or better_first(objective, mine) <= better_first(objective, theirs))
    u = unit(objective)

    def shown(v: float | None) -> str:
        return f"{v:.1f} {u}" if v is not None else "failed"

    run.say(f"second round, {objective}: {r.results[pick]['label']} {shown(mine)}, the default "
            f"{base['label']} {shown(theirs)}: "
            + ("the pick stands" if won else "not confirmed, the default order's route is kept"))
    return pick if won else default


def _best_route(report: TuneReport, objective: str) -> str | None:
    ranked = rank({k: report.results[k] for k in report.order if k in report.results}, objective)
    return ranked[0] if ranked else None


def _by_agreement(run: _Run) -> None:
    """Where no route held the whole model on one card, the routes' agreement is the reference: for the results
    not yet checked, and for the candidates started after it."""
    r = run.report
    open_ = {k: verify.from_json(r.results[k]["sample"]) for k in r.order
             if r.results.get(k, {}).get("status") == Outcome.UNCHECKED and r.results[k].get("sample")}
    if not open_ and run.reference is not None:
        return
    ref = verify.agreement({k: verify.from_json(r.results[k]["sample"]) for k in r.order
                            if r.results.get(k, {}).get("sample")})
    if ref is not None and run.reference is None:
        run.reference, run.reference_key = verify.from_json(r.results[ref]["sample"]), ref
    for k, sample in open_.items():
        res = r.results[k]
        if ref is None:
            res["reason"] = "no reference: no card holds the model alone and too few routes ran to agree"
            continue
        check = verify.compare(verify.from_json(r.results[ref]["sample"]), sample)
        res["status"] = Outcome.OK if check.ok else Outcome.WRONG
        res["reason"] = f"{check.reason} (reference: agreement)"
        run.say(f"{res['label']}: {line(res)}")


def verify_routes(req: ServeRequest, say: Say = lambda line: None) -> list[dict[str, Any]]:
    """``doctor --verify``: every route's output against the reference (one card, else the routes' agreement),
    nothing measured or kept. One line per route."""
    p = preview(replace(req, mode=AUTO))
    if p.rig.hosts:
        raise BadInput("--verify checks this machine's cards, but the layout has other hosts", "drop --layout")
    binaries = find_llama(p.request.llama_dir, backend=p.request.backend, build=p.request.build)
    out: dict[str, dict[str, Any]] = {}
    reference: verify.Sample | None = None
    for c in routes(p.request.backend, len(p.rig.cards), build_facts(p.request.backend, binaries)):
        why, _ = plan_check(p, c)
        if why:
            out[c.key] = {"label": label(c), "status": Outcome.PRUNED, "reason": why}
            continue
        say(f"verify {label(c)}: starting")
        res = run_candidate(p, c, 0.0, reference, measure=False)
        if reference is None and res.get("sample") and (c.one_card or c.mode is Mode.SINGLE):
            reference = verify.from_json(res["sample"])
            res["status"], res["reason"] = Outcome.OK, "reference (the whole model on one card)"
        out[c.key] = res
        say(f"verify {label(c)}: {line(res)}")
    run = _Run(p, TuneRequest(req), TuneReport(fingerprint_of(p, binaries), "decode", out, list(out), None, None),
               say, time.monotonic())
    _by_agreement(run)
    return [{k: v for k, v in r.items() if k not in ("sample", "argv")} for r in out.values()]


def run_from(req: ServeRequest, objective: str, budget_s: float, per_candidate_s: float, settings: bool = True,
             fresh: bool = False, say: Say = lambda line: None) -> TuneReport:
    """``arcsplit tune`` and ``serve --tune``: the request's own mode must be auto (tune tries every mode)."""
    if req.mode != AUTO:
        raise BadInput(f"tune tries every mode, so {given('--mode', req.mode)} does not apply", f"drop {arg('--mode')}")
    return tune(TuneRequest(req, objective, budget_s, per_candidate_s, settings=settings, fresh=fresh), say=say)
