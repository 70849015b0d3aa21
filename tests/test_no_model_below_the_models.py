"""No model below the models: ``meshes``, ``ep``, ``fsdp_moe``, ``prefetch``, ``sequence`` and ``data`` know no model
family, and the app names one only in ``families.py`` (its table of families; the rest of it reaches the shared
``moeshard.models.common``).

Their code (names, attributes, imports, and any string naming ``moeshard.models``) mentions no family: experts are
found through a family's EP plan, never through a family's class or module. Prose (docstrings, comments, messages
that cite an example checkpoint) is not code and is not scanned.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BELOW = ("meshes", "ep", "fsdp_moe", "prefetch", "sequence", "data")
FAMILY = re.compile(r"qwen|deepseek|mixtral|llama|kimi|moonlight|gpt_?oss|dbrx|olmoe", re.I)


def _code_names(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every name token and of every string that names ``moeshard.models``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and "moeshard.models" in tok.string):
            found.append((tok.start[0], tok.string))
    return found


@pytest.mark.parametrize("package", BELOW)
def test_the_package_names_no_model_family(package):
    files = sorted((ROOT / "packages" / package / "src").rglob("*.py"))
    assert files, package
    hits = [
        f"{file.relative_to(ROOT)}:{line}: {text}"
        for file in files
        for line, text in _code_names(file.read_text())
        if FAMILY.search(text) or "moeshard.models" in text
    ]
    assert not hits, "a model family named below the models:\n" + "\n".join(hits)


def test_the_app_names_a_family_only_in_its_table_of_families():
    files = [f for f in sorted((ROOT / "apps/train/src").rglob("*.py")) if f.name != "families.py"]
    assert files
    hits = [
        f"{file.relative_to(ROOT)}:{line}: {text}"
        for file in files
        for line, text in _code_names(file.read_text())
        if FAMILY.search(text) and (text.isidentifier() or re.search(r"moeshard\.models\.(?!common\b)", text))
    ]
    assert not hits, "a model family named outside apps/train/src/moeshard/train/families.py:\n" + "\n".join(hits)


def test_the_scan_sees_a_family_name():
    assert [t for _, t in _code_names("from moeshard.models.qwen3moe import X\nqwen = 1  # deepseek\n")] == [
        "from",
        "moeshard",
        "models",
        "qwen3moe",
        "import",
        "X",
        "qwen",
    ]
    assert _code_names("'''Qwen3 in prose'''\nm = 'moeshard.models.x'\n")[-1] == (2, "'moeshard.models.x'")
