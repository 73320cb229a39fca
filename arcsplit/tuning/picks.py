"""What ``arcsplit tune`` kept, read back: the pick ``serve`` runs for a rig, and the table ``plan`` and ``doctor``
show. Nothing here starts a process or imports the runner (tuning/runner.py, which serves candidates through
arcsplit._api): the API reads the pick from here, so the dependency runs one way, runner -> API -> this module.
"""

from __future__ import annotations

import platform
import time
from dataclasses import replace
from typing import Any

from .. import backends
from ..errors import ArcsplitError
from ..decide.choice import LEGEND, ChosenBy, Measured, RouteChoice, RuledOut, table
from ..decide.prepare import Prepared, ServeRequest, preview
from ..llama.facts import gather_facts
from ..llama.locate import LlamaBinaries, find_llama
from ..llama import verify
from ..modes import AUTO, Mode
from ..rig import Rig
from . import fingerprint as fpmod
from .candidates import DEBUG_KEY, Candidate, Outcome, Settings, rank


def request_for(base: ServeRequest, c: Candidate, rig: Rig) -> ServeRequest:
    """``base`` as candidate ``c`` runs it (the user's ports and other knobs kept)."""
    s = c.settings
    gpus = [rig.cards[0].index] if c.one_card else [card.index for card in rig.cards]
    return replace(base, backend=c.backend, mode=c.mode, gpus=gpus, output_layer=c.output_layer,
                   ubatch=s.ubatch if s.ubatch is not None else base.ubatch,
                   flash_attn=s.flash_attn if s.flash_attn is not None else base.flash_attn,
                   cache_type=s.cache_type, moe_offload=s.moe_offload if s.moe_offload is not None else base.moe_offload,
                   env=tuple(sorted({**dict(base.env), **dict(c.env)}.items())),
                   extra_args=tuple(base.extra_args) + c.server_args)


def fingerprint_of(p: Prepared, binaries: LlamaBinaries) -> fpmod.Fingerprint:
    """The rig, its drivers, the build and the model as ``p`` sees them (facts/neo only on SYCL, where it matters)."""
    neo = ""
    if backends.get(p.request.backend).intel_runtime:
        facts = gather_facts(p.request.backend)
        neo = facts.neo.label if facts.neo else ""
    cards = tuple(f"{c.index}:{c.name}" + (f":{c.total_bytes}" if not backends.get(c.backend).on_cpu else "") for c in p.rig.cards)
    driver = ";".join(f"{m} {v}" for m in ("i915", "nvidia", "amdgpu") if (v := fpmod.module_version(m)))
    return fpmod.Fingerprint(p.request.backend, cards, driver, neo, fpmod.module_version("xe"), platform.release(),
                             f"{fpmod.build_id(binaries.server)} {fpmod.build_id(binaries.rpc_server)}",
                             fpmod.model_digest(p.request.model), p.request.ctx, p.request.parallel)


def label(c: Candidate) -> str:
    return f"{c.backend} {c.route_key} [{c.settings.label()}]"


def kept(req: ServeRequest) -> tuple[Prepared, dict[str, Any]] | None:
    """What tune kept for the rig ``req`` names (this machine's cards only), with the request prepared offline.
    Nothing is looked up (no second plan, no device listing) when nothing was ever tuned here."""
    if not fpmod.anything_kept():
        return None
    try:
        p = preview(replace(req, mode=AUTO))
        if p.rig.hosts:
            return None
        fp = fingerprint_of(p, find_llama(p.request.llama_dir, backend=p.request.backend, build=p.request.build))
    except ArcsplitError:
        return None
    data = fpmod.load(fp)
    return (p, data) if data.get("results") else None


def choice_of(data: dict[str, Any], objective: str | None = None) -> RouteChoice | None:
    """The kept results of one fingerprint as the typed choice serve carries: the pick for ``objective`` (else the
    one last tuned for), its figures and every alternative measured (the pick first); None without a correct pick."""
    results = data.get("results") or {}
    objective = objective or str(data.get("objective") or "decode")
    pick = (data.get("picks") or {}).get(objective)
    res = results.get(pick or "")
    if not res or res.get("status") != Outcome.OK or "decode" not in res:
        return None
    return _tuned_choice(data, str(pick), objective, alternatives(data, pick, objective))


