"""Sizes of a source tree's modules and functions, its process-wide switches and its import circles.

    python tools/code_sizes.py .              # this checkout
    python tools/code_sizes.py .bench_old     # another tree (e.g. a `git archive` of an earlier commit)

Counts ``packages/*/src`` and ``apps/*/src``: files, lines, the largest modules and functions, every module over
400 lines and every function over 80 lines, module-level ``set_*`` functions (process-wide setters), the
``MOESHARD_*`` environment variables the code reads, and the circles in the module import graph (imports inside
functions count too: a circle is a circle wherever the import sits).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.parts[path.parts.index("src") + 1 :])
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(name: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The known modules that ``name`` imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the module ``pkg.sub``; ``from pkg import name`` imports ``pkg``
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_circles(text: dict[Path, str]) -> list[list[str]]:
    """Strongly connected components (more than one module) of the import graph, each sorted."""
    names = {p: _module_name(p) for p in text}
    known = set(names.values())
    graph = {names[p]: _imports(names[p], p.name == "__init__.py", ast.parse(t), known) for p, t in text.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(root: Path) -> None:
    files = [p for d in ("packages", "apps") for p in sorted((root / d).glob("*/src/**/*.py"))]
    text = {p: p.read_text() for p in files}
    modules = sorted(((len(t.splitlines()), str(p.relative_to(root))) for p, t in text.items()), reverse=True)
    functions = sorted(
        (
            (n.end_lineno - n.lineno + 1, f"{p.relative_to(root)}:{n.name}")
            for p, t in text.items()
            for n in ast.walk(ast.parse(t))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ),
        reverse=True,
    )
    setters = [f"{p.name}:{m}" for p, t in text.items() for m in re.findall(r"^def (set_\w+)\(", t, re.M)]
    env = sorted({m for t in text.values() for m in re.findall(r"environ(?:\.get)?\(?\[?[\"'](MOESHARD_\w+)", t)})
    print(f"source files: {len(files)}, lines: {sum(n for n, _ in modules)}")
    print("largest modules:", modules[:3])
    print("largest functions:", functions[:3])
    print(f"modules over {MAX_MODULE_LINES} lines:", [m for m in modules if m[0] > MAX_MODULE_LINES])
    print(f"functions over {MAX_FUNCTION_LINES} lines:", [f for f in functions if f[0] > MAX_FUNCTION_LINES])
    print("module-level set_* functions:", setters)
    print("MOESHARD_* environment variables read:", env)
    print("import circles:", import_circles(text))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
