"""Sessions: one per package, ``cross`` (the tests that need several packages), ``all``, ``lint``, ``job``, ``build``,
``release_check``, ``public_api``.

    python3 -m pip install 'nox>=2024.4' && python3 -m nox   # what CI runs: lint, each package alone, cross
    python3 -m nox -s ep                                       # one package
    python3 -m nox -s all                                      # everything in one venv, every test folder
    MOESHARD_TORCH="torch==2.11.0" python3 -m nox -s ep       # another torch (>= 2.11 supported)

A package's session installs exactly that package, what its ``pyproject.toml`` declares and its ``test`` extra, so
a test that imports something undeclared fails there. The moeshard packages it declares are installed editable
from this tree, so its version ranges must accept their versions here. Tests that need a package their own package
does not declare live in the top-level ``tests/`` and run in ``cross``, which installs everything. torch, which every
package declares, is installed once into ``.nox/_torch-<pin>-py<X.Y>`` and every session's venv sees it through a
``.pth`` file (delete that folder, or change ``MOESHARD_TORCH``, for a fresh one). The packages' declared build
requirements (hatchling, and what it asks for an editable build) are installed once too, into ``.nox/_build-*``,
which only the editable builds see.

Virtual environments are reused between runs (``--no-reuse-existing-virtualenvs`` for a fresh one); pass pytest
arguments after ``--`` (``python3 -m nox -s ep -- -k dispatch``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch; an open range could pull a multi-GB CUDA build from PyPI.
TORCH = os.environ.get("MOESHARD_TORCH", "torch==2.13.0")
# A CUDA build of torch brings the triton it was built with; a CPU build brings none, and a test extra's open
# `triton` requirement would take the newest release. This is the one torch 2.13 was built with.
TRITON = os.environ.get("MOESHARD_TRITON", "triton==3.6.0")
# Byte-compiling all of torch at install time doubles the install; modules compile when first imported instead.
PIP_ARGS = ["--no-compile"]
# pytest's summary names every skipped test with its reason, and the slowest tests.
PYTEST_ARGS = ["-rfEs", "--durations=15"]


def _project(folder: str) -> dict:
    return nox.project.load_toml(ROOT / folder / "pyproject.toml")["project"]


def _packages() -> dict[str, str]:
    """Session name -> folder of every package under packages/ and apps/ (its tests are ``<folder>/tests``), the
    name being the distribution's without ``moeshard-`` (``moeshard-fsdp-moe``: ``fsdp_moe``); libraries first."""
    found = {}
    for pattern in ("packages/*/pyproject.toml", "apps/*/pyproject.toml"):
        for pyproject in sorted(ROOT.glob(pattern)):
            folder = pyproject.parent.relative_to(ROOT).as_posix()
            found[canonicalize_name(_project(folder)["name"]).removeprefix("moeshard-").replace("-", "_")] = folder
    return found


PACKAGES = _packages()
# What the cross-package tests need beyond every package and its `test` extra (tests/test_releases.py,
# tests/test_noxfile.py, tests/test_import_contracts.py).
IMPORT_LINTER = "import-linter>=2.17"  # acyclic_siblings, and PEP 420 namespace portions as root packages
CROSS_TEST_DEPS = ["packaging>=23", "nox>=2024.4", IMPORT_LINTER]
# `python3 -m nox` without -s: what CI runs (.ci/run, README "Run all tests").
nox.options.sessions = ["lint", *PACKAGES, "cross"]


def _requirements(folder: str, extras: tuple[str, ...]) -> list[Requirement]:
    """What ``folder`` declares with ``extras``; an extra may name the package's own other extras."""
    project = _project(folder)
    name = canonicalize_name(project["name"])
    reqs, todo, seen = [Requirement(r) for r in project.get("dependencies", [])], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for r in map(Requirement, project.get("optional-dependencies", {}).get(extra, [])):
            if canonicalize_name(r.name) == name:
                todo += sorted(r.extras)
            else:
                reqs.append(r)
    return reqs


def _internal_closure(folder: str, extras: tuple[str, ...] = ("test",)) -> list[str]:
    """The folders of the moeshard packages that ``folder`` declares with ``extras``, recursively (with the extras
    each requirement names, ``moeshard-x[parallel]``), dependencies first, ``folder`` itself last."""
    by_name = {canonicalize_name(_project(f)["name"]): f for f in PACKAGES.values()}
    order: list[str] = []

    def visit(f: str, wanted: tuple[str, ...], path: tuple[str, ...]) -> None:
        if f in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, f))}")
        for r in _requirements(f, wanted):
            dep = by_name.get(canonicalize_name(r.name))
            if dep is not None:
                visit(dep, tuple(sorted(r.extras)), (*path, f))
        if f not in order:
            order.append(f)

    visit(folder, extras, ())
    return order


