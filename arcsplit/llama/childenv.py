"""The environment llama.cpp's processes get: the user's, minus credentials and inherited settings known to hurt
on SYCL.

Credentials: a shell that serves models often holds tokens and cloud keys (HF_TOKEN, AWS_SECRET_ACCESS_KEY,
OPENAI_API_KEY, ...). No child of arcsplit needs them: rpc-servers and ssh get none, llama-server only its own API
key (LLAMA_API_KEY). A credential is known by its name (``redact.is_secret_name``: the same rule says what
``arcsplit report`` redacts); ``ARCSPLIT_KEEP_ENV`` keeps one that a child really needs. Dropped silently: naming them on every start would only repeat the user's secrets' names.

Users copy Intel GPU recipes into their shell profile; a few of those variables are reported to make llama.cpp's
SYCL backend slow, wrong or crash. Every child arcsplit starts (rpc-servers, llama-server, the probe's processes)
gets the environment this module returns, and ``arcsplit doctor`` names what it dropped and why. Each entry cites
where the harm was reported; ``ARCSPLIT_KEEP_ENV=VAR[,VAR]`` keeps a variable the user really wants. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .. import backends
from ..redact import is_secret_name

KEEP_VAR = "ARCSPLIT_KEEP_ENV"
SERVER_KEY_VAR = "LLAMA_API_KEY"  # llama-server's --api-key (common/arg.cpp set_env): the one credential it keeps
# ssh's agent socket: a path that ssh needs to log in to other hosts, though the rule's AUTH word names it.
ALWAYS_KEPT = ("SSH_AUTH_SOCK",)


def credentials(environ: Mapping[str, str], keep: Iterable[str] = ()) -> list[str]:
    """The credential variables of ``environ`` a child does not get: all but ``keep`` and ARCSPLIT_KEEP_ENV's."""
    kept = {*keep, *ALWAYS_KEPT} | {v.strip() for v in environ.get(KEEP_VAR, "").split(",") if v.strip()}
    return [name for name in environ if name not in kept and is_secret_name(name)]


def child_environ(environ: Mapping[str, str], keep: Iterable[str] = ()) -> dict[str, str]:
    """``environ`` without its credentials (``keep`` aside): what a child of arcsplit starts from."""
    drop = set(credentials(environ, keep))
    return {k: v for k, v in environ.items() if k not in drop}


@dataclass(frozen=True)
class Hygiene:
    """One rule: ``var`` inherited with a value other than ``value`` is replaced by it (None: removed)."""

    var: str
    value: str | None
    why: str
    sources: tuple[str, ...]


# Only SYCL reads these; other backends keep the user's environment untouched.
SYCL_RULES: tuple[Hygiene, ...] = (
    Hygiene("GGML_SYCL_DISABLE_OPT", None,
            "turns off the SYCL backend's optimized kernels (weight reorder, MMVQ): reported ~50% slower generation "
            "on Battlemage; llama.cpp's default (0) is the fast path. Keep it only as a correctness workaround",
            ("ggml-org/llama.cpp#22413", "arc-llama src/arc_llama/arch.py")),
    Hygiene("SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS", None,
            "shipped by IPEX-LLM's Ollama bundle; reported to give degenerate output (gibberish) on every request "
            "after the first; plain llama.cpp does not need it",
            ("arc-llama src/arc_llama/arch.py",)),
    Hygiene("SYCL_CACHE_PERSISTENT", "0",
            "the persistent SYCL kernel cache segfaults in llama.cpp's SYCL backend (deterministic on Xe2/Xe3 with "
            "the Level Zero V2 adapter, oneAPI 2026.x; stale entries of another build on Battlemage); it only "
            "speeds up start-up (~20 s of JIT), off is the SYCL default",
            ("intel/llvm#22853", "ggml-org/llama.cpp#22095", "arc-llama src/arc_llama/arch.py")),
)


@dataclass(frozen=True)
class Dropped:
    """What was changed in the inherited environment, with the rule that changed it."""

    var: str
    inherited: str
    now: str | None  # None: removed
    why: str
    sources: tuple[str, ...]

    def line(self) -> str:
        now = "removed" if self.now is None else f"set to {self.now}"
        return f"{self.var}={self.inherited} {now}: {self.why} ({', '.join(self.sources)})"

    def to_dict(self) -> dict[str, object]:
        return {"var": self.var, "inherited": self.inherited, "now": self.now, "why": self.why,
                "sources": list(self.sources)}


def rules_for(backend: str) -> tuple[Hygiene, ...]:
    return SYCL_RULES if backend == backends.SYCL else ()


def clean_env(backend: str, environ: Mapping[str, str]) -> tuple[dict[str, str], tuple[Dropped, ...]]:
    """(the environment a child gets, what was dropped and why: the SYCL rules; credentials go unreported).
    Variables the user lists in ARCSPLIT_KEEP_ENV stay as they are."""
    keep = {v.strip() for v in environ.get(KEEP_VAR, "").split(",") if v.strip()}
    env = child_environ(environ)  # a llama.cpp tool run by itself (probe, fit-params) needs no key at all
    dropped = []
    for rule in rules_for(backend):
        inherited = env.get(rule.var)
        if inherited is None or inherited == rule.value or rule.var in keep:
            continue
        if rule.value is None:
            del env[rule.var]
        else:
            env[rule.var] = rule.value
        dropped.append(Dropped(rule.var, inherited, rule.value, rule.why, rule.sources))
    return env, tuple(dropped)


def overlay(dropped: tuple[Dropped, ...]) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The same change as (variables to set, variables to remove) on top of an inherited environment."""
    return (tuple(sorted((d.var, d.now) for d in dropped if d.now is not None)),
            tuple(sorted(d.var for d in dropped if d.now is None)))
