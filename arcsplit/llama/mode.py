"""How the cards share one model: one context, one context plus NEO's workaround, hybrid, or all-RPC.

Pure: versions (a Verdict) and probe results in, a ModeDecision with its reasons out. Fastest first, measured
on 2x H200 (bench/results/throughput_cuda.md): native 1.0 > native+workaround > hybrid > all-RPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Protocol

from .. import backends
from ..errors import BadInput
from ..modes import AUTO_ORDER, MODES, Mode
from .verdict import Verdict

# Intel's workaround for the NEO >= 26.05 multi-device failure (intel/compute-runtime#916).
NEO_WORKAROUND_ENV = {"NEOReadDebugKeys": "1", "ForceZeDeviceCanAccessPerReturnValue": "0"}
WARNING = "warning: "  # a reason that warns: kept whoever forced the mode


class ProbeLike(Protocol):
    @property
    def mode(self) -> str: ...

    @property
    def ok(self) -> bool: ...

    @property
    def status(self) -> str: ...


@dataclass(frozen=True)
class ModeDecision:
    """``env`` is extra environment for llama-server (only in multi+workaround); ``verified``: a probe ran it."""

    mode: Mode
    env: dict[str, str] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "env": dict(self.env), "reasons": list(self.reasons), "verified": self.verified}


def _probe_map(probe_results: Iterable[ProbeLike] | Mapping[str, bool] | None) -> dict[str, tuple[bool, str]]:
    if not probe_results:
        return {}
    if isinstance(probe_results, Mapping):
        return {m: (bool(ok), "ok" if ok else "failed") for m, ok in probe_results.items()}
    out: dict[str, tuple[bool, str]] = {}
    for r in probe_results:
        out[r.mode] = (bool(r.ok), r.status)
    return out


def choose_mode(backend: str, n_cards: int, forced: str | None = None, verdict: Verdict | None = None,
                probe_results: Iterable[ProbeLike] | Mapping[str, bool] | None = None,
                n_remote: int = 0, distrust_one_context: str | None = None,
                forced_by: str | None = None) -> ModeDecision:
    """The fastest mode that works here; ``forced`` (--mode) wins but a known failure is stated. ``n_remote`` of the
    cards are on other hosts: each is an rpc-server there, and the choice is about this machine's cards.
    ``distrust_one_context``: why auto must not pick a one-context mode even where it loads (its output unchecked
    on a rig where loading proves nothing); --mode still runs one. ``forced_by``: what chose ``forced`` when the user
    did not (arcsplit tune's pick, in its RouteChoice line): the reason given, after any warning, not "--mode"."""
    decision = _choose(backend, n_cards, forced, verdict, probe_results, n_remote, distrust_one_context)
    if forced_by is None:
        return decision
    return replace(decision, reasons=(*(r for r in decision.reasons if r.startswith(WARNING)), forced_by))


def _choose(backend: str, n_cards: int, forced: str | None, verdict: Verdict | None,
            probe_results: Iterable[ProbeLike] | Mapping[str, bool] | None, n_remote: int,
            distrust_one_context: str | None) -> ModeDecision:
    be = backends.get(backend)  # an unknown name is a one-line error
    if n_cards < 1:
        raise BadInput("no cards to run on", "pass --gpus with at least one card")
    if n_remote:
        return _across_hosts(be, n_cards - n_remote, n_remote, forced, verdict, probe_results)
    if forced is not None and forced not in MODES:
        raise BadInput(f"unknown mode {forced!r}", f"use one of {', '.join(MODES)}")
    want = None if forced is None else Mode(forced)
    probes = _probe_map(probe_results)
    reasons: list[str] = []
    if verdict is not None and verdict.affects == "all" and verdict.status == "bad":
        reasons.append(f"{WARNING}{verdict.summary} ({', '.join(verdict.sources)}) - no mode avoids it")
    if n_cards == 1:
        return _one_card(want, reasons)
    if be.on_cpu:
        return _cpu_cards(want, reasons, probes)
    if want is Mode.SINGLE:
        raise BadInput(f"--mode single needs exactly one card, got {n_cards}", "pass one card with --gpus, or drop --mode")
    if want is Mode.MULTI_WORKAROUND and not be.one_context_workaround:
        raise BadInput(f"--mode multi+workaround is Intel NEO's workaround and does nothing on {backend}",
                       "use --mode multi, hybrid or rpc")
    prior = _Prior(be, verdict, probes)
    if want is not None:
        ok, why = prior.works(want)
        reasons.append(f"forced by --mode {want}")
        if (want in probes and not ok) or (want is Mode.MULTI and prior.bad_multi):
            reasons.append(f"{WARNING}{why}")
        return ModeDecision(want, prior.env_of(want), tuple(reasons), want in probes and ok)
    for mode in AUTO_ORDER:
        if mode is Mode.MULTI_WORKAROUND and not be.one_context_workaround:
            continue
        if distrust_one_context and mode.one_context:
            reasons.append(f"skipped {mode}: {distrust_one_context}")
            continue
        ok, why = prior.works(mode)
        if ok:
            reasons.append(f"{mode} ({mode.speed}): {why}")
            return ModeDecision(mode, prior.env_of(mode), tuple(reasons), mode in probes)
        reasons.append(f"skipped {mode}: {why}")
    reasons.append("no mode worked in the probe; rpc is the last resort - see `arcsplit doctor` for remedies")
    return ModeDecision(Mode.RPC, {}, tuple(reasons), False)


def fallbacks(backend: str, n_cards: int, decision: ModeDecision, verdict: Verdict | None = None,
              probe_results: Iterable[ProbeLike] | Mapping[str, bool] | None = None, n_remote: int = 0,
              distrust_one_context: str | None = None) -> tuple[tuple[ModeDecision, ...], tuple[tuple[Mode, str], ...]]:
    """What ``auto`` runs after ``decision`` if that route fails or turns wrong while serving: the other modes it
    would accept here, fastest first (AUTO_ORDER; on the CPU backend all-RPC, then hybrid), each with its env and
    why; and the modes left out, each with why (the probe, the versions, the rule against an unchecked one-context
    route). One card, or every card on other hosts: no other route. Pure, like ``choose_mode``."""
    be = backends.get(backend)
    n_here = n_cards - n_remote
    if n_here < 1 or (n_cards == 1 and not n_remote):
        return (), ()
    if be.on_cpu or n_remote:  # no one context to probe: down a fixed order, from the decision on
        order = (Mode.RPC, Mode.HYBRID) if be.on_cpu else tuple(dict.fromkeys((decision.mode, Mode.HYBRID, Mode.RPC)))
        after = order[order.index(decision.mode) + 1:] if decision.mode in order else ()
        what = {Mode.RPC: "every card behind its own rpc-server", Mode.HYBRID: "llama-server holds the first card"}
        return tuple(ModeDecision(m, {}, (f"{m} ({m.speed}): {what[m]}",)) for m in after), ()
    prior = _Prior(be, verdict, _probe_map(probe_results))
    later, out = [], []
    for mode in AUTO_ORDER:
        if mode is decision.mode or (mode is Mode.MULTI_WORKAROUND and not be.one_context_workaround):
            continue
        if distrust_one_context and mode.one_context:
            out.append((mode, distrust_one_context))
            continue
        ok, why = prior.works(mode)
        if ok and AUTO_ORDER.index(mode) > AUTO_ORDER.index(decision.mode):
            later.append(ModeDecision(mode, prior.env_of(mode), (f"{mode} ({mode.speed}): {why}",), mode in prior.probes))
        elif not ok:
            out.append((mode, why))
    return tuple(later), tuple(out)


def _one_card(forced: Mode | None, reasons: list[str]) -> ModeDecision:
    if forced is not None and forced.needs_local_server_card:
        raise BadInput(f"--mode {forced} needs at least 2 cards", "pass --gpus with 2+ cards, or drop --mode")
    if forced is Mode.RPC:
        return ModeDecision(Mode.RPC, {}, tuple(reasons + ["forced by --mode rpc: the card runs behind one rpc-server"]))
    return ModeDecision(Mode.SINGLE, {}, tuple(reasons + ["one card: no multi-device context needed"]))


def _cpu_cards(forced: Mode | None, reasons: list[str], probes: dict[str, tuple[bool, str]]) -> ModeDecision:
    """CPU cards are rpc-servers: rpc, or hybrid when asked."""
    if forced is not None and (forced.one_context or forced is Mode.SINGLE):
        raise BadInput(f"--mode {forced} does not exist on the CPU backend",
                       "CPU cards are rpc-servers: use --mode rpc or --mode hybrid")
    if forced is Mode.HYBRID:
        return ModeDecision(Mode.HYBRID, {}, tuple(reasons + ["forced by --mode hybrid: the first CPU card runs in llama-server"]),
                            probes.get(Mode.HYBRID, (False, ""))[0])
    return ModeDecision(Mode.RPC, {}, tuple(reasons + [
        "the CPU backend has no multi-device context: each CPU card is its own rpc-server"]),
        probes.get(Mode.RPC, (False, ""))[0])


@dataclass(frozen=True)
class _Prior:
    """What is known of each mode before loading the model: probe results beat the version table."""

    backend: backends.Backend
    verdict: Verdict | None
    probes: dict[str, tuple[bool, str]]

    @property
    def bad_multi(self) -> bool:
        v = self.verdict
        return v is not None and v.status == "bad" and v.affects == "multi-device"

    def env_of(self, mode: Mode) -> dict[str, str]:
        """llama-server's extra environment in ``mode``: the workaround's, in multi+workaround."""
        if mode is not Mode.MULTI_WORKAROUND:
            return {}
        v = self.verdict
        return dict(v.env if v is not None and v.env else NEO_WORKAROUND_ENV)

    def works(self, mode: Mode) -> tuple[bool, str]:
        """(usable, why): a probe result beats the version prior."""
        verdict = self.verdict
        if mode in self.probes:
            ok, status = self.probes[mode]
            return ok, f"probe: {mode} {'worked' if ok else 'failed (' + status + ')'}"
        if mode is Mode.MULTI:
            if self.bad_multi:
                rule, sources = (verdict.rule, verdict.sources) if verdict is not None else ("?", ())
                return False, f"not probed; versions say it fails (rule {rule}: {', '.join(sources)})"
            if verdict is not None and verdict.status == "unknown":
                return True, (f"not probed; versions cannot tell ({verdict.summary}); if loading fails with "
                              f"'failed to allocate {self.backend.name.upper()}0 buffer', run `arcsplit doctor` "
                              f"or use --mode hybrid")
            return True, "not probed; " + (f"versions say it works ({verdict.summary})" if verdict else "no known bug")
        if mode is Mode.MULTI_WORKAROUND:
            return False, "not used unless a probe verified the workaround env"
        return True, "not probed; single-device contexts are not affected by the known multi-device bugs"


def _across_hosts(be: backends.Backend, n_here: int, n_remote: int, forced: str | None, verdict: Verdict | None,
                  probe_results: Iterable[ProbeLike] | Mapping[str, bool] | None) -> ModeDecision:
    """A layout with cards on other hosts: those are rpc-servers there whatever the mode; the mode is this
    machine's."""
    there = f"the {n_remote} card(s) on other hosts: rpc-servers there (one per card, or per host: rpc_servers)"
    if forced == Mode.SINGLE:
        raise BadInput("--mode single runs one card on this machine, but the layout has cards on other hosts",
                       "use --mode hybrid or rpc, or drop --mode")
    if n_here == 0:
        if forced in (Mode.MULTI, Mode.MULTI_WORKAROUND, Mode.HYBRID):
            raise BadInput(f"--mode {forced} needs a card on this machine for llama-server, but every card is on "
                           "another host", "use --mode rpc, or drop --mode")
        return ModeDecision(Mode.RPC, {}, (f"every card is on another host: {there}",))
    if n_here == 1 and not be.on_cpu and forced is None:
        return ModeDecision(Mode.HYBRID, {}, (f"one card here: llama-server holds it; {there}",))
    decision = choose_mode(be.name, max(n_here, 2), forced, verdict, probe_results)
    return replace(decision, reasons=(*decision.reasons, there))
