"""check_runtime: facts -> verdict -> probe (cached) -> mode, for ``arcsplit doctor`` and the supervisor.

This is the I/O side; mode.choose_mode stays pure and only sees the verdict and the probe results.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import backends
from ..errors import ArcsplitError
from ..modes import Mode
from .childenv import Dropped, clean_env
from .facts import Facts, gather_facts
from .locate import LlamaBinaries, server_build_info
from .mode import ModeDecision, choose_mode
from .probe import DEFAULT_TIMEOUT_S, ProbeResult, cache_key, load_cached, run_probes, save_cached
from .verdict import Verdict, verdict_for

@dataclass(frozen=True)
class RuntimeReport:
    backend: str
    gpus: tuple[int, ...]
    facts: Facts
    verdict: Verdict
    decision: ModeDecision
    probes: tuple[ProbeResult, ...] = ()
    probed_at: str | None = None  # ISO time of the probe (cached or fresh)
    probe_cached: bool = False
    probe_note: str | None = None  # why no probe ran, when none did
    cards: tuple[str, ...] = field(default=())
    env_dropped: tuple[Dropped, ...] = ()  # inherited variables every child gets changed (childenv.py)

    @property
    def multi_probe(self) -> ProbeResult | None:
        return next((p for p in self.probes if p.mode == Mode.MULTI), None)

    @property
    def disagreement(self) -> str | None:
        """The probe and the version table disagree: arcsplit follows the probe, and says so (the table rests on
        reports, e.g. the Ubuntu-kernel rule has a counterexample in ggml-org/llama.cpp#25286)."""
        multi, v = self.multi_probe, self.verdict
        if multi is None or v.affects != "multi-device":
            return None
        if v.status == "good" and not multi.ok:
            return (f"versions say one context works (rule {v.rule}) but the probe failed ({multi.status}): "
                    f"arcsplit follows the probe")
        if v.status == "bad" and multi.ok:
            return f"versions say one context fails (rule {v.rule}) but the probe worked: arcsplit follows the probe"
        return None

    @property
    def multi_broken(self) -> bool:
        """The one-context route fails here (by probe, else by versions): the case of ggml-org/llama.cpp#22885."""
        multi = self.multi_probe
        if multi is not None:
            return not multi.ok
        return self.verdict.status == "bad"

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "gpus": list(self.gpus), "cards": list(self.cards),
                "verdict": self.verdict.to_dict(), "mode": self.decision.mode, "env": dict(self.decision.env),
                "reasons": list(self.decision.reasons), "verified": self.decision.verified,
                "probe": {"results": [p.to_dict() for p in self.probes], "at": self.probed_at,
                          "cached": self.probe_cached, "note": self.probe_note},
                "facts": self.facts.to_dict(), "disagreement": self.disagreement,
                "env_dropped": [d.to_dict() for d in self.env_dropped]}


def probe_modes(backend: str, n_cards: int) -> tuple[Mode, ...]:
    """What to probe, fastest first (Backend.probe_modes); one card needs no multi-device probe."""
    return backends.get(backend).probe_modes if n_cards >= 2 else ()


def check_runtime(backend: str, gpus: Sequence[int], binaries: LlamaBinaries | None, reprobe: bool = False,
                  probe: bool | None = None, forced: str | None = None, sycl_ls_file: str | Path | None = None,
                  kernel: str | None = None, kernel_config: str | Path | None = None,
                  timeout: float = DEFAULT_TIMEOUT_S, cards: Sequence[str] = (),
                  sysfs_root: str | Path | None = "/sys",
                  progress: Callable[[str], None] = lambda line: None) -> RuntimeReport:
    """``probe``: None = probe SYCL rigs of 2+ cards (the broken case), True = always, False = never;
    ``reprobe`` ignores the cache. A probe needs this machine: file inputs (--sycl-ls, --kernel) turn it off."""
    build_info = None
    build_unread = None
    offline = sycl_ls_file is not None or kernel is not None or kernel_config is not None
    if offline:
        build_unread = "llama.cpp build: not in the given files (this machine's build is not the reporter's)"
        sysfs_root = None  # this machine's cards are not the reporter's
    elif binaries is not None:
        try:
            build_info = server_build_info(binaries)
        except ArcsplitError as exc:
            build_unread = f"llama.cpp build: {exc.problem} (on SYCL, a crash here is itself the ggml-org/llama.cpp#21747 signature)"
    facts = gather_facts(backend, build_info, sycl_ls_file, kernel, kernel_config, sysfs_root)
    if build_unread:
        unread = tuple(u for u in facts.unread if not u.startswith("llama.cpp build:"))
        facts = Facts(**{**facts.__dict__, "unread": unread + (build_unread,)})
    verdict = verdict_for(backend, facts)
    n = len(gpus)
    modes = probe_modes(backend, n)
    results: list[ProbeResult] = []
    at, cached, note = None, False, None
    want = (probe is True or reprobe) or (probe is None and backends.get(backend).probe_by_default)
    if probe is False:
        note = "probe skipped (--no-probe)"
    elif not modes:
        note = "one card: nothing to probe" if n < 2 else f"no probe for backend {backend}"
    elif offline:
        note = "no probe: --sycl-ls/--kernel/--kernel-config describe another machine than this one"
    elif not want:
        note = f"not probed: no known multi-device bug for {backend} (run with --reprobe to probe anyway)"
    elif binaries is None:
        note = "no probe: no llama.cpp build found"
    else:
        key = cache_key(facts.neo.label if facts.neo else None, facts.kernel.release,
                        f"{facts.llama_build} {_binary_id(binaries)}", backend, list(cards) or [str(g) for g in gpus])
        hit = None if reprobe else load_cached(key)
        if hit is not None:
            results, at = hit
            cached = True
        else:
            try:
                results = run_probes(modes, backend, list(gpus), binaries, timeout,
                                     workaround_env=verdict.env or None, progress=progress)
            except ImportError as exc:
                note = f"no probe: cannot generate the probe model ({exc})"
            else:
                if results:
                    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
                    save_cached(key, results)
    decision = choose_mode(backend, max(n, 1), forced, verdict, results)
    return RuntimeReport(backend, tuple(gpus), facts, verdict, decision, tuple(results), at, cached, note, tuple(cards),
                         clean_env(backend, os.environ)[1])


def _binary_id(binaries: LlamaBinaries) -> str:
    """A rebuild in place keeps the version string ("build 0" from an sdist) but not the file's mtime and size."""
    try:
        st = binaries.server.stat()
        return f"{binaries.server}@{int(st.st_mtime)}:{st.st_size}"
    except OSError:
        return str(binaries.server)
