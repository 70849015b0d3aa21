"""Sessions: one per package (installs it with its internal dependencies, runs its tests), ``all`` (everything,
top-level ``tests/`` included: what CI runs), ``lint`` (ruff).

    python3 -m pip install nox && python3 -m nox -s all
    python3 -m nox -s meshes            # one package
    MOESHARD_TORCH="torch==2.11.0" python3 -m nox -s ep   # another torch (>= 2.11 supported)

Virtual environments are reused between runs (``--no-reuse-existing-virtualenvs`` for a fresh one).
"""

from __future__ import annotations

import os

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "all"]  # `job` runs the main job

# The CPU build of torch; an open range could pull a multi-GB CUDA build from PyPI.
TORCH = os.environ.get("MOESHARD_TORCH", "torch==2.13.0")
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3"]
# moeshard.ep's triton kernels are checked on CPU under triton's interpreter (CUDA builds of torch bring triton).
TRITON = os.environ.get("MOESHARD_TRITON", "triton==3.6.0")

# package folder -> the internal packages it needs (in install order), and extra test-only needs.
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "meshes": (["packages/meshes"], []),
    "ep": (["packages/meshes", "packages/ep"], []),
    "fsdp_moe": (
        ["packages/meshes", "packages/ep", "packages/fsdp_moe", "packages/models_qwen3moe"],
        [],  # tests compare against the model package and transformers
    ),
    "prefetch": (
        ["packages/meshes", "packages/ep", "packages/fsdp_moe", "packages/prefetch", "packages/models_qwen3moe"],
        [],
    ),
    "qwen3moe": (["packages/meshes", "packages/ep", "packages/models_qwen3moe"], []),
    "train": (
        [
            "packages/meshes",
            "packages/ep",
            "packages/fsdp_moe",
            "packages/prefetch",
            "packages/models_qwen3moe",
            "apps/train",
        ],
        [],
    ),
}
TEST_DIRS = {
    "meshes": ["packages/meshes/tests"],
    "ep": ["packages/ep/tests"],
    "fsdp_moe": ["packages/fsdp_moe/tests"],
    "prefetch": ["packages/prefetch/tests"],
    "qwen3moe": ["packages/models_qwen3moe/tests"],
    "train": ["apps/train/tests"],
}


def _install(session: nox.Session, paths: list[str], extra: list[str]) -> None:
    session.install(TORCH)
    session.install(*TEST_DEPS, *extra)
    editable = [arg for p in paths for arg in ("-e", p)]
    session.install(*editable)
    if "packages/ep" in paths:
        # optional: without it the triton kernel tests skip (and say so) instead of failing the session
        session.run("python", "-m", "pip", "install", "-q", TRITON, success_codes=[0, 1])


def _pytest(session: nox.Session, dirs: list[str]) -> None:
    session.run("python", "-m", "pytest", *dirs, *session.posargs, env={"OMP_NUM_THREADS": "1"})


def _make_package_session(name: str) -> None:
    paths, extra = PACKAGES[name]

    @nox.session(name=name)
    def _session(session: nox.Session) -> None:
        _install(session, paths, extra)
        _pytest(session, TEST_DIRS[name])

    _session.__doc__ = f"Install {name} with its internal dependencies and run its tests."


for _name in PACKAGES:
    _make_package_session(_name)


@nox.session(name="all")
def all_tests(session: nox.Session) -> None:
    """Every package and the app installed together; all tests, top-level tests/ included."""
    _install(session, PACKAGES["train"][0], [])
    _pytest(session, [d for dirs in TEST_DIRS.values() for d in dirs] + ["tests"])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def job(session: nox.Session) -> None:
    """The main job on its embedded default: tiny Qwen3-MoE, 2 "nodes" x 2 CPU processes on localhost, EP 2."""
    import time

    _install(session, PACKAGES["train"][0], [])
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
    _install(session, PACKAGES["train"][0], [])
    session.run("python", "tools/public_api.py", *(session.posargs or ["check"]))
