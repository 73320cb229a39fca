"""The house's import graph, read from the source (no import runs): data flows one way, surfaces use the API.

Layers, bottom up: the pure core (model, planner, memory, rig, synth, backends, modes, roles, route, samples, hosts,
netaddr) -> llama/ (llama.cpp's binaries) -> proc/ (process mechanics and the node wire protocol) -> decide/
(request -> plan -> process specs) -> run/ (supervising a group, here and through other hosts' agents) ->
telemetry/ -> node/ (the agent on another host) -> the surfaces (cli/, tui/, _api.py and _warm.py, inproc.py). A
module may import its own layer and the ones below, never one above; run/ and node/ never import each other; the
CLI reaches decide/ and run/ only through the public API; no circle of imports, however late (inside a function,
under TYPE_CHECKING). docs/architecture.md tells why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "arcsplit"
PURE = {"model", "planner", "memory", "rig", "synth", "errors", "_dirs", "backends", "redact", "route", "hosts", "durations",
        "modes", "roles", "samples", "netaddr", "objectives"}
RANK = {**{m: 0 for m in PURE}, "llama": 1, "demo": 1, "proc": 2, "decide": 3, "run": 4, "telemetry": 5, "node": 6,
        "cli": 7, "tui": 7, "_api": 7, "_warm": 7, "inproc": 7, "__main__": 7, "report": 7, "__init__": 7, "tuning": 7}


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


def test_every_package_and_module_has_a_rank():
    units = {_unit(p) for p in PKG.rglob("*.py")}
    assert not units - RANK.keys(), f"give {sorted(units - RANK.keys())} a rank in RANK (and docs/architecture.md)"


def test_the_walker_sees_relative_and_absolute_imports():
    assert "_api" in imports(PKG / "cli" / "serve_run.py")  # the CLI's serve goes through the API
    assert "run" in imports(PKG / "_api.py") and "llama" in imports(PKG / "decide" / "prepare.py")
    assert imports(PKG / "run" / "bus.py") >= {"_dirs", "errors", "proc"} and "run" in imports(PKG / "run" / "supervisor.py")


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_import_runs_back_up_the_house(path):
    mine = RANK[_unit(path)]
    above = sorted(u for u in imports(path) if RANK.get(u, -1) > mine and u != _unit(path))
    assert not above, f"{path.relative_to(PKG)} imports {above}, a layer above its own"


@pytest.mark.parametrize("path", sorted((PKG / "cli").glob("*.py")), ids=lambda p: p.name)
def test_the_cli_reaches_the_running_side_only_through_the_api(path):
    # _warm: the API's light part, so that serve can open other hosts before the serving stack is imported
    for unit in ("run", "decide"):
        assert unit not in imports(path), f"cli/{path.name} imports arcsplit.{unit}: use arcsplit._api (or _warm)"


def test_the_planner_oracle_is_not_in_the_pure_core():
    # llama-fit-params (the oracle, and plan --measure) runs processes: beside the pure planner it dragged llama/ in
    assert not (PKG / "fitoracle.py").exists() and "llama" not in imports(PKG / "planner.py")
    assert (PKG / "llama" / "fitparams.py").exists()  # it runs processes: the llama/ layer, above the planner


@pytest.mark.parametrize("a, b", [("run", "node"), ("node", "run")])
def test_run_and_node_share_process_mechanics_through_proc_only(a, b):
    # the supervisor and the node agent both start and watch processes: arcsplit/proc/ holds what they share
    bad = sorted(str(p.relative_to(PKG)) for p in (PKG / a).rglob("*.py") if b in imports(p))
    assert not bad, f"{bad} import arcsplit.{b}: move what they share to arcsplit/proc/"


def _module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom | ast.Import, pkg: Path = PKG) -> set[str]:
    """The modules of ``pkg`` one import statement loads by name: ``from p import m`` counts p.m where m is a
    module, and p itself only for a name that is not one (p's own code defines it)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith(f"{pkg.name}.")}
    here = _module_name(path, pkg).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the module's package
    base = here[: len(here) - node.level + 1] if node.level else []
    target = ".".join(base + (node.module.split(".") if node.module else []))
    if target.split(".")[0] != pkg.name:
        return set()
    found = set()
    for a in node.names:
        sub = pkg.parent / f"{target}.{a.name}".replace(".", "/")
        found.add(f"{target}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else target)
    return found


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Each module of ``pkg`` -> the modules of ``pkg`` it imports, by every import statement in it: at the top,
    inside a function (a lazy import runs later, but it runs), and under ``if TYPE_CHECKING`` (for the type checker
    only, but two modules that name each other are still one piece cut in two)."""
    graph = {}
    for path in pkg.rglob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= _resolve(path, node, pkg)
        graph[_module_name(path, pkg)] = found
    return {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_a_circle_closed_by_a_lazy_or_type_checking_import_is_found(tmp_path):
    """The circles a reading of module-level imports alone missed: one closed by an import inside a function, one
    by an import under ``if TYPE_CHECKING``; and ``from . import m`` names the module m, not the package."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("def late():\n    from .a import A\n    return A\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (pkg / "d.py").write_text("from . import c\nD = 1\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_import_circle():
    graph = import_graph()
    assert "arcsplit.proc.spawn" in graph["arcsplit.proc.child"]  # the walker resolves "from . import spawn"
    assert "arcsplit.node.agent" in graph["arcsplit.node.quick"]  # and counts an import inside a function
    assert not circles(graph), f"import circles (lazy and TYPE_CHECKING imports included): {circles(graph)}; " \
                               "make each dependency run one way: move the piece both need to where it belongs"


LAZY_CHECKED = ("proc", "decide", "run", "node", "_api", "_warm")


@pytest.mark.parametrize("unit", LAZY_CHECKED)
def test_an_import_inside_a_function_says_what_start_up_it_saves(unit):
    # an import at the top costs every start of the CLI or the node agent once; one inside a function is there for
    # start-up time only, and says so on its line ("# start-up: <why>"), or it belongs at the top
    paths = sorted((PKG / unit).rglob("*.py")) if (PKG / unit).is_dir() else [PKG / f"{unit}.py"]
    bare = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and "# start-up:" not in lines[node.lineno - 1]:
                        if not (isinstance(node, ast.Import) and lines[node.lineno - 2].strip().startswith("import ")
                                and "# start-up:" in lines[node.lineno - 2]):  # a second line of the same import
                            bare.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bare, f"function-level imports without '# start-up: <why>': {bare}"
