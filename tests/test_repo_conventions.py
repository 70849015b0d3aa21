"""Conventions the repository promises: README's test command is what CI runs; namespace packages; one version each."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = sorted([*ROOT.glob("packages/*/pyproject.toml"), ROOT / "apps/train/pyproject.toml"])


def _readme_command(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"{title}.*?```bash\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no bash block after {title!r}"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_command("### Run all tests")
    ci = (ROOT / ".ci/run").read_text()
    assert command in ci.splitlines(), f".ci/run must run {command!r}"


def test_every_package_is_a_namespace_portion_with_its_own_version():
    # meshes, ep, fsdp_moe, prefetch, sequence, lora, models_common, qwen3moe, deepseekv3, qwen35moe, gptoss,
    # data, checkpoint, train
    assert len(PACKAGE_DIRS) == 14
    for pyproject in PACKAGE_DIRS:
        pkg = pyproject.parent
        meta = tomllib.loads(pyproject.read_text())["project"]
        assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"]), pyproject
        assert (pkg / "README.md").is_file() and (pkg / "CHANGELOG.md").is_file(), pkg
        assert f"## {meta['version']}" in (pkg / "CHANGELOG.md").read_text(), f"{pkg}: no CHANGELOG entry"
        assert (pkg / "src/moeshard").is_dir(), pkg
        assert not (pkg / "src/moeshard/__init__.py").exists(), f"{pkg}: moeshard must stay a namespace package"
        assert (pkg / "tests").is_dir(), pkg
