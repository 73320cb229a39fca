"""Which routes and settings ``arcsplit tune`` tries on a rig. Pure: the build's facts in, Candidates out.

A Candidate is a route (mode, -sm, environment variant, output placement, which backend) and a few settings
(ubatch, flash attention, KV cache type, expert offload). ``routes`` lists every route the build and the rig allow,
in arcsplit's fixed default order (one context > debug key > Vulkan multi > hybrid > all-RPC, llama/mode.py), so
the first one that fits is what ``serve`` would run without tuning. ``settings_variants`` varies one setting at a
time around a route's defaults: a full grid of every route times every setting would not fit a short budget.
Each environment variant names where it comes from; none is invented here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .. import backends
from ..decide.choice import Outcome
from ..llama.mode import NEO_WORKAROUND_ENV
from ..modes import Mode
from ..objectives import OBJECTIVES, better_first

Env = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class EnvVariant:
    """Extra environment for llama-server on a one-context route, with its upstream source."""

    name: str
    env: Env
    source: str


# Known variants of SYCL's -sm tensor: #26409 hangs above -ub 208 unless VMM is off or dev2dev copies go through the
# host; #27198 loses the device in dev2dev_memcpy, same host-forward workaround.
SYCL_TENSOR_VARIANTS = (
    EnvVariant("vmm0", (("GGML_SYCL_ENABLE_VMM", "0"),), "ggml-org/llama.cpp#26409"),
    EnvVariant("d2d2", (("GGML_SYCL_DEV2DEV_MEMCPY", "2"),), "ggml-org/llama.cpp#26409, ggml-org/llama.cpp#27198"),
)
# Intel's debug keys for the NEO multi-device allocation failure (no peer access): mode multi+workaround.
DEBUG_KEY = EnvVariant("debugkey", tuple(sorted(NEO_WORKAROUND_ENV.items())), "intel/compute-runtime#916")


@dataclass(frozen=True)
class Settings:
    """llama-server settings tune varies; None: the route's own default (Route.ubatch, backends' -fa, planner's
    expert offload)."""

    ubatch: int | None = None
    flash_attn: bool | None = None
    cache_type: str = "f16"
    moe_offload: int | None = None
    backend_sampling: bool = False  # llama-server --backend-sampling: the sampler chain in the output card's graph

    def label(self) -> str:
        parts = [f"ub{self.ubatch}" if self.ubatch else "",
                 "" if self.flash_attn is None else f"fa{'on' if self.flash_attn else 'off'}",
                 f"kv-{self.cache_type}" if self.cache_type != "f16" else "",
                 f"ncmoe{self.moe_offload}" if self.moe_offload is not None else "",
                 "bs" if self.backend_sampling else ""]
        return "/".join(p for p in parts if p) or "defaults"


@dataclass(frozen=True)
class Candidate:
    """One route with one set of settings: what a ServeRequest is changed by (tuning/picks.py request_for)."""

    mode: Mode
    backend: str
    split: str = "layer"  # -sm of a one-context route: layer or tensor
    variant: str = ""  # an EnvVariant's name, "" none
    env: Env = ()
    source: str = ""  # where the variant comes from
    output_layer: str = "auto"
    one_card: bool = False  # mode single on the first card of the rig: the whole model on one card
    settings: Settings = Settings()

    @property
    def route_key(self) -> str:
        """The route, without its settings: "multi-tensor-vmm0", "hybrid-local", "single-1card"."""
        parts: list[str] = [str(self.mode)]
        if self.split != "layer":
            parts.append(self.split)
        if self.variant:
            parts.append(self.variant)
        if self.output_layer != "auto":
            parts.append(self.output_layer)
        if self.one_card:
            parts.append("1card")
        return "-".join(parts)

    @property
    def key(self) -> str:
        """Unique within one fingerprint: backend, route and settings."""
        return f"{self.backend}:{self.route_key}:{self.settings.label()}"

    @property
    def server_args(self) -> tuple[str, ...]:
        """Flags appended to llama-server's argv (llama.cpp takes the last -sm)."""
        return (("-sm", "tensor") if self.split == "tensor" else ()) + \
            (("--backend-sampling",) if self.settings.backend_sampling else ())

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "mode": self.mode, "backend": self.backend, "split": self.split,
                "variant": self.variant, "env": dict(self.env), "source": self.source,
                "output_layer": self.output_layer, "one_card": self.one_card,
                "settings": {"ubatch": self.settings.ubatch, "flash_attn": self.settings.flash_attn,
                             "cache_type": self.settings.cache_type, "moe_offload": self.settings.moe_offload,
                             "backend_sampling": self.settings.backend_sampling}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Candidate":
        s = d.get("settings") or {}
        return cls(Mode(str(d["mode"])), str(d["backend"]), str(d.get("split", "layer")), str(d.get("variant", "")),
                   tuple(sorted((str(k), str(v)) for k, v in (d.get("env") or {}).items())),
                   str(d.get("source", "")), str(d.get("output_layer", "auto")), bool(d.get("one_card")),
                   Settings(s.get("ubatch"), s.get("flash_attn"), str(s.get("cache_type", "f16")),
                            s.get("moe_offload"), bool(s.get("backend_sampling", False))))