def alternatives(data: dict[str, Any], pick: str | None, objective: str) -> tuple[Measured, ...]:
    """Every kept result of one fingerprint, the pick first, then by key; second rounds by ``objective``."""
    results = data.get("results") or {}
    return tuple(measured(results[k], k, pick, data.get("default"), objective)
                 for k in [pick, *sorted(k for k in results if k != pick)] if k in results)


def measured(res: dict[str, Any], key: str, pick: str | None, default: str | None, objective: str) -> Measured:
    """One kept result as the typed record the surfaces and the Python API read (its second round's figure by
    ``objective``, where it had one)."""
    return Measured.from_dict({**res, "key": key, "pick": key == pick, "default": key == default,
                               "second": res.get(f"confirm_{objective}")})


def tuned(req: ServeRequest, objective: str | None = None) -> tuple[ServeRequest, str] | None:
    """The request as the tuned pick for this rig's fingerprint runs it (carrying its RouteChoice, the next-best
    correct routes after it, the routes tune ruled out and its answer for the output canary), with the line serve
    says; None when nothing is tuned for it (or the request names its own mode)."""
    if req.mode != AUTO:
        return None
    got = kept(req)
    if got is None:
        return None
    p, data = got
    choice = choice_of(data, objective)
    if choice is None:
        return None
    c = Candidate.from_dict(data["results"][choice.key]["candidate"])
    nexts, ruled = ranked_routes(data, choice.key, choice.objective)

    def as_run(cand: Candidate, ch: RouteChoice) -> ServeRequest:
        return replace(request_for(p.request, cand, p.rig), port=req.port, rpc_ports=req.rpc_ports, verified=True,
                       choice=ch, reference=reference_of(data))

    fallbacks = tuple(as_run(Candidate.from_dict(data["results"][k]["candidate"]), _tuned_choice(data, k, choice.objective))
                      for k in nexts)
    return (replace(as_run(c, choice), fallbacks=fallbacks, ruled_out=ruled),
            f"using the tuned route {label(c)}: decode {choice.decode:.1f} t/s, prefill {choice.prefill:.1f} t/s, "
            + (f"first token {choice.ttft:.1f} ms, " if choice.ttft is not None else "")
            + f"correct output (arcsplit tune, {choice.when()[:10]}); --mode or --no-tune overrides it")


def _tuned_choice(data: dict[str, Any], key: str, objective: str, alts: tuple[Measured, ...] = ()) -> RouteChoice:
    """A correct, measured result of tune as the choice serve carries (``alts``: every alternative, for the pick)."""
    res = data["results"][key]
    ttft = res.get("ttft")
    return RouteChoice(ChosenBy.TUNE, str(res["candidate"]["mode"]), res.get("label") or key, objective,
                       float(data.get("updated") or 0) or None, float(res["decode"]), float(res["prefill"]),
                       float(res["streams"]), alts, key=key, ttft=None if ttft is None else float(ttft))


def ranked_routes(data: dict[str, Any], pick: str, objective: str) -> tuple[list[str], tuple[RuledOut, ...]]:
    """After ``pick``, the other routes tune found correct here, fastest first by ``objective``, each once (its
    best settings: a route that turns wrong does so whatever its ubatch); and the routes it found wrong, failed or
    pruned, each once with its reason."""
    results = data.get("results") or {}

    def route(k: str) -> tuple[str, str]:
        c = Candidate.from_dict(results[k]["candidate"])
        return c.backend, c.route_key

    seen = {route(pick)}
    nexts = []
    for k in rank(results, objective):
        if route(k) not in seen:
            seen.add(route(k))
            nexts.append(k)
    ruled: dict[tuple[str, str], RuledOut] = {}
    for k in sorted(results):
        res = results[k]
        if route(k) not in seen and res.get("status") in (Outcome.WRONG, Outcome.FAILED, Outcome.PRUNED):
            ruled.setdefault(route(k), RuledOut(str(res["candidate"]["mode"]), res.get("label") or k,
                                                f"{res.get('status')} in arcsplit tune: {res.get('reason') or ''}"[:300]))
    return nexts, tuple(ruled.values())