def _site_packages(session: nox.Session) -> Path | None:
    """The session venv's ``site-packages`` (None under ``--no-install``, where nothing is installed)."""
    probe = "import sysconfig; print(sysconfig.get_path('purelib'))"
    out = session.run_install("python", "-c", probe, silent=True)
    return None if out is None else Path(out.strip().splitlines()[-1])


def _python_version(session: nox.Session) -> str | None:
    """The session venv's ``X.Y`` (None under ``--no-install``)."""
    out = session.run_install("python", "-c", "import sys; print('%d.%d' % sys.version_info[:2])", silent=True)
    return None if out is None else out.strip().splitlines()[-1]


def _torch_layer(session: nox.Session) -> None:
    """The pinned torch (and what it brings) installed once into ``.nox/_torch-<pin>-py<X.Y>``, made visible to this
    session's venv by a ``.pth`` file; the venv's own packages come first on ``sys.path``. Every package declares
    torch, so each venv still sees what a ``pip install`` of its package would give it; unpacking the CPU wheel
    once instead of once per session saves about half a minute a session."""
    site = _site_packages(session)
    if site is None:
        return
    layer = ROOT / ".nox" / f"_torch-{re.sub(r'[^A-Za-z0-9.]+', '-', TORCH)}-py{_python_version(session)}"
    complete = layer / ".complete"
    if not complete.is_file():
        shutil.rmtree(layer, ignore_errors=True)  # a partial one
        session.install(*PIP_ARGS, "--target", str(layer), TORCH)
        complete.write_text(TORCH + "\n")
    (site / "_moeshard_torch_layer.pth").write_text(f"{layer}\n")


# Asks each folder's build backend what an editable build needs beyond ``build-system.requires`` (PEP 660's hook;
# hatchling names `editables`); run with the build layer on PYTHONPATH.
_EDITABLE_REQUIRES = """
import importlib, json, os, sys
out = set()
for backend, folder in zip(sys.argv[1::2], sys.argv[2::2]):
    here = os.getcwd()
    os.chdir(folder)
    try:
        out.update(getattr(importlib.import_module(backend), "get_requires_for_build_editable", list)())
    finally:
        os.chdir(here)
print(json.dumps(sorted(out)))
"""


def _build_layer(session: nox.Session) -> Path | None:
    """What every package declares to build with (``build-system.requires``) and what its backend asks for an
    editable build, installed once into ``.nox/_build-<hash>-py<X.Y>`` (None under ``--no-install``). It is on
    PYTHONPATH only while the editable installs build, never in a session's venv: hatchling brings ``packaging`` and
    others, which would hide a package's undeclared import of them. Its name hashes the requirements and backends;
    delete it for a fresh one after changing a backend's own build configuration."""
    systems = {f: nox.project.load_toml(ROOT / f / "pyproject.toml")["build-system"] for f in PACKAGES.values()}
    requires = sorted({r for s in systems.values() for r in s["requires"]})
    backends = sorted({s["build-backend"] for s in systems.values()})
    version = _python_version(session)
    if version is None:
        return None
    key = hashlib.sha256(json.dumps([requires, backends]).encode()).hexdigest()[:12]
    layer = ROOT / ".nox" / f"_build-{key}-py{version}"
    complete = layer / ".complete"
    if not complete.is_file():
        shutil.rmtree(layer, ignore_errors=True)  # a partial one
        session.install(*PIP_ARGS, "--target", str(layer), *requires)
        args = [a for f, s in systems.items() for a in (s["build-backend"], str(ROOT / f))]
        out = session.run_install(
            "python", "-c", _EDITABLE_REQUIRES, *args, env={"PYTHONPATH": str(layer)}, silent=True
        )
        extra = json.loads(out.strip().splitlines()[-1])
        if extra:
            session.install(*PIP_ARGS, "--target", str(layer), *extra)
        complete.write_text(json.dumps([requires, backends, extra]) + "\n")
    return layer


