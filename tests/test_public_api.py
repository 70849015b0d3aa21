"""Each package's public API is its ``__all__``: complete, documented, listed in its README, shown by a runnable example.

The rules are in ``tools/public_api.py``; the tests at the end check that the checker catches each breach.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_moeshard_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


public_api = _load_tool("public_api")
PACKAGES = public_api.packages()
IDS = [name for _, name in PACKAGES]


@pytest.mark.parametrize(("folder", "import_name"), PACKAGES, ids=IDS)
def test_all_is_exact_and_documented(folder, import_name):
    assert public_api.module_problems(import_name) == []


@pytest.mark.parametrize(("folder", "import_name"), PACKAGES, ids=IDS)
def test_readme_lists_the_public_api(folder, import_name):
    assert public_api.sync_readme(folder / "README.md", import_name, write=False) is None


def _readme_example(folder: Path) -> str | None:
    blocks = re.findall(r"```python\n(.*?)```", public_api.readme_section(folder / "README.md") or "", re.S)
    return blocks[0] if blocks else None


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each package's README example in a fresh interpreter of its own (one thread each, as many at once as there
    are cores): ``{import_name: its completed process}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(example: str, cwd) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", example]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)

    examples = {name: _readme_example(folder) for folder, name in PACKAGES}
    # the folders made here, before the threads: the factory's first mktemp creates its base folder, and two threads
    # doing that at once each make one (then one of them refuses its own folder as outside the base)
    cwds = {name: tmp_path_factory.mktemp(f"example_{name}") for name, ex in examples.items() if ex is not None}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(run, examples[name], cwd) for name, cwd in cwds.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize(("folder", "import_name"), PACKAGES, ids=IDS)
def test_readme_example_runs(folder, import_name, example_runs):
    example = _readme_example(folder)
    assert example, f"{folder}/README.md: the Public API section has no python example"
    assert f"from {import_name} import" in example, "the example should use the package's own API"
    res = example_runs[import_name]
    assert res.returncode == 0, f"{folder}/README.md example failed:\n{res.stdout}\n{res.stderr}"


# ---- the checker itself --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``_fakeapi`` on sys.path whose ``__init__`` and modules the test writes."""
    root = tmp_path / "_fakeapi"
    root.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(init: str, **modules: str) -> str:
        (root / "__init__.py").write_text(textwrap.dedent(init))
        for name, text in modules.items():
            (root / f"{name}.py").write_text(textwrap.dedent(text))
        for name in [m for m in sys.modules if m == "_fakeapi" or m.startswith("_fakeapi.")]:
            del sys.modules[name]
        return "_fakeapi"

    return write


GOOD_IMPL = '''
    """Implementation."""
    import dataclasses

    LIMIT = 3
    """How many."""

    #: Names of things.
    NAMES = ("a", "b")


    def run(x: int) -> int:
        """Run."""
        return x


    @dataclasses.dataclass
    class Thing:
        """A thing."""

        size: int

        @property
        def double(self) -> int:
            """Twice the size."""
            return 2 * self.size
'''
GOOD_INIT = '''
    """A package."""
    from _fakeapi._impl import LIMIT, NAMES, Thing, run

    __all__ = ["LIMIT", "NAMES", "Thing", "run"]
'''


def test_checker_accepts_a_clean_package(fake_package):
    assert public_api.module_problems(fake_package(GOOD_INIT, _impl=GOOD_IMPL)) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda impl, init: (impl.replace('"""Run."""', ""), init), "_fakeapi.run: exported without a docstring"),
        (
            lambda impl, init: (impl.replace('"""A thing."""', ""), init),
            "_fakeapi.Thing: exported without a docstring",
        ),
        (
            lambda impl, init: (impl.replace('"""How many."""', ""), init),
            "_fakeapi.LIMIT: exported without a docstring",
        ),
        (
            lambda impl, init: (impl.replace("#: Names of things.", ""), init),
            "_fakeapi.NAMES: exported without a docstring",
        ),
        (
            lambda impl, init: (impl.replace('"""Twice the size."""', "return 2 * self.size"), init),
            "_fakeapi.Thing.double: public method or property without a docstring",
        ),
        (
            lambda impl, init: (impl, init.replace('"run"]', '"run", "gone"]')),
            "_fakeapi.__all__ lists 'gone', which the package does not define",
        ),
        (
            lambda impl, init: (impl, init.replace('"LIMIT", ', "")),
            "_fakeapi.LIMIT: public name missing from __all__ (export it or rename it _LIMIT)",
        ),
        (lambda impl, init: (impl, init.replace('"""A package."""', "")), "_fakeapi: the package has no docstring"),
    ],
    ids=["function", "class", "constant", "comment-constant", "property", "stale-all", "unexported", "module-doc"],
)
def test_checker_reports(fake_package, change, expected):
    impl, init = change(GOOD_IMPL, GOOD_INIT)
    assert expected in public_api.module_problems(fake_package(init, _impl=impl))


def test_checker_refuses_public_submodules(fake_package):
    name = fake_package(GOOD_INIT, _impl=GOOD_IMPL, helpers='"""Helpers."""\n', testing='"""T."""\n__all__ = []\n')
    assert public_api.module_problems(name) == [
        "_fakeapi.helpers: public submodule; rename it _helpers.py (or _internal/)"
    ]
