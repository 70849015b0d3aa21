"""Independent releases of moeshard's distributions: build each one's wheel and sdist, check versions and tags.

    python tools/release.py list                                   # name, distribution, version, tag of each
    python tools/release.py build [--outdir dist] [--no-isolation] [NAME ...]   # needs `pip install build`
    python tools/release.py check [--root .]                       # exit 1 on a problem

Release tags are ``<name>-v<version>`` where ``name`` is the distribution without ``moeshard-``
(``meshes-v0.1.0``, ``fsdp-moe-v0.2.0``, ``qwen3moe-v0.1.1``, ``train-v0.1.0``). ``check`` fails when, for any
distribution:

- its version has no ``## <version>`` entry in its CHANGELOG.md;
- a ``moeshard-*`` requirement (in ``dependencies`` or an optional extra) has no upper bound, or excludes that
  distribution's version in this tree;
- its source imports another moeshard distribution it does not declare: in ``dependencies``, or in an extra other
  than ``test`` when every import of it is inside a function (a lazy import: ``moeshard-qwen3moe[parallel]``);
- its tests import another moeshard distribution that neither its dependencies nor its extras declare;
- its version is lower than its newest tag, or equal to it while ``src/`` or ``pyproject.toml`` differ from the
  tagged tree (a change since the release without a version bump). A distribution with no tag passes, and the
  report says so.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "moeshard-"
# What a release is made of: a change elsewhere (tests, README, CHANGELOG) needs no new version.
RELEASED_PATHS = ("src", "pyproject.toml")


@dataclass(frozen=True)
class Dist:
    """One distribution of the repository."""

    path: Path  # its folder, relative to the repository root
    name: str  # the distribution name, e.g. "moeshard-fsdp-moe"
    version: Version
    requires: tuple[Requirement, ...]
    import_name: str  # e.g. "moeshard.models.qwen3moe"
    extras: dict[str, tuple[Requirement, ...]] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def short(self) -> str:
        """The name in tags: the distribution without ``moeshard-``."""
        return self.name.removeprefix(PREFIX)

    @property
    def tag(self) -> str:
        """The release tag of the current version."""
        return f"{self.short}-v{self.version}"


def discover(root: Path = ROOT) -> list[Dist]:
    """Every distribution under ``packages/*`` and ``apps/*``, dependencies before their dependents."""
    dists = []
    for pyproject in sorted([*root.glob("packages/*/pyproject.toml"), *root.glob("apps/*/pyproject.toml")]):
        meta = tomllib.loads(pyproject.read_text())["project"]
        folder = pyproject.parent
        inits = sorted(folder.glob("src/moeshard/**/__init__.py"), key=lambda p: len(p.parts))
        if not inits:
            raise ValueError(f"{folder}: no package under src/moeshard")
        import_name = ".".join(inits[0].parent.relative_to(folder / "src").parts)
        dists.append(
            Dist(
                path=folder.relative_to(root),
                name=canonicalize_name(meta["name"]),
                version=Version(meta["version"]),
                requires=tuple(Requirement(r) for r in meta.get("dependencies", [])),
                import_name=import_name,
                extras={
                    name: tuple(Requirement(r) for r in reqs)
                    for name, reqs in meta.get("optional-dependencies", {}).items()
                },
            )
        )
    return _dependency_order(dists)


def _dependency_order(dists: list[Dist]) -> list[Dist]:
    by_name = {d.name: d for d in dists}
    ordered: list[Dist] = []

    def visit(d: Dist, path: tuple[str, ...]) -> None:
        if d in ordered:
            return
        if d.name in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, d.name))}")
        for dep in internal_requirements(d, by_name):
            visit(by_name[dep], (*path, d.name))
        ordered.append(d)

    for d in dists:
        visit(d, ())
    return ordered


def internal_requirements(dist: Dist, by_name: dict[str, Dist]) -> list[str]:
    """Names of the repository's distributions that ``dist`` declares."""
    return [canonicalize_name(r.name) for r in dist.requires if canonicalize_name(r.name) in by_name]


def _git(root: Path, *args: str) -> str:
    res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {root}: {res.stderr.strip()}")
    return res.stdout


def tagged_versions(root: Path, dist: Dist) -> list[Version]:
    """Versions of ``dist`` that have a release tag, oldest first (tags with a malformed version are ignored)."""
    versions = []
    for tag in _git(root, "tag", "--list", f"{dist.short}-v*").split():
        try:
            versions.append(Version(tag.removeprefix(f"{dist.short}-v")))
        except InvalidVersion:
            continue
    return sorted(versions)


def changed_since(root: Path, dist: Dist, tag: str) -> list[str]:
    """Released files of ``dist`` that differ from ``tag``: committed, uncommitted and untracked changes."""
    paths = [str(dist.path / p) for p in RELEASED_PATHS]
    changed = set(_git(root, "diff", "--name-only", tag, "--", *paths).split())
    changed |= set(_git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).split())
    return sorted(p for p in changed if "__pycache__" not in p)


def imported_dists(root: Path, dist: Dist, by_import: dict[str, Dist], folder: str = "src") -> dict[str, bool]:
    """The moeshard distributions that the ``*.py`` files under ``dist``'s ``folder`` import, each with whether
    every import of it is lazy (inside a function, or under ``if TYPE_CHECKING:``)."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            modules = []
        for module in modules:
            for import_name, other in by_import.items():
                if module == import_name or module.startswith(import_name + "."):
                    found[other.name] = found.get(other.name, True) and lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inner = True
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for py in sorted((root / dist.path / folder).rglob("*.py")):
        visit(ast.parse(py.read_text(), str(py)), False)
    return found


def compatible_range(dist: Dist) -> str:
    """The requirement that accepts ``dist``'s compatible versions: same minor below 1.0, same major from 1.0."""
    v = dist.version
    upper = f"0.{v.minor + 1}" if v.major == 0 else f"{v.major + 1}"
    return f"{dist.name}>={v.major}.{v.minor},<{upper}"


