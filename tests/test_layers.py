"""The house's import graph, read from the source (no import runs): data flows one way, surfaces use the API.

Layers, bottom up: the pure core (model, planner, memory, rig, synth, backends, route, hosts) -> llama/ (llama.cpp's
binaries) -> run/ (processes and sockets) -> telemetry/ -> the surfaces (cli/, tui/, _api.py and _warm.py, inproc.py). A module
may import its own layer and the ones below, never one above; the CLI reaches run/ only through the public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "arcsplit"
PURE = {"model", "planner", "memory", "rig", "synth", "errors", "_dirs", "backends", "redact", "route", "hosts"}
RANK = {**{m: 0 for m in PURE}, "llama": 1, "demo": 1, "run": 2, "telemetry": 3, "cli": 4, "tui": 4, "_api": 4, "_warm": 4,
        "inproc": 4, "__main__": 4, "report": 4}


def _unit(path: Path) -> str:
    """The house unit of a module: its top-level package or module name under arcsplit/."""
    return path.relative_to(PKG).parts[0].removesuffix(".py")


def imports(path: Path) -> set[str]:
    """The arcsplit units a module imports (relative or absolute, at any depth in the module)."""
    package = path.relative_to(PKG).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1]) if node.level > 1 else list(package)
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # "from . import x" at the top: x is the unit
                    found |= {a.name for a in node.names}
                    continue
                found.add(parts[0])
            elif node.module and node.module.split(".")[0] == "arcsplit":
                rest = node.module.split(".")[1:]
                found |= {rest[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "arcsplit" and len(parts) > 1:
                    found.add(parts[1])
    return found


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if _unit(p) in RANK)


def test_the_walker_sees_relative_and_absolute_imports():
    assert "_api" in imports(PKG / "cli" / "serve.py")  # the CLI's serve goes through the API
    assert "run" in imports(PKG / "_api.py") and "llama" in imports(PKG / "run" / "prepare.py")
    assert imports(PKG / "run" / "bus.py") >= {"_dirs", "errors", "run"}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_import_runs_back_up_the_house(path):
    mine = RANK[_unit(path)]
    above = sorted(u for u in imports(path) if RANK.get(u, -1) > mine and u != _unit(path))
    assert not above, f"{path.relative_to(PKG)} imports {above}, a layer above its own"


@pytest.mark.parametrize("path", sorted((PKG / "cli").glob("*.py")), ids=lambda p: p.name)
def test_the_cli_reaches_the_running_side_only_through_the_api(path):
    # _warm: the API's light part, so that serve can open other hosts before the serving stack is imported
    assert "run" not in imports(path), f"cli/{path.name} imports arcsplit.run: use arcsplit._api (or _warm)"


def test_the_planner_oracle_is_not_in_the_pure_core():
    # llama-fit-params (the oracle, and plan --measure) runs processes: beside the pure planner it dragged llama/ in
    assert not (PKG / "fitoracle.py").exists() and "llama" not in imports(PKG / "planner.py")
    assert (PKG / "llama" / "fitparams.py").exists()  # it runs processes: the llama/ layer, above the planner
