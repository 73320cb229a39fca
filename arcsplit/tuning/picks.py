"""What ``arcsplit tune`` kept, read back: the pick ``serve`` runs for a rig, and the table ``plan`` and ``doctor``
show. Nothing here starts a process or imports the runner (tuning/runner.py, which serves candidates through
arcsplit._api): the API reads the pick from here, so the dependency runs one way, runner -> API -> this module.
"""

from __future__ import annotations

import platform
from dataclasses import replace
from typing import Any

from .. import backends
from ..errors import ArcsplitError
from ..decide.choice import LEGEND, ChosenBy, Measured, RouteChoice, table
from ..decide.prepare import Prepared, ServeRequest, preview
from ..llama.facts import gather_facts
from ..llama.locate import LlamaBinaries, find_llama
from ..modes import AUTO
from ..rig import Rig
from . import fingerprint as fpmod
from .candidates import Candidate, Outcome


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
    return RouteChoice(ChosenBy.TUNE, str(res["candidate"]["mode"]), res.get("label") or str(pick), objective,
                       float(data.get("updated") or 0) or None, float(res["decode"]), float(res["prefill"]),
                       float(res["streams"]), alternatives(data, pick, objective))


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
    """The request as the tuned pick for this rig's fingerprint runs it (carrying its RouteChoice), with the line
    serve says; None when nothing is tuned for it (or the request names its own mode)."""
    if req.mode != AUTO:
        return None
    got = kept(req)
    if got is None:
        return None
    p, data = got
    choice = choice_of(data, objective)
    if choice is None:
        return None
    c = Candidate.from_dict(data["results"][data["picks"][choice.objective]]["candidate"])
    return (replace(request_for(p.request, c, p.rig), port=req.port, rpc_ports=req.rpc_ports, verified=True,
                    choice=choice),
            f"using the tuned route {label(c)}: decode {choice.decode:.1f} t/s, prefill {choice.prefill:.1f} t/s, "
            f"correct output (arcsplit tune, {choice.when()[:10]}); --mode or --no-tune overrides it")


def summary(req: ServeRequest) -> list[str]:
    """For ``plan`` and ``doctor``: the tuned pick for this rig beside the alternatives measured, one line each."""
    got = kept(req)
    if got is None:
        return []
    data = got[1]
    objective = str(data.get("objective") or "decode")
    return [f"tuned for this rig (arcsplit tune, by {objective}; {LEGEND}):",
            *table(alternatives(data, (data.get("picks") or {}).get(objective), objective), objective)]