def check(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(report lines, problems)`` for every distribution; no problems means ready to release or unchanged."""
    dists = discover(root)
    by_name = {d.name: d for d in dists}
    by_import = {d.import_name: d for d in dists}
    report, problems = [], []
    for d in dists:
        changelog = root / d.path / "CHANGELOG.md"
        if not changelog.is_file() or f"## {d.version}" not in changelog.read_text():
            problems.append(f"{d.name}: CHANGELOG.md has no '## {d.version}' entry")
        declared = {canonicalize_name(r.name) for r in d.requires}
        in_extras = {e: {canonicalize_name(r.name) for r in reqs} for e, reqs in d.extras.items()}
        for where, req in [("", r) for r in d.requires] + [
            (f" (extra '{e}')", r) for e, reqs in d.extras.items() for r in reqs
        ]:
            dep = by_name.get(canonicalize_name(req.name))
            if dep is None or dep.name == d.name:  # an extra may name the package's own extras
                continue
            if not any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier):
                problems.append(
                    f"{d.name}: requirement '{req}'{where} needs an upper bound, e.g. '{compatible_range(dep)}'"
                )
            if dep.version not in req.specifier:
                problems.append(
                    f"{d.name}: requirement '{req}'{where} excludes {dep.name} {dep.version} of this tree; "
                    "widen the range (and release this package) or hold the dependency back"
                )
        optional = set().union(*(names for e, names in in_extras.items() if e != "test"))
        for name, lazy in sorted(imported_dists(root, d, by_import).items()):
            if name == d.name or name in declared:
                continue
            what = f"its source imports {by_name[name].import_name}"
            if name not in optional:
                problems.append(f"{d.name}: {what} but does not declare {name}")
            elif not lazy:
                extras = sorted(e for e, names in in_extras.items() if e != "test" and name in names)
                problems.append(
                    f"{d.name}: {what} at module level but declares {name} only in extra {', '.join(extras)} "
                    "(import it inside the function that needs it, or make it a dependency)"
                )
        everything = declared.union(*in_extras.values())
        for name in sorted(set(imported_dists(root, d, by_import, "tests")) - {d.name} - everything):
            problems.append(
                f"{d.name}: its tests import {by_name[name].import_name} but it does not declare {name} (add it to "
                "the 'test' extra, or move the tests to the repository's tests/)"
            )
        versions = tagged_versions(root, d)
        if not versions:
            report.append(f"{d.short} {d.version}: no release tag yet (a release of this version is tagged {d.tag})")
            continue
        latest = versions[-1]
        last_tag = f"{d.short}-v{latest}"
        if d.version < latest:
            problems.append(f"{d.name}: version {d.version} is lower than the released {latest} ({last_tag})")
        elif d.version == latest:
            changed = changed_since(root, d, last_tag)
            if changed:
                shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
                problems.append(
                    f"{d.name}: {shown} changed since {last_tag} but the version is still {d.version}; bump the "
                    f"version in {d.path}/pyproject.toml and add a CHANGELOG.md entry"
                )
            else:
                report.append(f"{d.short} {d.version}: unchanged since {last_tag}")
        else:
            report.append(f"{d.short} {d.version}: unreleased (last release {last_tag}); tag {d.tag} on release")
    return report, problems


def build(root: Path, outdir: Path, names: list[str], isolation: bool) -> list[Path]:
    """Build the sdist, then the wheel from it, of each named distribution (all by default) into ``outdir``."""
    dists = discover(root)
    unknown = set(names) - {d.short for d in dists} - {d.name for d in dists}
    if unknown:
        raise SystemExit(f"unknown distribution(s) {sorted(unknown)}; known: {[d.short for d in dists]}")
    outdir.mkdir(parents=True, exist_ok=True)
    built = []
    for d in dists:
        if names and d.short not in names and d.name not in names:
            continue
        cmd = [sys.executable, "-m", "build", "--outdir", str(outdir), str(root / d.path)]
        res = subprocess.run(cmd + ([] if isolation else ["--no-isolation"]), capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{d.name}: the build failed:\n{res.stdout}\n{res.stderr}")
        stem = f"{d.name.replace('-', '_')}-{d.version}"
        for artifact in (outdir / f"{stem}-py3-none-any.whl", outdir / f"{stem}.tar.gz"):
            if not artifact.is_file():
                raise SystemExit(f"{d.name}: expected {artifact} after the build")
            built.append(artifact)
        print(f"{d.name} {d.version}: {stem}-py3-none-any.whl, {stem}.tar.gz")
    return built


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="tools/release.py", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the distributions, versions and release tags")
    b = sub.add_parser("build", help="wheel and sdist of each distribution")
    b.add_argument("--outdir", type=Path, default=None, help="default: <root>/dist")
    b.add_argument("--no-isolation", action="store_true", help="build with this environment's hatchling")
    b.add_argument("names", nargs="*", help="e.g. meshes ep (default: all)")
    sub.add_parser("check", help="CHANGELOG entries, dependency ranges, imports, version bumps since tags")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.command == "list":
        for d in discover(root):
            print(f"{d.short:10} {d.name:20} {d.version!s:8} {d.path}  tag {d.tag}")
        return 0
    if args.command == "build":
        build(root, (args.outdir or root / "dist").resolve(), args.names, isolation=not args.no_isolation)
        return 0
    report, problems = check(root)
    print("\n".join(report))
    if problems:
        print("release check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"release check passed ({len(report)} distributions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
