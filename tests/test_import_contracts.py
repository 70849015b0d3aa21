"""The import contracts of ``.importlinter`` hold on this tree (packages' floors, the app's layers, the families'
independence, no circle inside a package), and a planted upward import breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which(
    "lint-imports", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
)
pytestmark = pytest.mark.skipif(
    LINT_IMPORTS is None, reason="import-linter is not installed (the cross and lint nox sessions install it)"
)


def _lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess:
    src = [str(p) for p in sorted(root.glob("packages/*/src")) + sorted(root.glob("apps/*/src"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(src)}
    # --no-cache: each run reads the tree as it is now (a planted import must not hide behind a cached graph).
    cmd = [LINT_IMPORTS, "--config", str(config), "--no-cache"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_import_contract():
    done = _lint_imports(ROOT, ROOT / ".importlinter")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    for name in ("floors", "families", "app-layers", "no-circles"):  # each section is read, none is dropped
        assert f"[importlinter:contract:{name}]" in (ROOT / ".importlinter").read_text()


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # a package reaching up into the app
        ("packages/ep/src/moeshard/ep/_planted.py", "import moeshard.train.config\n", "Packages import only"),
        # a family importing another family
        (
            "packages/models_qwen3moe/src/moeshard/models/qwen3moe/_planted.py",
            "import moeshard.models.deepseekv3\n",
            "Model families are peers",
        ),
        # the app's loop reaching up into the job that composes it
        ("apps/train/src/moeshard/train/run/_planted.py", "import moeshard.train.job\n", "The app's layers"),
        # a circle inside a package: a module importing one that imports it
        ("packages/meshes/src/moeshard/meshes/_planted.py", "import moeshard.meshes._build\n", None),
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path, module, line, broken):
    tree = tmp_path / "tree"
    for part in ("packages", "apps"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("tests", "__pycache__", "*.md"))
    (tree / module).write_text(line)
    config = tree / ".importlinter"
    shutil.copy(ROOT / ".importlinter", config)
    if broken is None:  # close the circle: the module it imports imports it back
        build = tree / "packages/meshes/src/moeshard/meshes/_build.py"
        build.write_text(build.read_text() + "\nimport moeshard.meshes._planted  # noqa: E402\n")
        broken = "No import circle inside a package"
    done = _lint_imports(tree, config)
    assert done.returncode != 0, done.stdout[-3000:]
    assert f"{broken}" in done.stdout and "BROKEN" in done.stdout.split(broken, 1)[1].splitlines()[0], done.stdout
