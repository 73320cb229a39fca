"""What a user asks for -> a ServeConfig, with everything checkable checked before any process starts.

Shared by ``arcsplit serve`` and the Python API: binaries, ports, model, cards, runtime verdict, mode and plan.
A mistake here is one ArcsplitError and nothing is left running.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import backends, durations
from .._dirs import cache_dir, keep_json
from ..errors import ArcsplitError, BadInput, DoesNotFit, arg, example, given
from ..llama import compute_cache
from ..llama.childenv import clean_env
from ..llama.detect import BackendChoice, resolve
from ..llama.devices import discover_rig, host_budget, parse_gpus
from ..llama.features import binary_features, check_user_args
from ..llama.fitparams import measure_compute
from ..llama.locate import LlamaBinaries, find_llama
from ..llama.mode import ModeDecision, choose_mode, fallbacks
from ..llama.patches import GATE_ENV, SPIN_ENV, gated_sets_on, rpc_gate_host_kib
from ..llama.patches import INPUT_ON_CARD_ENV, check_switches, input_on_card
from ..llama.patches import shm_link_on as rpc_shm  # the user's ARCSPLIT_RPC_SHM, read where serve prepares
from ..llama.seeding import can_seed
from ..llama.webui import serve_dir
from ..memory import ctx_class, ctx_class_below
from ..model import load_profile, served_name
from ..netaddr import SERVER_PORT
from ..modes import AUTO as AUTO_MODE, CHOICES as MODE_CHOICES, Mode, parse_choice
from ..planner import Plan, PlanOptions, make_plan
from ..proc.ports import check_free, check_host, free_port
from ..rig import Rig, per_host
from ..roles import Role
from ..route import OUTPUT_LAYER_CHOICES, Route
from . import weightcache
from ..llama.verify import Sample
from .choice import RouteChoice, RuledOut
from .routes import RouteList, entry as routes_entry
from .specs import ALIAS_FLAGS, LOOPBACK, ProcessSpec, ServeConfig, build_specs, n_links, n_rpc_servers, split_secrets

__all__ = ["MODE_CHOICES", "OUTPUT_LAYER_CHOICES"]  # re-exported by arcsplit._api


# The output canary (run/canary.py): every 10 min of idle slots by default. One check is 4 prompts x 16 greedy
# tokens (llama/verify.py), 1.5-2.5 s on the demo model on two CPU cores (tests/test_canary_real.py) and less on a
# card, so an idle group spends under 0.5 % of its time on it, and a route that turns wrong while idle is left
# within 10 min (a busy one: at its next idle moment).
# From durations.CANARY_MIN_S (tests) to CANARY_MAX_S.
CANARY_EVERY_S = 600.0


@dataclass(frozen=True)
class ServeRequest:
    """The knobs of ``arcsplit serve``; defaults match the CLI's."""

    model: str
    gpus: Sequence[int] | str | None = None
    backend: str = backends.AUTO  # the cards and the builds present decide (llama/detect.py)
    mode: str = AUTO_MODE
    ctx: int | None = None
    parallel: int = 1
    host: str = LOOPBACK
    port: int = SERVER_PORT
    rpc_host: str = LOOPBACK
    rpc_ports: Sequence[int] | None = None
    threads: int | None = None
    ubatch: int | None = None  # None: the route's (Route.ubatch)
    cache_type: str = "f16"  # KV cache type for K and V (-ctk/-ctv)
    flash_attn: bool | None = None  # -fa; None: the backend's default (backends.flash_attn_default)
    env: tuple[tuple[str, str], ...] = ()  # extra llama-server environment (a tuned route's variant, tuning/)
    verified: bool = False  # this route's output was checked on these cards (arcsplit tune's pick)
    choice: RouteChoice | None = None  # arcsplit tune's pick and its figures (tuning/picks.tuned); None: not tuned
    kv_unified: bool = True
    rpc_cache: bool = False  # rpc-servers keep big weight tensors on local disk: reloads after a crash read them
    rpc_seed: bool = True  # rpc-servers read the weights from the GGUF, not the socket, where the build can (0006)
    output_layer: str = "auto"  # local: on llama-server's own card (hybrid); last/auto: llama.cpp's place
    cpu_memory_mib: int | None = None
    moe_offload: int | None = None  # routed experts of the first N layers in host RAM; None: as few as fit
    host_memory_mib: int | None = None  # what they may use there (default: available RAM less the CPU cards)
    llama_dir: str | None = None
    build: str | None = None  # a managed build's key (arcsplit llama which --all)
    extra_args: tuple[str, ...] = field(default=())
    alias: str | None = None  # the served model's name; None: model.served_name (general.name, else the file stem)
    stop_grace: float | None = None  # SIGTERM -> SIGKILL seconds; None: the backend's (backends.py stop_grace_s)
    measure: bool = False  # run llama.cpp's dry run for each card's compute buffer now and cache it (plan --measure)
    # What tune kept for this rig (tuning/picks.tuned, remembered): the next-best correct routes after the pick,
    # each as its own request, best first; the routes found computing wrong here; its answer for the output canary
    fallbacks: tuple["ServeRequest", ...] = ()
    ruled_out: tuple[RuledOut, ...] = ()
    reference: Sample | None = None
    canary: bool = True  # check the output after every (re)start and every canary_every s idle (run/canary.py)
    canary_every: float | str = CANARY_EVERY_S  # seconds, or a duration ("10m"): durations.parse reads it

    @classmethod
    def of(cls, model: str | os.PathLike[str], gpus: Sequence[int] | str | None,
           options: dict[str, Any]) -> ServeRequest:
        """The Python API's call as a request (``arcsplit.serve`` and ``arcsplit.tune``): ``options`` are the other
        fields, ``extra_args`` any sequence."""
        rest = dict(options)
        return cls(model=str(model), gpus=gpus, extra_args=tuple(rest.pop("extra_args", ())), **rest)


