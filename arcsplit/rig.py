"""Cards and rigs: the memory a plan must fit into, live or described in a layout file.

A layout (``layouts/*.toml``) describes a rig you may not have::

    name = "2x Arc Pro B70 32 GB"
    [[cards]]
    backend = "sycl"
    name = "Intel(R) Arc(TM) Pro B70 Graphics"
    memory_mib = 32656        # total
    free_mib = 32000          # optional, defaults to memory_mib
    margin_mib = 1024         # optional, kept free by the planner

An optional ``[plan]`` table pins a plan (``n_ctx``, ``tensor_split``, ...); it is kept as a dict.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import backends
from .errors import BadInput

MiB = 1024 * 1024


def default_margin(backend: str) -> int:
    """Bytes kept free per card: llama.cpp's own --fit-target for GPUs. A CPU card's budget is already the limit,
    so it keeps only 16 MiB: the compute model was measured up to ~1.5 MiB low on the demo model's cards
    (bench/results/fit_context.md), and a plan must never allocate past what it promised."""
    return 16 * MiB if backend == "cpu" else 1024 * MiB


@dataclass(frozen=True)
class Card:
    """One device that holds layers: a GPU, or a CPU budget served by an rpc-server."""

    backend: str
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    margin_bytes: int = -1
    pci: str | None = None
    driver: str | None = None

    def __post_init__(self) -> None:
        backends.get(self.backend)  # an unknown name is a one-line error
        if self.total_bytes <= 0 or self.free_bytes <= 0:
            raise BadInput(f"card {self.index} ({self.name}) has no memory", "give it a positive memory_mib/free_mib")
        if self.free_bytes > self.total_bytes:
            object.__setattr__(self, "free_bytes", self.total_bytes)
        if self.margin_bytes < 0:
            object.__setattr__(self, "margin_bytes", default_margin(self.backend))

    @property
    def device(self) -> str:
        """The name llama.cpp gives this card in a process that sees all cards (SYCL0, CUDA1, ...)."""
        return backends.get(self.backend).device_name(self.index)

    @property
    def budget_bytes(self) -> int:
        """What the planner may fill: free memory less the margin."""
        return max(0, self.free_bytes - self.margin_bytes)


@dataclass(frozen=True)
class Rig:
    """The cards a model is split across, in the order the user gave them."""

    cards: tuple[Card, ...]
    name: str | None = None
    pinned_plan: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.cards:
            raise BadInput("the rig has no cards", "list at least one card")


def load_layout(path: str | Path) -> Rig:
    """Read a layout TOML file; every mistake becomes a one-line BadInput."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"layout {p} is a directory", "pass a .toml file")
    if p.exists() and not p.is_file():  # a FIFO or device: reading it would wait forever
        raise BadInput(f"layout {p} is not a regular file (a pipe or device?)", "pass a .toml file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"layout {p} does not exist", "check the path or pick one from layouts/") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read layout {p}: {exc}", "check the file's permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"layout {p} is not valid TOML ({exc})", "fix the syntax at that line") from None
    raw_cards = data.get("cards")
    if not isinstance(raw_cards, list) or not raw_cards:
        raise BadInput(f"layout {p} has no [[cards]]", "add one [[cards]] table per card")
    cards = []
    for i, raw in enumerate(raw_cards):
        if not isinstance(raw, dict):
            raise BadInput(f"layout {p}: cards[{i}] is not a table", "write each card as [[cards]]")
        cards.append(_card_from_toml(p, i, raw))
    pinned = data.get("plan", {})
    if not isinstance(pinned, dict):
        raise BadInput(f"layout {p}: [plan] is not a table", "write it as a [plan] table")
    name = data.get("name")
    return Rig(cards=tuple(cards), name=str(name) if name is not None else p.stem, pinned_plan=pinned)


def _mib(p: Path, i: int, raw: dict[str, Any], key: str, default: float | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise BadInput(f"layout {p}: cards[{i}] has no {key}", f"add {key} = <MiB>")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"layout {p}: cards[{i}].{key} is not a number", f"write {key} = <MiB>")
    if value < 0 or (value == 0 and key != "margin_mib"):
        raise BadInput(f"layout {p}: cards[{i}].{key} = {value} must be positive", "give the card's memory in MiB")
    return int(value * MiB)


def _card_from_toml(p: Path, i: int, raw: dict[str, Any]) -> Card:
    backend = str(raw.get("backend", "")).lower()
    if backend not in backends.NAMES:
        raise BadInput(f"layout {p}: cards[{i}].backend {raw.get('backend')!r} is unknown", f"use one of {', '.join(backends.NAMES)}")
    total = _mib(p, i, raw, "memory_mib", None)
    free = _mib(p, i, raw, "free_mib", total / MiB)
    margin = _mib(p, i, raw, "margin_mib", default_margin(backend) / MiB)
    index = raw.get("index", i)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BadInput(f"layout {p}: cards[{i}].index must be a non-negative integer", "write index = 0, 1, ...")
    return Card(
        backend=backend,
        index=index,
        name=str(raw.get("name", f"{backend} card {i}")),
        total_bytes=total,
        free_bytes=free,
        margin_bytes=margin,
        pci=raw.get("pci"),
        driver=raw.get("driver"),
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def dump_layout(rig: Rig, plan: dict[str, Any] | None = None) -> str:
    """Render a rig (and optionally a pinned plan) as layout TOML that load_layout reads back."""
    lines = [f"name = {_toml_value(rig.name or 'my rig')}", ""]
    for card in rig.cards:
        lines.append("[[cards]]")
        lines.append(f"backend = {_toml_value(card.backend)}")
        lines.append(f"index = {card.index}")
        lines.append(f"name = {_toml_value(card.name)}")
        lines.append(f"memory_mib = {card.total_bytes // MiB}")
        lines.append(f"free_mib = {card.free_bytes // MiB}")
        lines.append(f"margin_mib = {card.margin_bytes // MiB}")
        if card.pci:
            lines.append(f"pci = {_toml_value(card.pci)}")
        if card.driver:
            lines.append(f"driver = {_toml_value(card.driver)}")
        lines.append("")
    if plan:
        lines.append("[plan]")
        for key, value in plan.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def save_layout(path: str | Path, rig: Rig, plan: dict[str, Any] | None = None) -> Path:
    """Write atomically, so an interrupted save never leaves half a file."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(dump_layout(rig, plan), encoding="utf-8")
        tmp.replace(p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write layout {p}: {exc.strerror}", "pick a writable path") from None
    return p
