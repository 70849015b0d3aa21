"""The app reads a family's facts only through the family (``ModelFamily.facts``): no Hub field name that one family
spells one way and another family another way appears in its source, so a new family's config cannot break it."""

from __future__ import annotations

import re
from pathlib import Path

import moeshard.train

# Routed experts, top-k and expert width as Qwen3-MoE and DeepSeek-V3 name them in their configs.
FAMILY_FIELDS = ("moe_intermediate_size", "num_experts_per_tok", "n_routed_experts", "n_shared_experts")


def test_the_app_names_no_family_field():
    root = Path(moeshard.train.__path__[0])
    sources = sorted(root.rglob("*.py"))
    assert len(sources) > 20  # the app's own modules were found
    found = [
        f"{path.relative_to(root)}:{i}: {field}"
        for path in sources
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for field in FAMILY_FIELDS
        if re.search(rf"\b{field}\b", line)
    ]
    assert not found, "read these through family_of(config).facts(config):\n" + "\n".join(found)
