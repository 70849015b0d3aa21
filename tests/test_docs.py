"""The docs hold to the code: ``docs/contracts.md`` lists each package's ``__all__`` exactly, no docstring or comment
in the sources quotes a measured figure (those live in ``docs/performance.md``), and no link points at a file that
is gone.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "contracts.md"
PERFORMANCE = ROOT / "docs" / "performance.md"


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_moeshard_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


PACKAGES = [name for _, name in _load_tool("public_api").packages()]

# ---- docs/contracts.md against each package's __all__ -----------------------------------------------------------

NAMES_LINE = "Public names (`__all__`):"


def contract_names(text: str) -> dict[str, list[str]]:
    """``{import name: the names of its section's "Public names" paragraph}``, for each ``## moeshard.x`` section."""
    found = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = section.partition("\n")
        package = heading.split()[0].strip("`")
        if not package.startswith("moeshard."):
            continue
        start = body.find(NAMES_LINE)
        if start < 0:
            found[package] = []
            continue
        paragraph = body[start + len(NAMES_LINE) :].split("\n\n")[0]
        found[package] = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", paragraph)
    return found


def names_line(import_name: str) -> str:
    """The paragraph contracts.md should hold for ``import_name`` (its ``__all__``, in order)."""
    exported = importlib.import_module(import_name).__all__
    return NAMES_LINE + " " + ", ".join(f"`{n}`" for n in exported) + "."


def contract_problems(text: str, import_name: str) -> list[str]:
    """One line per difference between the doc's names for ``import_name`` and its ``__all__``, saying the fix."""
    doc = contract_names(text)
    exported = list(importlib.import_module(import_name).__all__)
    where = f"docs/contracts.md, section '## {import_name}'"
    if import_name not in doc:
        return [f"{where} is missing: add it with a line '{names_line(import_name)}'"]
    listed = doc[import_name]
    if not listed:
        return [f"{where} has no '{NAMES_LINE}' paragraph: add '{names_line(import_name)}'"]
    problems = [
        f"{where}: `{n}` is in {import_name}.__all__ but not in the doc: add it to the '{NAMES_LINE}' paragraph "
        f"(and say in the section what it is for if it changes what the package owns)"
        for n in exported
        if n not in listed
    ]
    problems += [
        f"{where}: `{n}` is listed but {import_name}.__all__ does not export it: remove it from the "
        f"'{NAMES_LINE}' paragraph (or export it)"
        for n in listed
        if n not in exported
    ]
    problems += [f"{where}: `{n}` is listed twice" for n in sorted({n for n in listed if listed.count(n) > 1})]
    return problems


@pytest.mark.parametrize("import_name", PACKAGES)
def test_contracts_list_each_package_all(import_name):
    problems = contract_problems(CONTRACTS.read_text(), import_name)
    assert not problems, "\n".join(problems) + f"\nThe whole paragraph, as __all__ has it:\n{names_line(import_name)}"


def test_contracts_name_no_package_that_does_not_exist():
    unknown = sorted(set(contract_names(CONTRACTS.read_text())) - set(PACKAGES))
    assert not unknown, f"docs/contracts.md has sections for {unknown}, which are not packages of this repository"


def test_the_contract_check_names_each_difference():
    text = "## moeshard.meshes\nOwns: meshes.\n\n" + names_line("moeshard.meshes").replace("`build_meshes`, ", "")
    text = text.replace("`MeshAxis`", "`MeshAxis`, `gone_name`")
    problems = contract_problems(text, "moeshard.meshes")
    assert len(problems) == 2
    assert "`build_meshes` is in moeshard.meshes.__all__ but not in the doc: add it" in problems[0]
    assert "`gone_name` is listed but moeshard.meshes.__all__ does not export it: remove it" in problems[1]
    assert "is missing: add it" in contract_problems("## moeshard.ep\n", "moeshard.meshes")[0]


# ---- no measured figures in docstrings and comments -------------------------------------------------------------

# A measured figure: a duration, hardware named as where something ran, a rate, a FLOP rate, a percentage.
# (Sizes computed from shapes, "1.24 GB of float32", are arithmetic, not measurements, and stay.)
FIGURES = [
    re.compile(r"\b\d[\d,]*(\.\d+)?\s?(ms|µs|us)\b"),
    re.compile(r"\b(one|an?|\d+\s?[x×]?)\s?(H100|H200|A100|B200|GB200)s?\b(?!/)"),
    re.compile(r"\d\s?k?\s?(tokens?|tok)/s\b"),
    re.compile(r"\d\s?[GMT]B/s\b"),
    re.compile(r"\d\s?TFLOP"),
    re.compile(r"\d\s?%"),
]
SOURCES = ("packages/*/src/**/*.py", "apps/*/src/**/*.py", "examples/**/*.py")


def docstrings_and_comments(source: str):
    """``(line number, text)`` of every line of the module's, classes' and functions' docstrings and comments."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:  # the docstring and attribute docstrings: string statements
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    if isinstance(stmt.value.value, str):
                        for i, line in enumerate(stmt.value.value.splitlines()):
                            yield stmt.lineno + i, line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def figure_problems(path: Path, source: str) -> list[str]:
    """``file:line: ...`` for each docstring or comment line of ``source`` that quotes a measured figure."""
    problems = []
    for line_no, line in docstrings_and_comments(source):
        for pattern in FIGURES:
            m = pattern.search(line)
            if m:
                problems.append(
                    f"{path}:{line_no}: quotes a measured figure ({m.group(0)!r}): state the contract here and move "
                    f"the figure, with the command that measured it, to docs/performance.md"
                )
                break
    return problems


def test_no_measured_figures_in_docstrings_or_comments():
    problems = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            problems += figure_problems(path.relative_to(ROOT), path.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "line",
    [
        "# 4.4 / 4.1 TB/s on an H200 (bf16 / fp32 gradients)",
        "# took 3.67 ms per layer",
        "# 77,173 tokens/s per GPU",
        "# measured on 2×H200s",
        "# +0.3% per step",
        "# runs at 600-700 TFLOP/s",
    ],
)
def test_the_figure_scan_finds_each_kind(line):
    source = f'"""A module."""\n\n{line}\nX = 1\n'
    assert figure_problems(Path("m.py"), source) == [
        f"m.py:3: quotes a measured figure ({next(p.search(line) for p in FIGURES if p.search(line)).group(0)!r}): "
        "state the contract here and move the figure, with the command that measured it, to docs/performance.md"
    ]


def test_the_figure_scan_reads_docstrings_not_code():
    source = 'def f():\n    """Twice in 3 ms."""\n    return "3 ms on an H200"  # fine: code\n'
    assert [p.split(":")[1] for p in figure_problems(Path("m.py"), source)] == ["2"]
    assert figure_problems(Path("m.py"), '"""An H100/H200 (sm_90) kernel; 1.24 GB of float32."""\n') == []


# ---- links -----------------------------------------------------------------------------------------------------


def test_performance_doc_is_short_and_its_commands_exist():
    text = PERFORMANCE.read_text()
    assert len(text.splitlines()) <= 300, "docs/performance.md: keep it to 300 lines (history lives in git)"
    for script in sorted(set(re.findall(r"benchmarks/[\w./-]+\.(?:sh|py)", text))):
        assert (ROOT / script).exists(), f"docs/performance.md names {script}, which benchmarks/ no longer holds"


def test_no_link_to_the_old_notes():
    stale = []
    for path in sorted([*ROOT.glob("**/*.md"), *ROOT.glob("**/*.py"), *ROOT.glob("**/*.sh")]):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "CHANGELOG" in rel.name or rel == Path("tests/test_docs.py"):
            continue  # changelogs record what was true when written
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "NOTES.md" in line and not re.search(r"git (log|show)\b[^`]*NOTES\.md", line):  # the history
                stale.append(f"{rel}:{i}: names benchmarks/NOTES.md, which is gone: link docs/performance.md")
    assert not stale, "\n".join(stale)


def test_every_named_benchmark_script_exists():
    """A script of benchmarks/ named in the docs or sources is there (a removed one is named with ``git show``)."""
    missing = []
    for path in sorted([*ROOT.glob("**/*.md"), *ROOT.glob("**/*.py"), *ROOT.glob("**/*.sh")]):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "CHANGELOG" in rel.name:  # .git, .nox, untracked scratch folders
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"(git show \w+:)?(benchmarks/[\w-]+\.(?:py|sh))", line):
                if not m.group(1) and not (ROOT / m.group(2)).exists():
                    missing.append(f"{rel}:{i}: names {m.group(2)}, which benchmarks/ no longer holds")
    assert not missing, "\n".join(missing)