def reference_of(data: dict[str, Any]) -> verify.Sample | None:
    """Tune's kept answer for this fingerprint, the output canary's reference: the reference tune checked every
    route against (the whole model on one card), else the pick's own checked answer, else any correct one."""
    results = data.get("results") or {}
    pick = next(iter((data.get("picks") or {}).values()), None)
    ok = [k for k in sorted(results) if results[k].get("status") == Outcome.OK and results[k].get("sample")]
    ranked = sorted(ok, key=lambda k: (not str(results[k].get("reason", "")).startswith("reference"), k != pick))
    return verify.from_json(results[ranked[0]]["sample"]) if ranked else None


def default_candidate(req: ServeRequest, mode: str) -> Candidate:
    """The candidate tune names the default order's route of ``mode`` by, at the request's settings."""
    env = DEBUG_KEY.env if mode == Mode.MULTI_WORKAROUND else ()
    return Candidate(Mode(mode), req.backend, variant=DEBUG_KEY.name if env else "", env=env,
                     source=DEBUG_KEY.source if env else "",
                     output_layer="last" if mode == Mode.HYBRID and req.output_layer == "auto" else req.output_layer,
                     settings=Settings(req.ubatch, req.flash_attn, req.cache_type, req.moe_offload))


def remembered(req: ServeRequest) -> ServeRequest:
    """The request with what tune kept for its rig where no tuned pick runs (none kept, --no-tune, --mode): the
    default order's routes found computing wrong here, left out (mode auto only), and tune's answer as the output
    canary's reference."""
    got = kept(req)
    if got is None:
        return req
    p, data = got
    ruled = []
    if req.mode == AUTO:
        for mode in Mode:
            res = (data.get("results") or {}).get(default_candidate(p.request, mode).key)
            if res and res.get("status") == Outcome.WRONG:
                ruled.append(RuledOut(mode, res.get("label") or mode, f"computes wrong here: {res.get('reason') or ''}"[:300]))
    return replace(req, ruled_out=tuple(ruled), reference=reference_of(data))


def mark_wrong(req: ServeRequest, key: str, mode: str, evidence: dict[str, Any]) -> str:
    """Keep, in tune's results for the rig ``req`` names, that a route computes wrong (the output canary of a running
    group saw it): tune and serve then never pick it. ``key``: tune's key for the route where it ran tune's pick,
    else the default order's route of ``mode`` at the request's settings. Returns the key marked."""
    p = preview(replace(req, mode=AUTO))
    fp = fingerprint_of(p, find_llama(p.request.llama_dir, backend=p.request.backend, build=p.request.build))
    data = fpmod.load(fp)
    results = dict(data.get("results") or {})
    c = Candidate.from_dict(results[key]["candidate"]) if key in results else default_candidate(p.request, mode)
    res = dict(results.get(c.key) or {"candidate": c.to_dict(), "label": label(c)})
    res.update(status=Outcome.WRONG, reason=f"the output canary of a running group: {evidence.get('reason', '')}"[:500],
               canary=dict(evidence), marked_at=time.time())
    results[c.key] = res
    fpmod.store(fp, {**data, "results": results})
    return c.key


def summary(req: ServeRequest) -> list[str]:
    """For ``plan`` and ``doctor``: the tuned pick for this rig beside the alternatives measured, one line each."""
    got = kept(req)
    if got is None:
        return []
    data = got[1]
    objective = str(data.get("objective") or "decode")
    return [f"tuned for this rig (arcsplit tune, by {objective}; {LEGEND}):",
            *table(alternatives(data, (data.get("picks") or {}).get(objective), objective), objective)]
