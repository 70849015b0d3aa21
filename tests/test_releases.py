"""Independent releases: ``tools/release.py check`` on a temporary git repository and on this one, and every
built wheel installed with only what it declares.

Wheel sets are installed into fresh virtual environments that share one torch installation through a ``.pth``
file (torch and its own dependencies only), so the torch wheel is installed once; each environment holds exactly
the wheel set of the package under test (a set is extended only by a package whose closure contains it).
"""

from __future__ import annotations

import email.parser
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("MOESHARD_TORCH", "torch==2.13.0")
# No byte-compiling at install: it more than doubles installing torch and transformers; modules compile on import.
INSTALL = ["install", "-q", "--no-compile"]


def _load_release():
    spec = importlib.util.spec_from_file_location("_moeshard_tools_release", ROOT / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


release = _load_release()


# ---- the check on a temporary repository -----------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    res = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _write_package(
    repo: Path, short: str, version: str, deps: list[str], imports: str = "", extras: dict[str, list[str]] | None = None
) -> Path:
    folder = repo / "packages" / short
    (folder / "src" / "moeshard" / short).mkdir(parents=True, exist_ok=True)
    (folder / "tests").mkdir(exist_ok=True)
    deps_toml = ", ".join(f'"{d}"' for d in deps)
    extras_toml = "".join(f"{k} = [{', '.join(repr(r) for r in v)}]\n" for k, v in (extras or {}).items())
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "moeshard-{short}"\nversion = "{version}"\ndependencies = [{deps_toml}]\n'
        + (f"\n[project.optional-dependencies]\n{extras_toml}" if extras else "")
    )
    (folder / "CHANGELOG.md").write_text(f"# Changelog\n\n## {version}\n- First release.\n")
    (folder / "README.md").write_text(f"# moeshard-{short}\n")
    (folder / "src" / "moeshard" / short / "__init__.py").write_text(f'"""{short}."""\n{imports}')
    return folder


def _bump(folder: Path, old: str, new: str, changelog: bool = True) -> None:
    pyproject = folder / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'version = "{old}"', f'version = "{new}"'))
    if changelog:
        with (folder / "CHANGELOG.md").open("a") as f:
            f.write(f"\n## {new}\n- A change.\n")


