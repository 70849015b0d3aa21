"""Installing one package pulls in only what it declares (a fresh venv per check)."""

import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    return path / "bin" / "python"


def _run(py: Path, *args: str) -> str:
    res = subprocess.run([str(py), *args], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.slow
def test_meshes_installs_alone(tmp_path):
    py = _fresh_venv(tmp_path / "venv")
    # torch first from the CPU build; then the package, which must add nothing but itself.
    _run(py, "-m", "pip", "install", "-q", TORCH)
    _run(py, "-m", "pip", "install", "-q", str(ROOT / "packages" / "meshes"))
    out = _run(
        py,
        "-c",
        "import importlib.util, moeshard.meshes as m; "
        "print(m.plan_layout(16, 8, 8).ep_fsdp_size); "
        "print([n for n in ('transformers', 'safetensors', 'moeshard.ep') if importlib.util.find_spec(n)])",
    )
    assert out.split() == ["2", "[]"], out
