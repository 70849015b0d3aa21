"""noxfile.py: every package has a session, and a session installs exactly what its package declares."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("nox", reason="noxfile.py imports nox (`pip install nox`)")


def _load_noxfile():
    spec = importlib.util.spec_from_file_location("_moeshard_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def noxfile():
    return _load_noxfile()  # registers its sessions with nox, which nothing here runs


def test_every_package_has_a_session_and_ci_runs_it(noxfile):
    pyprojects = [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
    assert sorted(noxfile.PACKAGES.values()) == sorted(p.parent.relative_to(ROOT).as_posix() for p in pyprojects)
    named = {  # the names README.md gives
        "meshes": "packages/meshes",
        "ep": "packages/ep",
        "fsdp_moe": "packages/fsdp_moe",
        "prefetch": "packages/prefetch",
        "sequence": "packages/sequence",
        "lora": "packages/lora",
        "qwen3moe": "packages/models_qwen3moe",
        "qwen35moe": "packages/models_qwen35moe",
        "train": "apps/train",
    }
    assert named.items() <= noxfile.PACKAGES.items()
    assert noxfile.nox.options.sessions == ["lint", *noxfile.PACKAGES, "cross"]


def test_a_session_installs_what_its_package_declares(noxfile):
    closure = {name: noxfile._internal_closure(folder) for name, folder in noxfile.PACKAGES.items()}
    assert closure["meshes"] == ["packages/meshes"]
    assert closure["ep"] == ["packages/meshes", "packages/ep"]
    assert closure["prefetch"] == ["packages/meshes", "packages/prefetch"]  # meshes: its tests' harness (`test`)
    assert closure["sequence"] == ["packages/meshes", "packages/sequence"]  # the same
    assert noxfile._internal_closure("packages/sequence", extras=()) == ["packages/sequence"]  # torch only
    assert closure["lora"] == ["packages/lora"]  # torch and safetensors; PEFT only in its `test` extra
    # the model's `test` extra names its `parallel` extra: meshes, fsdp_moe, prefetch, sequence
    assert set(closure["qwen3moe"]) == {
        "packages/meshes",
        "packages/ep",
        "packages/models_common",
        "packages/fsdp_moe",
        "packages/prefetch",
        "packages/sequence",
        "packages/models_qwen3moe",
    }
    assert noxfile._internal_closure("packages/models_qwen3moe", extras=()) == [
        "packages/meshes",
        "packages/ep",
        "packages/models_common",
        "packages/models_qwen3moe",
    ]
    assert noxfile._internal_closure("packages/models_common", extras=()) == [
        "packages/meshes",
        "packages/ep",
        "packages/models_common",
    ]
    assert "packages/models_qwen3moe" not in closure["models_common"]  # the shared package is below the families
    for name, folders in closure.items():  # dependencies first, the package last
        assert folders[-1] == noxfile.PACKAGES[name]
        for i, folder in enumerate(folders):
            assert set(noxfile._internal_closure(folder, extras=())) <= set(folders[: i + 1]), (name, folder)