@dataclass(frozen=True)
class BuildFacts:
    """What the builds on this machine can do, read by the caller (features reader, managed builds)."""

    tensor_split: bool = False  # llama-server --help lists "tensor" for -sm
    vulkan: bool = False  # a Vulkan build exists beside the rig's own backend
    backend_sampling: bool = False  # llama-server --help lists --backend-sampling


def routes(backend: str, n_cards: int, facts: BuildFacts = BuildFacts()) -> list[Candidate]:
    """Every route this build and rig allow, in the fixed default order (llama/mode.py), settings at defaults.
    With 2+ cards, the whole model on the first card comes first: one card can beat a split
    (ggml-org/llama.cpp#26409: 21.5 t/s on one B70, 20.1 with -sm layer); the planner prunes it when it does not fit."""
    if n_cards < 2:
        return [Candidate(Mode.SINGLE, backend)]
    be = backends.get(backend)
    out = [Candidate(Mode.SINGLE, backend, one_card=True)]
    if not be.on_cpu:
        out.append(Candidate(Mode.MULTI, backend))
        if facts.tensor_split:
            # llama.cpp refuses -sm tensor without flash attention ("SPLIT_MODE_TENSOR requires flash_attn to be
            # enabled", src/llama-context.cpp), so where the backend's default is off (SYCL) it is turned on
            tensor = Settings(flash_attn=None if be.flash_attn else True)
            out.append(Candidate(Mode.MULTI, backend, split="tensor", settings=tensor))
            if backend == backends.SYCL:
                out += [Candidate(Mode.MULTI, backend, split="tensor", variant=v.name, env=v.env, source=v.source,
                                  settings=tensor) for v in SYCL_TENSOR_VARIANTS]
        if be.one_context_workaround:
            out.append(Candidate(Mode.MULTI_WORKAROUND, backend, variant=DEBUG_KEY.name, env=DEBUG_KEY.env,
                                 source=DEBUG_KEY.source))
    if facts.vulkan and backend != backends.VULKAN:
        out.append(Candidate(Mode.MULTI, backends.VULKAN))
    out += [Candidate(Mode.HYBRID, backend, output_layer="last"), Candidate(Mode.HYBRID, backend, output_layer="local"),
            Candidate(Mode.RPC, backend)]
    return out


UBATCHES = (256, 512, 1024)


def settings_variants(base: Candidate, route_ubatch: int, flash_default: bool, moe_layers: int = 0,
                      moe_max: int = 0, backend_sampling: bool = False) -> list[Candidate]:
    """One setting changed at a time from ``base``'s defaults: the other ubatches, flash attention flipped, a q8_0
    KV cache (needs flash attention), and for a MoE whose experts partly stay in host RAM (``moe_layers``, the
    planner's count), two more layers there (frees card memory for a larger ubatch or context), at most
    ``moe_max`` (the model's layers; 0: no bound): a count past them is no setting the planner accepts.

    With ``backend_sampling`` (the build has the flag) and a GPU backend: sampling on the output card. It trades a
    longer time to first token for decode: a token id comes back instead of the logits (n_vocab floats a token,
    600 KiB at a 152k vocabulary, over the link on a split route). On one H100, a MoE with Qwen3's vocabulary:
    all-RPC decode 1.27x and 4 streams 1.39x its own without it, time to first token 1.11x as long; on CPU cards
    sampling in a ggml graph is slower than llama-server's own, so it is not tried there."""
    s = base.settings
    out = [replace(base, settings=replace(s, ubatch=u)) for u in UBATCHES if u != (s.ubatch or route_ubatch)]
    if base.split != "tensor":  # -sm tensor needs flash attention (routes above): no variant without it
        out.append(replace(base, settings=replace(s, flash_attn=not flash_default)))
    out.append(replace(base, settings=replace(s, cache_type="q8_0", flash_attn=True)))
    more = min(moe_layers + 2, moe_max) if moe_max else moe_layers + 2
    if moe_layers and more > moe_layers:
        out.append(replace(base, settings=replace(s, moe_offload=more)))
    if backend_sampling and not backends.get(base.backend).on_cpu:
        out.append(replace(base, settings=replace(s, backend_sampling=True)))
    return out


def rank(results: Mapping[str, Mapping[str, Any]], objective: str) -> list[str]:
    """Keys of the correct, measured results, best first for ``objective``: the highest rate for decode, prefill
    and streams, the shortest time to first token for ttft. A result without that figure is not ranked."""
    if objective not in OBJECTIVES:
        raise ValueError(objective)
    ok = [(float(r[objective]), k) for k, r in results.items()
          if r.get("status") == Outcome.OK and isinstance(r.get(objective), (int, float))]
    return [k for _, k in sorted(ok, key=lambda x: better_first(objective, x[0]))]


_SPLIT_MODES = re.compile(r"--split-mode\s+\{([^}]*)\}")


def split_modes(help_text: str) -> tuple[str, ...]:
    """The values llama-server's ``--help`` lists for -sm ("-sm,   --split-mode {none,layer,row,tensor}")."""
    m = _SPLIT_MODES.search(help_text)
    return tuple(v.strip() for v in m.group(1).split(",")) if m else ()
