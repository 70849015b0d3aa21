"""Qwen3-MoE's checkpoints: transformers' per-expert keys and our fused ones load alike, and the family's config
fields name a mismatch. The shared loader and writer (expert ranges, casts, atomic and streamed save, every kind of bad
checkpoint) are ``moeshard.models.common``'s tests."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moeshard.models.common import CheckpointError, load_hf_weights
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config, load_hf_config

EXPERTS0 = "model.layers.0.mlp.experts"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_per_expert_and_fused_layouts_load_identically(hf_dir, tmp_path):
    per_expert = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    assert f"{EXPERTS0}.3.up_proj.weight" in load_file(hf_dir / "model.safetensors")  # transformers' own layout
    per_expert.save_pretrained(tmp_path / "fused", expert_layout="fused")
    assert f"{EXPERTS0}.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    fused = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "fused")
    # Sharded per-expert (a layer's experts spread over several files, as on the Hub), read back by our loader
    per_expert.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len({index["weight_map"][f"{EXPERTS0}.{e}.down_proj.weight"] for e in range(8)}) > 1
    sharded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "sharded")
    a, b, c = _params(per_expert), _params(fused), _params(sharded)
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name
    # and the fused tensor is gate rows then up rows of each expert
    raw = load_file(hf_dir / "model.safetensors")
    gate_up = a[f"{EXPERTS0}.gate_up_proj"]
    assert torch.equal(gate_up[5, :32], raw[f"{EXPERTS0}.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 32:], raw[f"{EXPERTS0}.5.up_proj.weight"])
    assert torch.equal(a[f"{EXPERTS0}.down_proj"][5], raw[f"{EXPERTS0}.5.down_proj.weight"])


def test_another_architecture_and_another_shape_are_refused_by_name(hf_dir, tmp_path):
    other = tmp_path / "llama"
    shutil.copytree(hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama', this model is 'qwen3_moe'"):
        Qwen3MoeForCausalLM.from_pretrained(other)
    other = Qwen3MoeForCausalLM(get_preset_config("tiny"))
    with pytest.raises(CheckpointError, match="num_hidden_layers=3, the model was built with num_hidden_layers=4"):
        load_hf_weights(other, hf_dir)
    config = load_hf_config(hf_dir)
    config.mlp_only_layers = []
    dense = Qwen3MoeForCausalLM(config)
    with pytest.raises(CheckpointError, match=r"mlp_only_layers=\[1\], the model was built with mlp_only_layers=\[\]"):
        load_hf_weights(dense, hf_dir)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_files_get_a_new_files_mode(hf_dir, tmp_path, umask):
    import os
    import stat

    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")  # several shards and an index
    finally:
        os.umask(old)
    files = sorted((tmp_path / "ckpt").iterdir())
    assert sum(f.suffix == ".safetensors" for f in files) > 1
    # safetensors alone writes 0600; every file gets what the umask leaves of 0666, as config.json does
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no probe or staging leftovers