@dataclass(frozen=True)
class Prepared:
    """A checked request: the config the supervisor runs, and why this mode."""

    request: ServeRequest
    config: ServeConfig
    decision: ModeDecision
    profile: Any
    rig: Rig
    warnings: tuple[str, ...] = ()  # for the user before anything starts (the CLI prints them)
    notes: tuple[str, ...] = ()  # what was chosen for them: the backend auto picked and why, which managed build
    stop_grace: float = 10.0  # what the supervisor waits between SIGTERM and SIGKILL
    choice: RouteChoice | None = None  # how the route was chosen (tuned, asked, the default order): status shows it
    routes: RouteList | None = None  # every route serve may run, this one first (decide/routes.py)

    @property
    def route_list(self) -> RouteList:
        """The routes, this one first; one made from its config where ``decide`` did not build the list."""
        return self.routes or RouteList.one(routes_entry(self.config, self.decision, self.choice or RouteChoice.untuned(
            self.config.mode, self.config.forced_mode), "the route prepared"), self.config.forced_mode)


def _observed_path(backend: str) -> Path:
    return cache_dir() / "observed" / f"{backend}.json"


def load_observed(backend: str) -> dict[str, bool]:
    """Modes that failed on this machine before (written when a load hit the allocation signature)."""
    try:
        data = json.loads(_observed_path(backend).read_text(encoding="utf-8"))
        return {str(k): bool(v["ok"]) for k, v in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def record_observed(backend: str, mode: str, ok: bool, message: str) -> None:
    path = _observed_path(backend)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[mode] = {"ok": ok, "message": message[:500], "time": time.time()}
    keep_json(path, data, indent=1)


def _ports(ports: Sequence[int] | str | None) -> list[int] | None:
    if ports is None or ports == "":
        return None
    if isinstance(ports, str):
        try:
            ports = [int(p) for p in ports.split(",")]
        except ValueError:
            raise BadInput(f"{given('--rpc-ports', ports, repr(ports))} is not a list of ports",
                           f"write it like {example('--rpc-ports 50052,50053', 'rpc_ports=[50052, 50053]')}") from None
    ports = list(ports)
    if any(not 0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
        raise BadInput(f"{given('--rpc-ports', ports, repr(ports))} has a bad or repeated port",
                       "list distinct ports 1-65535")
    return ports


def _runtime(req: ServeRequest, rig: Rig, binaries: Any, probe: bool | None = None,
             progress: Callable[[str], None] = lambda line: None) -> tuple[Any, dict[str, bool] | None]:
    """The verdict and what is known to work here. Only a multi-card Intel run in auto mode needs it: the
    versions, then (unless ``probe`` is False) the probe of one multi-device context (run once, cached per
    NEO/kernel/build/cards)."""
    observed = load_observed(req.backend)
    if not backends.get(req.backend).probe_by_default or len(rig.cards) < 2 or req.mode != AUTO_MODE:
        return None, observed or None
    from ..llama.runtime import check_runtime  # start-up: probe and facts (~7 ms), for a multi-card Intel run only

    report = check_runtime(req.backend, [c.index for c in rig.cards], binaries, probe=probe, progress=progress)
    known = {p.mode: p.ok for p in report.probes}
    known.update(observed)  # a load that failed here since the probe outranks it
    return report.verdict, known or None


def rpc_gate(route: Route, environ: Any = os.environ) -> bool:
    """Gated sets for this group: the user's ARCSPLIT_RPC_GATE (0 or 1) where set, else the route's default."""
    return route.gated_sets(gated_sets_on(environ) if environ.get(GATE_ENV) else None)


def rpc_spin_us(route: Route, cores: int, environ: Any = os.environ) -> int:
    """The polling budget for this group's RPC link: the user's ARCSPLIT_RPC_SPIN_US, else the route's default."""
    return route.link_polling_us(cores, environ.get(SPIN_ENV))


def plan_for_mode(profile: Any, rig: Rig, req: ServeRequest, mode: str, live: bool = True) -> Plan:
    """The plan of ``mode``: device names and the default ubatch from its Route. ``live``: this machine's rig
    (its host RAM bounds expert offload), not a layout's. Compute buffers measured before for the same model
    file, route and options (``plan --measure``, llama/compute_cache.py) replace the formulas where they apply."""
    return _plan_and_key(profile, rig, req, mode, live)[0]


def _plan_and_key(profile: Any, rig: Rig, req: ServeRequest, mode: str, live: bool
                  ) -> tuple[Plan, compute_cache.CacheKey]:
    route = Route.build(mode, req.backend, [c.index for c in rig.cards], [c.host for c in rig.cards],
                        per_host(rig.hosts))
    ubatch = req.ubatch if req.ubatch is not None else route.ubatch
    options = PlanOptions(n_ctx=req.ctx, n_parallel=req.parallel, n_ubatch=ubatch, n_batch=max(2048, ubatch),
                          kv_unified=req.kv_unified, cache_type_k=req.cache_type, cache_type_v=req.cache_type,
                          output_on_first=route.output_local(req.output_layer),
                          input_on_first=route.input_on_card(input_on_card()),
                          flash_attn=(req.flash_attn if req.flash_attn is not None
                                      else backends.flash_attn_default(req.backend, req.cache_type)),
                          moe_offload=req.moe_offload, host_budget=host_budget(rig, req.host_memory_mib, live=live))
    key = compute_cache.cache_key(profile, req.backend, mode, route.devices, options)
    measured, trouble = compute_cache.load(key)
    plan = make_plan(profile, rig, options, devices=route.devices, measured=measured)
    return (replace(plan, warnings=(*plan.warnings, trouble)) if trouble else plan), key


MEASURE_ROUNDS = 6  # a measured card can change the split or context; each round measures what the last planned


def measure_plan(profile: Any, rig: Rig, req: ServeRequest, mode: str, live: bool = True) -> tuple[Plan, int]:
    """``plan --measure``: plan, run llama.cpp's own dry run (llama-fit-params) for the cards whose compute is not
    measured yet, cache it, plan again, until every offloaded card is measured. Returns (plan, dry runs).

    On this machine's cards (``live``) the dry run runs on them, with the backend's build and the mode's route, as
    serve would place each card. For a layout of cards that are absent, the CPU build's rpc-servers on 127.0.0.1
    stand in (measured "cpu"; a plan for another backend adds that backend's row, memory.backend_compute).
    The formulas are an upper bound, so llama.cpp's numbers can only make room: where the formulas do not fit at
    all, the split they would choose with twice the memory is measured first; with --ctx max, once every card is
    measured and a card (not the training context) stops the context, the next context class is measured too.
    """
    native = backends.get(req.backend).on_cpu or live
    binaries = find_llama(req.llama_dir if native else None, backend=req.backend if native else backends.CPU,
                          build=req.build if native else None)
    if binaries.fit_params is None:
        raise ArcsplitError(f"the llama.cpp build in {binaries.bin_dir} has no llama-fit-params to measure with",
                            f"build one with `arcsplit llama build --backend {req.backend if native else backends.CPU}`, or "
                            "plan without --measure")
    route = Route.build(mode, req.backend, [c.index for c in rig.cards]) if native else None
    try:
        plan, key = _plan_and_key(profile, rig, req, mode, live)
    except DoesNotFit:
        roomy = Rig(tuple(replace(c, total_bytes=2 * c.total_bytes, free_bytes=2 * c.free_bytes) for c in rig.cards),
                    rig.name)
        plan, key = _plan_and_key(profile, roomy, replace(req, ctx=req.ctx or 4096), mode, live)
    cap = (profile.n_ctx_train or 4096) * req.parallel
    tried: set[tuple[int, tuple[int, ...]]] = set()
    runs = 0
    for _ in range(MEASURE_ROUNDS):
        todo = plan
        if all(c.compute_source.startswith("measured") for c in plan.offloaded if c.compute):
            bounded = req.ctx is None and plan.ctx_limit and not plan.ctx_limit.startswith("the model's training")
            top = ctx_class(plan.n_ctx)
            todo = replace(plan, n_ctx=ctx_class(top + 1))  # the same split one class up: does it make room?
            if not bounded or top >= cap or plan.n_ctx + 256 <= top or (todo.n_ctx, plan.tensor_split) in tried:
                break
        top = ctx_class(todo.n_ctx)
        low = ctx_class_below(top) if todo.n_ctx < top else None  # inside the class: the line between two points
        for at in (top, low):
            if at is not None and (at, todo.tensor_split) not in tried:
                tried.add((at, todo.tensor_split))
                compute_cache.store(key, req.backend if native else backends.CPU, measure_compute(binaries, todo, route, at))
                runs += 1
        plan = plan_for_mode(profile, rig, req, mode, live)
    return plan, runs


def _check(req: ServeRequest) -> list[int] | None:
    """The request's own values, before anything is looked up; returns the fixed rpc ports, if any."""
    parse_choice(req.mode)  # an unknown mode is a one-line error listing the choices
    if not 0 < req.port < 65536:
        raise BadInput(f"{given('--port', req.port)} is not a port number", "use 1-65535")
    if req.ctx is not None and req.ctx <= 0:
        raise BadInput(f"{given('--ctx', req.ctx)} must be positive",
                       "give a context length, or leave it out for the largest")
    if req.ubatch is not None and req.ubatch < 1:
        raise BadInput(f"{given('--ubatch', req.ubatch)} must be at least 1", "give the micro-batch size in tokens")
    if req.parallel < 1:
        raise BadInput(f"{given('--parallel (--np)', req.parallel)} must be at least 1",
                       "give the number of parallel sequences")
    if req.output_layer not in OUTPUT_LAYER_CHOICES:
        raise BadInput(f"unknown {given('--output-layer', req.output_layer, repr(req.output_layer))}",
                       f"use one of {', '.join(OUTPUT_LAYER_CHOICES)}")
    if req.threads is not None and req.threads < 1:
        raise BadInput(f"{given('--threads', req.threads)} must be at least 1", "give rpc-server threads per card")
    if req.stop_grace is not None and not 0 <= req.stop_grace <= 3600:
        raise BadInput(f"{given('--stop-grace', req.stop_grace)} is out of range",
                       "give seconds between 0 and 3600, e.g. 30")
    rpc_ports = _ports(req.rpc_ports)
    check_host(req.host, "--host")
    check_host(req.rpc_host, "--rpc-host")
    return rpc_ports


def _gpus(req: ServeRequest) -> list[int] | None:
    return parse_gpus(req.gpus) if isinstance(req.gpus, str) or req.gpus is None else parse_gpus(list(req.gpus))


def prepare(req: ServeRequest, rig: Rig | None = None, progress: Callable[[str], None] = lambda line: None
            ) -> Prepared:
    """Check everything, pick the backend and the mode, plan: no process is started but the runtime probe (a
    multi-card Intel rig in auto mode, once per runtime), which ``progress`` hears about. ``rig``: a layout's
    cards (its [[hosts]] included) instead of this machine's live ones; this machine's cards as the layout gives
    them, the other hosts' checked by their node agents when the group starts."""
    return decide(req, rig, serving=True, progress=progress)


def preview(req: ServeRequest, rig: Rig | None = None) -> Prepared:
    """What ``serve`` would run for ``req``, offline: no process, no probe, ports not checked. For ``arcsplit plan``
    and ``arcsplit.plan()``. ``rig``: a layout's cards (another machine: this one's runtime verdict is not asked).

    auto picks the mode as serve does, but from the runtime verdict and recorded failures only: serve may also
    run (or reuse) a probe of one multi-device context, which ``arcsplit doctor`` shows.
    """
    return decide(req, rig, serving=False)


def decide(req: ServeRequest, rig: Rig | None, *, serving: bool,
           progress: Callable[[str], None] = lambda line: None) -> Prepared:
    """The one pipeline from a request to a config: backend, the request's values, build, model, cards, runtime,
    mode, plan, specs. ``serving``: a group starts next here, so the build must exist, the ports be free, the
    runtime be probed if needed, and a layout's cards be this machine's (else the layout may be another machine)."""
    req, choice = _backend(req, rig)
    rpc_ports = _check(req)
    if req.canary:  # seconds from here on; a bad value is one line (the CLI's flag is read the same way)
        req = replace(req, canary_every=durations.parse(req.canary_every, flag="--canary-every",
                                                        minimum=durations.CANARY_MIN_S,
                                                        maximum=durations.CANARY_MAX_S))
    if serving:
        binaries: LlamaBinaries | None = find_llama(req.llama_dir, backend=req.backend, build=req.build)
        _check_here(req, rpc_ports)
    else:
        binaries = _build_if_any(req)
    profile = load_profile(req.model)
    here = serving or rig is None  # the rig's cards are this machine's
    if rig is None:
        rig = discover_rig(req.backend, _gpus(req), None if backends.get(req.backend).on_cpu else binaries,
                           req.cpu_memory_mib)
    # The runtime probe opens this machine's cards: a layout with other hosts names cards it cannot open here.
    verdict, known = (_runtime(req, rig, binaries, probe=None if serving else False, progress=progress)
                      if here and not rig.hosts else (None, None))
    n_remote, distrust = sum(1 for c in rig.cards if c.host), unchecked_one_context(req, Mode.MULTI, len(rig.cards))
    decision = choose_mode(req.backend, len(rig.cards), forced=parse_choice(req.mode),
                           verdict=verdict, probe_results=known, n_remote=n_remote, distrust_one_context=distrust,
                           forced_by=req.choice.line() if req.choice is not None and req.choice.tuned else None)
    if req.mode != AUTO_MODE:  # asked with --mode, or tune's pick (with the next-best routes it found correct)
        first = _prepared(req, binaries, profile, rig, decision, rpc_ports, choice, live=here, serving=serving)
        return _tuned_list(first, serving) if first.choice and first.choice.tuned else \
            replace(first, routes=RouteList.one(_entry(first, f"--mode {req.mode}"), asked=True))
    later, left = fallbacks(req.backend, len(rig.cards), decision, verdict, known, n_remote, distrust)
    ruled = {r.mode: r.why for r in req.ruled_out}
    order = [d for d in (decision, *later) if d.mode not in ruled]
    left_out = [*((str(m), why) for m, why in left), *((str(d.mode), ruled[d.mode]) for d in (decision, *later)
                                                         if d.mode in ruled)]
    if not order:
        raise BadInput(f"every route this rig allows computed wrong here ({'; '.join(f'{m}: {w}' for m, w in left_out)})",
                       "fix the cards or their driver, then `arcsplit tune --fresh MODEL`; --mode MODE runs one anyway")
    if order[0] is not decision:  # auto's choice is ruled out: the next route runs, saying why
        order[0] = replace(order[0], reasons=(*(f"left out {m}: {w}" for m, w in left_out), *order[0].reasons))
    first = _prepared(req, binaries, profile, rig, order[0], rpc_ports, choice, live=here, serving=serving)
    rest = []
    for d in order[1:]:  # one that cannot run as asked (the user's --rpc-ports count, a plan that does not fit): out
        try:
            rest.append(_prepared(replace(req, measure=False), binaries, profile, rig, d, rpc_ports, None, live=here))
        except ArcsplitError as exc:
            left_out.append((str(d.mode), str(exc)))
    return replace(first, routes=RouteList((_entry(first, "auto's choice"),
                                            *(_entry(p, "the default order's next route") for p in rest)),
                                           tuple(left_out)))


def _entry(p: Prepared, why: str, label: str = "", key: str = "") -> Any:
    """``p`` as a route of the list."""
    choice = p.choice or RouteChoice.untuned(p.decision.mode, p.config.forced_mode)
    return routes_entry(p.config, p.decision, choice, why, label or choice.label, key)


def _tuned_list(first: Prepared, serving: bool) -> Prepared:
    """Tune's pick and then the next-best routes it found correct here (each prepared as its own request), best
    first; what tune found wrong, failed or pruned is left out with its reason."""
    req = first.request
    rest, left_out = [], [(r.label, r.why) for r in req.ruled_out]
    for fb in req.fallbacks:
        try:
            rest.append(decide(replace(fb, fallbacks=(), measure=False), None, serving=serving))
        except ArcsplitError as exc:  # its build gone, its ports or plan refused now: out, saying why
            left_out.append((fb.choice.label if fb.choice else str(fb.mode), str(exc)))
    entries = (_entry(first, "tune's pick", key=req.choice.key if req.choice else ""),
               *(_entry(p, "tune's next-best correct route", key=p.choice.key if p.choice else "") for p in rest))
    return replace(first, routes=RouteList(entries, tuple(left_out)))


def _backend(req: ServeRequest, rig: Rig | None) -> tuple[ServeRequest, BackendChoice | None]:
    """The request with its backend: a layout's (its cards are of one kind), else resolved from this machine's
    cards and builds (with the reason, for the notes)."""
    if rig is None:
        backend, choice = resolve(req.backend, req.llama_dir)
        return replace(req, backend=backend), choice
    if req.gpus is not None:
        raise BadInput(f"{arg('--layout')} and {arg('--gpus')} both name cards", "pass one of them")
    kinds = sorted({c.backend for c in rig.cards})
    if len(kinds) > 1:
        raise BadInput(f"the layout mixes backends {', '.join(kinds)}", "one group runs one backend: split the layout")
    return replace(req, backend=kinds[0]), None


def _check_here(req: ServeRequest, rpc_ports: list[int] | None) -> None:
    """What only a start here needs: the ports free now, the model a file."""
    check_free(req.host, req.port, "llama-server", "--port")
    for p in rpc_ports or ():
        check_free(req.rpc_host, p, "rpc-server", "--rpc-ports")
    model = Path(req.model)
    if not model.exists():
        raise BadInput(f"model {model} does not exist", "pass the path of a .gguf file")
    if not model.is_file():
        raise BadInput(f"model {model} is not a regular file", "pass the path of a .gguf file")


def _build_if_any(req: ServeRequest) -> LlamaBinaries | None:
    """The build a plan names, if there is one: planning needs none (the argv then names the binaries without a
    path)."""
    try:
        return find_llama(req.llama_dir, backend=req.backend, build=req.build)
    except ArcsplitError:
        return None


UNCHECKED_CARDS = 3  # from here a one-context route has loaded and still computed wrong (compute-runtime#942)


def unchecked_one_context(req: ServeRequest, mode: Mode, n_cards: int) -> str | None:
    """The warning for a one-context route over 3+ cards of a backend with known multi-device bugs that no check
    has verified: on 4x B70 peer copies corrupt data (intel/compute-runtime#942) and large allocations fail
    (#957), so loading proves nothing about the output."""
    if req.verified or not mode.one_context or n_cards < UNCHECKED_CARDS:
        return None
    if not backends.get(req.backend).probe_by_default:
        return None
    return (f"{n_cards} cards in one context: on such rigs a route can load and still compute wrong "
            "(intel/compute-runtime#942, #957), so --mode auto does not pick it unchecked; check its output with "
            "`arcsplit doctor --verify MODEL`, or let `arcsplit tune MODEL` pick a route it has checked")


def _input_off(plan: Plan) -> dict[str, str]:
    """ARCSPLIT_INPUT_ON_CARD=0 for a plan that holds the token embeddings on llama-server's CPU, where the user's
    environment has the variable (patch 0015 would otherwise move them where the plan has no room for them)."""
    return {INPUT_ON_CARD_ENV: "0"} if not plan.options.input_on_first and INPUT_ON_CARD_ENV in os.environ else {}


def _prepared(req: ServeRequest, binaries: LlamaBinaries | None, profile: Any, rig: Rig, decision: ModeDecision,
              rpc_ports: list[int] | None, choice: BackendChoice | None, live: bool = True,
              serving: bool = False) -> Prepared:
    """The plan and the config of the chosen mode; the specs are built once so a missing flag fails here.
    ``serving``: a group starts next, so the rpc-servers' weight cache is pruned and the model indexed now."""
    check_switches()  # a bad value is refused before anything is pruned or started; llama.cpp reads them itself
    shm = rpc_shm()
    notes: list[str] = []
    if req.measure:
        plan, runs = measure_plan(profile, rig, req, decision.mode, live)
        notes.append(f"compute buffers: {runs} llama-fit-params dry run(s) now, cached" if runs else
                     "compute buffers: measured before, from the cache")
    else:
        plan = plan_for_mode(profile, rig, req, decision.mode, live)
    warnings = []
    unchecked = unchecked_one_context(req, decision.mode, len(rig.cards))
    if unchecked:
        warnings.append(unchecked)
    if req.rpc_host != LOOPBACK:
        warnings.append(f"rpc-servers listen on {req.rpc_host}; the RPC protocol has no authentication, so anyone "
                        f"who can reach it can run code on them - keep it on a trusted network")
    for h in rig.hosts:
        if h.link == "direct" and any(c.card.host == h.name for c in plan.cards):
            warnings.append(f"host {h.name}: link = \"direct\": its rpc-servers listen on {h.address}, and the RPC "
                            "protocol has no authentication, so anyone who can reach that address can run code "
                            "on them - use a private link or a VPN only (link = \"ssh\" keeps them on loopback)")
    # A build arcsplit did not make is asked once what it accepts (llama/features.py).
    foreign = binaries is not None and binaries.found_by in ("--llama-dir", "ARCSPLIT_LLAMA_DIR", "PATH")
    _, dropped = clean_env(req.backend, os.environ)
    cores = os.cpu_count() or 1
    route = Route.build(decision.mode, req.backend, [c.card.index for c in plan.cards],
                        [c.card.host for c in plan.cards], per_host(rig.hosts))
    rpc_features = binary_features(binaries.rpc_server) if binaries and foreign else None
    # rpc-servers read the weights from the GGUF (patch 0006): here, and on a layout's other hosts from their copy
    seed = bool(req.rpc_seed and route.rpc and binaries
                and can_seed(binaries.rpc_server, rpc_features.flags if rpc_features else None))
    rpc_cache = str(cache_dir() / "rpc-cache") if req.rpc_cache or seed else None
    pruned = None
    if rpc_cache and serving:  # before the load: stale indexes and old copies go; at most one model's worth stays
        pruned = weightcache.prune(rpc_cache, keep_copy_bytes=profile.file_bytes if req.rpc_cache else 0)
    config = ServeConfig(plan=plan, mode=decision.mode, backend=req.backend,
                         server_bin=str(binaries.server) if binaries else "llama-server",
                         rpc_bin=str(binaries.rpc_server) if binaries else "ggml-rpc-server",
                         host=req.host, port=req.port, rpc_host=req.rpc_host,
                         rpc_ports=tuple(rpc_ports) if rpc_ports else None, threads=req.threads, cores=cores,
                         extra_args=tuple(req.extra_args), alias=req.alias or _alias_in(req.extra_args) or served_name(profile),
                         rpc_spin_us=rpc_spin_us(route, cores), rpc_shm=shm, rpc_gate=rpc_gate(route),
                         rpc_gate_host_kib=rpc_gate_host_kib(),
                         rpc_cache_dir=rpc_cache, rpc_seed=(profile.shards or (plan.model_path,)) if seed else (),
                         mode_env=tuple(sorted({**decision.env, **dict(req.env), **_input_off(plan)}.items())),
                         forced_mode=req.mode != AUTO_MODE,
                         ui_dir=serve_dir(binaries.server.parent) if binaries else None, env_dropped=dropped,
                         server_features=binary_features(binaries.server) if binaries and foreign else None,
                         rpc_features=rpc_features, hosts=rig.hosts)
    if req.extra_args and binaries and binaries.server.is_file():  # the user's args, against what the build accepts
        check_user_args(split_secrets(req.extra_args)[0], config.server_features or binary_features(binaries.server))
    # The specs as the supervisor will build them (placeholder ports): a flag the route needs and this build lacks
    # is an error now, before any process starts; what it can do without is said.
    specs = build_specs(config, [0] * n_rpc_servers(config), [0] * n_links(config))
    off = tuple(dict.fromkeys(o for spec in specs for o in spec.features_off))
    notes = ([choice.reason, *choice.notes] if choice is not None else []) + notes
    if serving and config.rpc_seed and config.rpc_cache_dir:  # hash a new model once, outside rpc-server start-up
        rpc = next((s for s in specs if s.role == Role.RPC and not s.node), None)  # None: all on other hosts
        env = (dict(os.environ) if rpc is None
               else {k: v for k, v in os.environ.items() if k not in rpc.env_unset} | rpc.env_dict)
        took = weightcache.ensure_index(config.rpc_bin, config.rpc_cache_dir, config.rpc_seed, env)
        if took is not None:
            notes.append(f"indexed {', '.join(Path(f).name for f in config.rpc_seed)} for the rpc-servers' weight "
                         f"cache in {took:.1f} s (once per file version; docs/patches.md 0006)")
    if rpc_cache and pruned and pruned.freed_bytes:
        notes.append(f"rpc weight cache: removed {pruned.indexes} stale index(es) and {pruned.copies} weight copies "
                      f"({pruned.freed_bytes / 2**20:.0f} MiB) from {weightcache.store(rpc_cache)}")
    notes += [binaries.note] if binaries and binaries.note else []
    notes += [f"environment: {d.line()}" for d in dropped]
    if off:
        notes.append(f"{config.server_bin} lacks flags arcsplit uses; off: {'; '.join(off)}")
    grace = req.stop_grace if req.stop_grace is not None else backends.get(req.backend).stop_grace_s
    return Prepared(req, config, decision, profile, rig, tuple(warnings), tuple(notes), grace,
                    req.choice or RouteChoice.untuned(decision.mode, req.mode != AUTO_MODE))


def _alias_in(extra: Sequence[str]) -> str | None:
    """A name the user gave llama-server itself after ``--`` (``-a``/``--alias NAME``): theirs wins."""
    for flag, value in zip(extra, extra[1:]):
        if flag in ALIAS_FLAGS:
            return value
    return None


def planned_specs(prepared: Prepared) -> tuple[ProcessSpec, ...]:
    """The processes ``serve`` would start for this request: with the user's --rpc-ports, else ports free now
    (serve picks its own then; another host's are free ports here, for show: its node picks them there)."""
    config = prepared.config
    ports = list(config.rpc_ports or ())
    while len(ports) < n_rpc_servers(config) + n_links(config):
        port = free_port(config.rpc_host if len(ports) < n_rpc_servers(config) else LOOPBACK)
        ports += [port] if port not in ports else []
    return build_specs(config, ports[:n_rpc_servers(config)], ports[n_rpc_servers(config):])
