"""What each import arcsplit makes inside a function would cost at its module's top: the figures arcsplit/__main__.py
lists beside each one.

    python bench/import_costs.py [--runs 7] [--out bench/results/import_costs.md]

For every function-level import in arcsplit/ (read from the source, as tests/test_shape.py reads it), a fresh
interpreter imports arcsplit.cli and the module holding the import (bytecode compiled first, as pip install would),
then times the import itself: what moving it to the module's top would add to every command that imports that
module. Prints min/median/max over the runs in milliseconds; the machine's other load moves them, so compare
medians from one run of this bench.
"""

from __future__ import annotations

import argparse
import ast
import compileall
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "arcsplit"


def function_imports() -> list[tuple[str, str, str]]:
    """(file under arcsplit/, innermost enclosing function, absolute module imported) for each function-level import."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        package = ("arcsplit", *path.relative_to(PKG).parent.parts)

        def visit(node: ast.AST, fn: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
                if fn is not None and isinstance(child, ast.Import):
                    out.extend((rel, fn, a.name) for a in child.names)
                elif fn is not None and isinstance(child, ast.ImportFrom):
                    base = package[: len(package) - child.level + 1] if child.level else ()
                    module = ".".join((*base, *([child.module] if child.module else [])))
                    subs = [f"{module}.{a.name}" for a in child.names if _is_module(f"{module}.{a.name}")]
                    out.extend((rel, fn, m) for m in subs or [module])  # `from ..node import standing`: the module
                visit(child, name)

        visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return out


def _is_module(name: str) -> bool:
    """An arcsplit module or package of that dotted name exists."""
    parts = name.split(".")
    if parts[0] != "arcsplit":
        return False
    path = PKG.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def holder(rel: str) -> str:
    """The module name of a file under arcsplit/."""
    parts = ["arcsplit", *Path(rel).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cost_ms(rel: str, module: str, runs: int) -> list[float] | None:
    code = (f"import importlib, time\nimport arcsplit.cli, {holder(rel)}\nt = time.perf_counter()\n"
            f"importlib.import_module({module!r})\nprint((time.perf_counter() - t) * 1000)")
    got = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            return None  # not importable here (an optional dependency, a library it loads)
        got.append(float(r.stdout))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args()
    compileall.compile_dir(PKG, quiet=1)  # as pip install would: time imports, not compiles
    rows = [f"{'file:function':<40} {'module':<32} {'min':>7} {'median':>7} {'max':>7}  (ms, {args.runs} runs)"]
    seen = set()
    for rel, fn, module in function_imports():
        if (rel, fn, module) in seen:
            continue
        seen.add((rel, fn, module))
        ms = cost_ms(rel, module, args.runs)
        figures = "not importable here" if ms is None else \
            f"{min(ms):7.1f} {statistics.median(ms):7.1f} {max(ms):7.1f}"
        rows.append(f"{rel + ':' + fn:<40} {module:<32} {figures}")
        print(rows[-1] if len(rows) > 2 else "\n".join(rows), flush=True)
    if args.out:
        args.out.write_text("```\n" + "\n".join(rows) + "\n```\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