@pytest.fixture
def repo(tmp_path) -> Path:
    """A monorepo with ``moeshard-a`` 0.1.0 and ``moeshard-b`` 0.1.0 (needs a), committed, no tags."""
    _git(tmp_path, "init", "-q")
    _write_package(tmp_path, "a", "0.1.0", ["torch>=2.11"])
    _write_package(tmp_path, "b", "0.1.0", ["moeshard-a>=0.1,<0.2"], imports="from moeshard.a import *\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "initial")
    return tmp_path


def _problems(repo: Path) -> list[str]:
    return release.check(repo)[1]


def test_check_passes_without_tags_and_says_so(repo):
    report, problems = release.check(repo)
    assert problems == []
    assert report == [
        "a 0.1.0: no release tag yet (a release of this version is tagged a-v0.1.0)",
        "b 0.1.0: no release tag yet (a release of this version is tagged b-v0.1.0)",
    ]


def test_a_change_since_the_tag_needs_a_version_bump(repo):
    _git(repo, "tag", "a-v0.1.0")
    _git(repo, "tag", "b-v0.1.0")
    assert release.check(repo)[0] == ["a 0.1.0: unchanged since a-v0.1.0", "b 0.1.0: unchanged since b-v0.1.0"]

    init = repo / "packages/a/src/moeshard/a/__init__.py"
    init.write_text(init.read_text() + "X = 1\n")  # uncommitted
    assert _problems(repo) == [
        "moeshard-a: packages/a/src/moeshard/a/__init__.py changed since a-v0.1.0 but the version is still 0.1.0; "
        "bump the version in packages/a/pyproject.toml and add a CHANGELOG.md entry"
    ]
    _git(repo, "commit", "-qam", "change a")  # committed: the same
    assert len(_problems(repo)) == 1

    _bump(repo / "packages/a", "0.1.0", "0.1.1")
    report, problems = release.check(repo)
    assert problems == []
    assert "a 0.1.1: unreleased (last release a-v0.1.0); tag a-v0.1.1 on release" in report


def test_new_untracked_source_file_counts_and_docs_do_not(repo):
    _git(repo, "tag", "a-v0.1.0")
    (repo / "packages/a/README.md").write_text("# moeshard-a\n\nMore words.\n")
    (repo / "packages/a/tests/test_new.py").write_text("")
    assert _problems(repo) == []
    (repo / "packages/a/src/moeshard/a/new.py").write_text("")
    assert "packages/a/src/moeshard/a/new.py changed since a-v0.1.0" in _problems(repo)[0]


def test_versions_changelog_ranges_and_imports(repo):
    _git(repo, "tag", "a-v0.2.0")
    assert _problems(repo) == ["moeshard-a: version 0.1.0 is lower than the released 0.2.0 (a-v0.2.0)"]
    _git(repo, "tag", "-d", "a-v0.2.0")

    _bump(repo / "packages/a", "0.1.0", "0.2.0", changelog=False)
    assert _problems(repo) == [
        "moeshard-a: CHANGELOG.md has no '## 0.2.0' entry",
        "moeshard-b: requirement 'moeshard-a<0.2,>=0.1' excludes moeshard-a 0.2.0 of this tree; "
        "widen the range (and release this package) or hold the dependency back",
    ]
    _bump(repo / "packages/a", "0.2.0", "0.1.0", changelog=False)

    _write_package(repo, "b", "0.1.0", ["moeshard-a>=0.1"], imports="import moeshard.a\n")
    assert _problems(repo) == [
        "moeshard-b: requirement 'moeshard-a>=0.1' needs an upper bound, e.g. 'moeshard-a>=0.1,<0.2'"
    ]
    _write_package(repo, "b", "0.1.0", [], imports="def f():\n    from moeshard.a import x\n")
    assert _problems(repo) == ["moeshard-b: its source imports moeshard.a but does not declare moeshard-a"]


def test_extras_lazy_imports_and_test_imports(repo):
    """An extra's moeshard requirement is held to the same ranges; source may import a package declared only in an
    extra (not ``test``) inside a function, never at module level; tests may import what any extra declares."""
    lazy = "def f():\n    from moeshard.a import x\n"
    _write_package(repo, "b", "0.1.0", [], imports=lazy, extras={"more": ["moeshard-a>=0.1,<0.2"]})
    assert _problems(repo) == []

    _write_package(repo, "b", "0.1.0", [], imports=lazy, extras={"more": ["moeshard-a>=0.1"]})
    assert _problems(repo) == [
        "moeshard-b: requirement 'moeshard-a>=0.1' (extra 'more') needs an upper bound, e.g. 'moeshard-a>=0.1,<0.2'"
    ]
    _write_package(repo, "b", "0.1.0", [], imports=lazy, extras={"more": ["moeshard-a>=0.2,<0.3"]})
    assert "excludes moeshard-a 0.1.0 of this tree" in _problems(repo)[0]

    _write_package(repo, "b", "0.1.0", [], imports="import moeshard.a\n", extras={"more": ["moeshard-a>=0.1,<0.2"]})
    assert _problems(repo) == [
        "moeshard-b: its source imports moeshard.a at module level but declares moeshard-a only in extra more "
        "(import it inside the function that needs it, or make it a dependency)"
    ]
    _write_package(repo, "b", "0.1.0", [], imports=lazy, extras={"test": ["moeshard-a>=0.1,<0.2", "pytest"]})
    assert _problems(repo) == ["moeshard-b: its source imports moeshard.a but does not declare moeshard-a"]

    _write_package(repo, "b", "0.1.0", [])
    (repo / "packages/b/tests/test_b.py").write_text("def test_x():\n    import moeshard.a\n")
    assert _problems(repo) == [
        "moeshard-b: its tests import moeshard.a but it does not declare moeshard-a (add it to the 'test' extra, "
        "or move the tests to the repository's tests/)"
    ]
    _write_package(repo, "b", "0.1.0", [], extras={"test": ["moeshard-b[more]"], "more": ["moeshard-a>=0.1,<0.2"]})
    assert _problems(repo) == []


def test_check_passes_on_this_repository():
    res = subprocess.run([sys.executable, str(ROOT / "tools/release.py"), "check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(res.stdout.strip().splitlines()) == len(release.discover(ROOT)) + 1


# ---- wheels and sdists ------------------------------------------------------------------------------------------

# Smoke code per distribution, run in its environment after the import.
SMOKE = {
    "moeshard-meshes": "from moeshard.meshes import plan_layout; assert plan_layout(16, 8, 8).ep_fsdp_size == 2",
    "moeshard-ep": "from moeshard.ep import ParallelPlan, fqn_matches; assert fqn_matches('a.*.b', 'a.3.b')",
    "moeshard-fsdp-moe": "from moeshard.fsdp_moe import num_items_for_global_mean as n; assert float(n(3)) == 3.0",
    "moeshard-prefetch": "from moeshard.prefetch import build_schedule; assert callable(build_schedule)",
    "moeshard-sequence": "from moeshard.sequence import kv_replication; assert kv_replication(32, 4, 8) == 2",
    "moeshard-lora": "from moeshard.lora import LoraOptions; assert LoraOptions(2, 4, target_modules=['q']).scaling == 2",
    "moeshard-checkpoint": "from moeshard.checkpoint import SaveOptions; assert SaveOptions().thread_count >= 1",
    "moeshard-data": "from moeshard.data import DataConfig; assert DataConfig(synthetic=True).seq_len > 0",
    "moeshard-qwen3moe": textwrap.dedent(
        """
        import torch
        from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config
        model = Qwen3MoeForCausalLM(get_preset_config("tiny", num_hidden_layers=1))
        model.init_weights()
        ids = torch.randint(0, 512, (1, 8))
        assert model(ids, labels=ids).loss.isfinite()
        """
    ),
    "moeshard-qwen3moe[parallel]": (
        "import moeshard.fsdp_moe, moeshard.meshes, moeshard.prefetch; "
        "from moeshard.models.common import ParallelOptions, parallelize; assert callable(parallelize)"
    ),
    "moeshard-models-common": (
        "import torch; from moeshard.models.common import linear_cross_entropy; "
        "h, w = torch.randn(4, 8), torch.randn(16, 8); assert linear_cross_entropy(h, w, torch.arange(4)).isfinite()"
    ),
    "moeshard-deepseekv3": textwrap.dedent(
        """
        import torch
        from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM, get_preset_config
        model = DeepseekV3ForCausalLM(get_preset_config("tiny", num_hidden_layers=2))
        model.init_weights()
        ids = torch.randint(0, 512, (1, 8))
        assert model(ids, labels=ids).loss.isfinite()
        """
    ),
    "moeshard-qwen35moe": textwrap.dedent(
        """
        import torch
        from moeshard.models.qwen35moe import Qwen35MoeForCausalLM, get_preset_config
        model = Qwen35MoeForCausalLM(get_preset_config("tiny"))
        model.init_weights()
        ids = torch.randint(0, 512, (1, 8))
        assert model(ids, labels=ids).loss.isfinite()
        """
    ),
    "moeshard-gptoss": textwrap.dedent(
        """
        import torch
        from moeshard.models.gptoss import GptOssForCausalLM, get_preset_config
        model = GptOssForCausalLM(get_preset_config("tiny"))
        model.init_weights()
        ids = torch.randint(0, 512, (1, 8))
        assert model(ids, labels=ids).loss.isfinite()
        """
    ),
    "moeshard-train": "from moeshard.train import load_config; assert load_config().parallel.ep_size == 2",
}
# Distributions that bring transformers in (the model families and what they share; the app through them).
TRANSFORMERS_USERS = {
    "moeshard-models-common",
    "moeshard-qwen3moe",
    "moeshard-deepseekv3",
    "moeshard-qwen35moe",
    "moeshard-gptoss",
    "moeshard-train",
}
# Chains of wheel sets (a name, or a name with an extra), one fresh environment each: every step's environment is
# exactly its closure (the extras of a package's `test` extra are never installed). The longest chain first: the
# pool starts the chains in this order, and the others then fit beside it (last, it ran alone for a minute).
CHAINS = [
    ["moeshard-qwen3moe", "moeshard-qwen3moe[parallel]", "moeshard-train"],
    ["moeshard-meshes", "moeshard-ep", "moeshard-fsdp-moe", "moeshard-checkpoint"],
    ["moeshard-models-common", "moeshard-deepseekv3"],
    ["moeshard-qwen35moe"],
    ["moeshard-gptoss"],
    ["moeshard-prefetch"],
    ["moeshard-sequence"],
    ["moeshard-lora"],
    ["moeshard-data"],
]


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout


def _bin(env: Path, name: str) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / name


def _site_packages(env: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))


def _wheel_requires(wheel: Path, extras: frozenset[str] = frozenset()) -> list[Requirement]:
    """The wheel's requirements that apply with ``extras`` (here: on this machine)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        parsed = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in parsed.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *extras})]


def _closure(spec: str, wheels: dict[str, Path]) -> dict[str, frozenset[str]]:
    """Every moeshard distribution that ``spec`` (``name`` or ``name[extra]``) pulls in, with the extras asked of it."""
    out: dict[str, frozenset[str]] = {}
    todo = [Requirement(spec)]
    while todo:
        r = todo.pop()
        name, extras = canonicalize_name(r.name), frozenset(r.extras)
        if name in out and extras <= out[name]:
            continue
        out[name] = out.get(name, frozenset()) | extras
        todo += [d for d in _wheel_requires(wheels[name], out[name]) if canonicalize_name(d.name) in wheels]
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Every distribution built by ``tools/release.py build`` (sdist, then the wheel from it) in a build venv."""
    tmp = tmp_path_factory.mktemp("release")
    venv.EnvBuilder(with_pip=True).create(tmp / "build-env")
    py = _bin(tmp / "build-env", "python")
    _run(py, "-m", "pip", *INSTALL, "build", "hatchling", "packaging")
    dist = tmp / "dist"
    _run(py, ROOT / "tools/release.py", "build", "--no-isolation", "--outdir", dist)
    wheels = {}
    for d in release.discover(ROOT):
        stem = f"{d.name.replace('-', '_')}-{d.version}"
        wheels[d.name] = dist / f"{stem}-py3-none-any.whl"
        assert wheels[d.name].is_file() and (dist / f"{stem}.tar.gz").is_file(), d.name
    return dist, wheels


@pytest.mark.slow
def test_wheels_and_sdists_hold_their_package_only(built):
    dist, wheels = built
    for d in release.discover(ROOT):
        package_dir = d.import_name.replace(".", "/") + "/"
        with zipfile.ZipFile(wheels[d.name]) as z:
            code = [n for n in z.namelist() if ".dist-info/" not in n]
        assert code and all(n.startswith(package_dir) for n in code), (d.name, code)  # moeshard/ stays a namespace
        with tarfile.open(dist / f"{d.name.replace('-', '_')}-{d.version}.tar.gz") as t:
            names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        assert {"pyproject.toml", "README.md", "CHANGELOG.md", f"src/{package_dir}__init__.py"} <= names, d.name


def _install_chain(chain: list[str], torch_env: Path, built: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    """One fresh environment (torch from ``torch_env``'s layer), ``chain``'s wheel sets installed into it in turn;
    after each, the environment holds exactly that set's closure and its smoke code runs."""
    dist, wheels = built
    pip = [_bin(torch_env, "python"), "-m", "pip"]
    env = tmp_path / f"env-{chain[0]}"
    venv.EnvBuilder(with_pip=False).create(env)
    (_site_packages(env) / "_torch_layer.pth").write_text(str(_site_packages(torch_env)) + "\n")
    py = _bin(env, "python")
    asked: set[str] = set()  # the external requirements installed into this environment so far
    for spec in chain:
        closure = _closure(spec, wheels)
        external = {
            str(r)
            for n, extras in closure.items()
            for r in _wheel_requires(wheels[n], extras)
            if canonicalize_name(r.name) not in wheels
        }
        if not external <= asked:  # from the index: what is declared
            _run(*pip, "--python", py, *INSTALL, *sorted(external))
            asked |= external
        # Our wheels only from dist/, never from an index: pip can use nothing undeclared.
        req = Requirement(spec)
        version = wheels[canonicalize_name(req.name)].name.split("-")[1]
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        _run(
            *pip,
            "--python",
            py,
            *INSTALL,
            "--no-index",
            "--find-links",
            dist,
            f"{req.name}{extras}=={version}",
        )
        probe = (
            "import importlib.metadata as m, importlib.util as u, json; "
            "print(json.dumps([sorted(d.metadata['Name'] for d in m.distributions() "
            "if d.metadata['Name'].startswith('moeshard')), bool(u.find_spec('transformers'))]))"
        )
        installed, has_transformers = json.loads(_run(py, "-c", probe))
        assert {canonicalize_name(n) for n in installed} == set(closure), spec
        assert has_transformers == bool(TRANSFORMERS_USERS & set(closure)), spec
        _run(py, "-c", SMOKE[spec], cwd=tmp_path)


@pytest.mark.slow
def test_each_wheel_set_installs_with_only_what_it_declares(built, tmp_path):
    _, wheels = built
    assert sorted({canonicalize_name(Requirement(s).name) for chain in CHAINS for s in chain}) == sorted(wheels)
    torch_env = tmp_path / "torch-env"
    venv.EnvBuilder(with_pip=True).create(torch_env)
    _run(_bin(torch_env, "python"), "-m", "pip", *INSTALL, TORCH)
    # The chains' environments are independent: as many at once as there are cores (pip and the smoke runs are
    # single-threaded); each chain's own steps stay in order.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(_install_chain, chain, torch_env, built, tmp_path) for chain in CHAINS]:
            done.result()
    _run(_bin(tmp_path / "env-moeshard-qwen3moe", "moeshard-train"), "plan", "--nnodes", "2", "--nproc-per-node", "2")
