"""Sizes of a source tree's modules and functions, and its process-wide switches (for before/after tables).

    python tools/code_sizes.py .              # this checkout
    python tools/code_sizes.py .bench_old     # another tree (e.g. a `git archive` of an earlier commit)

Counts ``packages/*/src`` and ``apps/*/src``: files, lines, the largest modules and functions, module-level
``set_*`` functions (process-wide setters) and the ``MOESHARD_*`` environment variables the code reads.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


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
    print("module-level set_* functions:", setters)
    print("MOESHARD_* environment variables read:", env)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