def _install(session: nox.Session, folders: list[str], with_test_extra: list[str]) -> None:
    """The pinned torch first (the shared layer of :func:`_torch_layer`), then ``folders`` editable
    (``with_test_extra`` with their ``test`` extra), then what they declare, in one resolve from their installed
    metadata: each moeshard requirement resolves to this tree's folder, the rest to the index.

    The editable installs build without an isolated environment each (~5 s a package, ~50 packages over CI's
    sessions), from the shared build layer of :func:`_build_layer`, and without dependencies; the second install
    names the same distributions and extras, so the venv holds what one ``pip install -e`` of them would give."""
    _torch_layer(session)
    if any(r.name == "triton" for f in with_test_extra for r in _requirements(f, ("test",))):
        probe = "import importlib.util; print(importlib.util.find_spec('triton') is not None)"
        found = session.run_install("python", "-c", probe, silent=True)  # None under --no-install
        if found is not None and found.strip().endswith("False"):
            session.install(*PIP_ARGS, TRITON)  # a CPU torch: the pinned one, not the newest (see TRITON)
    build = _build_layer(session)
    if build is None:
        return
    extra = {f: "[test]" if f in with_test_extra else "" for f in folders}
    editable = [a for f in folders for a in ("-e", f + extra[f])]
    session.install(*PIP_ARGS, "--no-deps", "--no-build-isolation", *editable, env={"PYTHONPATH": str(build)})
    session.install(*PIP_ARGS, *[_project(f)["name"] + extra[f] for f in folders])


def _pytest(session: nox.Session, dirs: list[str]) -> None:
    session.run("python", "-m", "pytest", *PYTEST_ARGS, *dirs, *session.posargs, env={"OMP_NUM_THREADS": "1"})


def _make_package_session(name: str, folder: str) -> None:
    @nox.session(name=name)
    def _session(session: nox.Session) -> None:
        _install(session, _internal_closure(folder), with_test_extra=[folder])
        _pytest(session, [f"{folder}/tests"])

    _session.__doc__ = f"{folder} alone: it, what it declares and its `test` extra; its tests."


for _name, _folder in PACKAGES.items():
    _make_package_session(_name, _folder)


def _install_everything(session: nox.Session) -> None:
    folders = list(PACKAGES.values())
    _install(session, folders, with_test_extra=folders)
    session.install(*CROSS_TEST_DEPS)


@nox.session
def cross(session: nox.Session) -> None:
    """Every package with its `test` extra; the cross-package tests (top-level tests/)."""
    _install_everything(session)
    _pytest(session, ["tests"])


@nox.session(name="all")
def all_tests(session: nox.Session) -> None:
    """Every package in one venv; every package's tests and tests/ (for developers: one venv, one run)."""
    _install_everything(session)
    _pytest(session, [f"{f}/tests" for f in PACKAGES.values()] + ["tests"])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree; the import contracts of ``.importlinter`` (floors, the app's layers, no circles)."""
    session.install("ruff>=0.5", IMPORT_LINTER)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # import-linter reads the sources without running them: the src folders on the path, nothing installed.
    src = os.pathsep.join(str(ROOT / folder / "src") for folder in PACKAGES.values())
    session.run("lint-imports", env={"PYTHONPATH": src})


@nox.session
def job(session: nox.Session) -> None:
    """The main job on its embedded default: tiny Qwen3-MoE, 2 "nodes" x 2 CPU processes on localhost, EP 2."""
    import time

    _install(session, _internal_closure(PACKAGES["train"], extras=()), with_test_extra=[])
    out = f"outputs/job-{time.strftime('%Y%m%d-%H%M%S')}"
    session.run(
        "moeshard-train",
        "launch-local",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--",
        "--config",
        "apps/train/configs/default.yaml",
        f"--logging.output_dir={out}",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )
    session.log(f"metrics: {out}/metrics.jsonl, TensorBoard: {out}/tensorboard")


@nox.session
def build(session: nox.Session) -> None:
    """Each package's sdist and wheel (built from the sdist), with its own version, into dist/."""
    session.install("build", "hatchling", "packaging")
    session.run("python", "tools/release.py", "build", "--no-isolation", "--outdir", "dist", *session.posargs)


@nox.session
def release_check(session: nox.Session) -> None:
    """Fail when a package changed since its last ``<name>-v<version>`` tag without a version bump (and more)."""
    session.install("packaging")
    session.run("python", "tools/release.py", "check")


@nox.session
def public_api(session: nox.Session) -> None:
    """Check each package's ``__all__``, docstrings and README list; ``-- write`` refreshes the README lists."""
    _install_everything(session)
    session.run("python", "tools/public_api.py", *(session.posargs or ["check"]))
