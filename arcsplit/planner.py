"""ModelProfile + cards + options -> Plan. Pure: no processes, no I/O.

The value types below are the contract the rest of arcsplit (specs, supervisor, surfaces) relies on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .rig import Card

HOST_DEVICE = "CPU"
"""Device name of llama-server's own CPU: layers planned there are simply not offloaded."""


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for; ``n_ctx=None`` means the largest context that fits."""

    n_ctx: int | None = None
    n_parallel: int = 1
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: bool = True
    swa_full: bool = False


@dataclass(frozen=True)
class CardPlan:
    """One card's share: layers ``[first_layer, end_layer)`` and the bytes they need there."""

    card: Card
    device: str
    first_layer: int
    end_layer: int
    weights: int
    kv: int
    state: int
    compute: int
    has_output: bool = False

    @property
    def n_layers(self) -> int:
        return self.end_layer - self.first_layer

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute

    @property
    def free_after(self) -> int:
        return self.card.free_bytes - self.total


@dataclass(frozen=True)
class Plan:
    """Where every layer lives and what each card must hold; cards are in llama.cpp's device order."""

    model_path: str
    arch: str
    n_layer: int
    n_ctx: int
    options: PlanOptions
    cards: tuple[CardPlan, ...]
    host_bytes: int = 0
    warnings: tuple[str, ...] = field(default=())

    @property
    def offloaded(self) -> tuple[CardPlan, ...]:
        """Cards other than llama-server's own CPU (which keeps the first, non-offloaded layers)."""
        return tuple(c for c in self.cards if c.device != HOST_DEVICE)

    @property
    def tensor_split(self) -> tuple[int, ...]:
        """Integer layer counts per offloaded device: exact in llama.cpp's upper_bound rule."""
        return tuple(c.n_layers for c in self.offloaded)

    @property
    def n_gpu_layers(self) -> int:
        return sum(self.tensor_split)

    def llama_server_args(self, devices: list[str] | None = None) -> list[str]:
        """The placement flags for llama-server. ``devices`` renames the offloaded cards (e.g. RPC0, SYCL0)."""
        names = devices if devices is not None else [c.device for c in self.offloaded]
        o = self.options
        args: list[str] = []
        if names:
            args += ["--device", ",".join(names)]
        else:
            args += ["--device", "none"]
        args += ["-ngl", str(self.n_gpu_layers)]
        if len(self.tensor_split) > 1:
            args += ["-ts", ",".join(str(n) for n in self.tensor_split)]
            args += ["-sm", "layer"]
        args += ["-c", str(self.n_ctx), "-np", str(o.n_parallel)]
        args += ["--kv-unified"] if o.kv_unified else ["--no-kv-unified"]
        args += ["-b", str(o.n_batch), "-ub", str(o.n_ubatch)]
        args += ["-ctk", o.cache_type_k, "-ctv", o.cache_type_v]
        args += ["-fa", "on" if o.flash_attn else "off"]
        if o.swa_full:
            args += ["--swa-full"]
        args += ["--fit", "off"]
        return args

    def to_dict(self) -> dict[str, Any]:
        """The --json contract: n_ctx, tensor_split, cards (llama.cpp order), llama_server_args."""
        return {
            "model": self.model_path,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_ctx": self.n_ctx,
            "n_gpu_layers": self.n_gpu_layers,
            "tensor_split": list(self.tensor_split),
            "options": asdict(self.options),
            "host_bytes": self.host_bytes,
            "cards": [
                {
                    "device": c.device,
                    "backend": c.card.backend,
                    "index": c.card.index,
                    "name": c.card.name,
                    "layers": [c.first_layer, c.end_layer],
                    "has_output": c.has_output,
                    "free": c.card.free_bytes,
                    "margin": c.card.margin_bytes,
                    "bytes": {
                        "weights": c.weights,
                        "kv": c.kv,
                        "state": c.state,
                        "compute": c.compute,
                        "total": c.total,
                    },
                    "free_after": c.free_after,
                }
                for c in self.cards
            ],
            "llama_server_args": self.llama_server_args(),
            "warnings": list(self.warnings),
        }
