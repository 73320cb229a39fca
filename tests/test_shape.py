"""The shape the code keeps, read from the source (nothing is imported or run): small functions, and imports at the
top of each module except where start-up time needs one inside a function, each such place listed in
arcsplit/__main__.py's docstring with what it costs (bench/import_costs.py measures it)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "arcsplit"
sys.path.insert(0, str(PKG.parent / "bench"))
from import_costs import function_imports  # noqa: E402

MAX_LINES = 80
MAX_FUNCTION_IMPORTS = 40

# Functions over MAX_LINES in files other work is reshaping at the same time; each goes once it is split.
LONG_ALLOWED: set[str] = set()
# Files whose function-level imports other work is moving at the same time; their imports are not yet listed in
# __main__.py. Each goes once its file's imports are at the top or listed.
IMPORTS_ALLOWED: set[str] = set()
# A row of __main__.py's list: "file:function  module  min/median/max ms (or a word)", why on the lines below.
_ROW = re.compile(r"^\s{4}(?P<where>[\w/]+\.py:\w+)\s+(?P<module>[\w.]+)\s+(?P<cost>\S+)$")


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((rel, node))
    return out


def _listed() -> set[tuple[str, str]]:
    """(file:function, module) of every row in __main__.py's docstring."""
    doc = ast.get_docstring(ast.parse((PKG / "__main__.py").read_text(encoding="utf-8"))) or ""
    return {(m["where"], m["module"]) for m in map(_ROW.match, doc.splitlines()) if m}


def test_no_function_is_over_80_lines():
    long = {f"{rel}:{fn.name}": fn.end_lineno - fn.lineno + 1 for rel, fn in _functions()
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES}
    over = {k: n for k, n in long.items() if k not in LONG_ALLOWED}
    assert not over, f"functions over {MAX_LINES} lines: {over}; split each into small functions that say why"
    stale = LONG_ALLOWED - set(long)
    assert not stale, f"no longer over {MAX_LINES} lines: remove {sorted(stale)} from LONG_ALLOWED"


def test_every_function_level_import_is_listed_with_its_cost():
    found = {(f"{rel}:{fn}", module) for rel, fn, module in function_imports() if rel not in IMPORTS_ALLOWED}
    listed = _listed()
    assert not found - listed, f"imports inside functions that arcsplit/__main__.py does not list: " \
                               f"{sorted(found - listed)}; move each to its module's top, or list it with its cost " \
                               "from bench/import_costs.py"
    assert not listed - found, f"arcsplit/__main__.py lists imports the code no longer makes: {sorted(listed - found)}"
    done = {rel for rel in IMPORTS_ALLOWED if not any(r == rel for r, _, _ in function_imports())}
    assert not done, f"no function-level imports left in {sorted(done)}: remove them from IMPORTS_ALLOWED"


def test_function_level_imports_are_few():
    """Each function's imports, nested functions' included (the count the project's checks use)."""
    per_file: dict[str, int] = {}
    for rel, fn in _functions():
        per_file[rel] = per_file.get(rel, 0) + sum(isinstance(s, (ast.Import, ast.ImportFrom)) for s in ast.walk(fn))
    listed = sum(n for rel, n in per_file.items() if rel not in IMPORTS_ALLOWED)
    assert listed < MAX_FUNCTION_IMPORTS
    if not IMPORTS_ALLOWED:
        assert sum(per_file.values()) < MAX_FUNCTION_IMPORTS


def test_the_walker_sees_what_it_must():
    """The import reader resolves relative imports and names the innermost function (the rows depend on both)."""
    got = set(function_imports())
    assert ("cli/node.py", "_node", "arcsplit.node.quick") in got
    assert ("inproc.py", "_bindings", "llama_cpp") in got
    assert _ROW.match("    cli/node.py:_node  arcsplit.node.quick  1/2/3")
