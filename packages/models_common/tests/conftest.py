"""Shared fixtures: the toy family of ``moeshard.models.common.testing`` (the shared pieces alone, no Hub family)
saved as an HF checkpoint, and a padded batch."""

from __future__ import annotations

import pytest

from moeshard.models.common.testing import padded_batch, save_toy_checkpoint


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """Directory of a random ToyForCausalLM (3 layers, layer 1 dense; 8 experts top-2, D 64, F 32), per-expert keys."""
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="session")
def batch():
    """``(input_ids, attention_mask, labels)``: 2 sequences of 12, the second left-padded by 4."""
    return padded_batch()
