"""Hub folders: the text model's and the vision-language model's (its language model read, the vision tower and
MTP weights skipped with one line each); export writes a folder transformers loads."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers import Qwen3_5MoeForCausalLM as HFQwen35MoeForCausalLM

from moeshard.models.qwen35moe import FAMILY, Qwen35MoeForCausalLM, get_preset_config


def test_vision_language_folder_loads_its_language_model(tmp_path, caplog):
    torch.manual_seed(3)
    text = get_preset_config("tiny").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    vl = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).float()
    vl.save_pretrained(tmp_path)
    save_file({"mtp.fc.weight": torch.zeros(4, 4)}, tmp_path / "mtp.safetensors")  # as the Hub's folders carry
    index = tmp_path / "model.safetensors.index.json"
    assert not index.exists()  # one file: every *.safetensors of the folder is read
    with caplog.at_level(logging.WARNING):
        ours = Qwen35MoeForCausalLM.from_pretrained(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 2 and "vision tower" in lines[0] and "multi-token prediction" in lines[1], lines
    assert FAMILY.load_config(tmp_path).model_type == "qwen3_5_moe_text"
    ids = torch.randint(0, 512, (1, 20))
    torch.testing.assert_close(ours(ids).logits, vl(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_export_is_a_text_folder_transformers_loads(hf_dir, tmp_path):
    ours = Qwen35MoeForCausalLM.from_pretrained(hf_dir)
    ours.save_pretrained(tmp_path / "out")
    back = HFQwen35MoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 9))
    torch.testing.assert_close(back(input_ids=ids).logits, ours(ids).logits, rtol=0, atol=1e-5)
    again = Qwen35MoeForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(again(ids).logits, ours(ids).logits)


def test_facts_count_the_delta_rule_work():
    config = get_preset_config("tiny")
    facts = FAMILY.facts(config)
    # only the one gated-attention layer grows with the sequence: 4 heads x (16 + 16)
    assert facts.attention_width == 4 * 32 and facts.moe_layers == 4
    per_layer = 2 * 4 * (64 * (3 * 16 + 2 * 16) + 3 * 16 * 16)  # H=4 value heads, Dk=Dv=16, chunk 64
    assert facts.recurrent_flops == 3 * per_layer
    assert facts.flops_per_token(128) - facts.flops_per_token(64) == 6 * 32 * facts.attention_width
    total, active = FAMILY.count_parameters(get_preset_config("qwen3.5-35b-a3b"))
    assert 34e9 < total < 36e9 and 3e9 < active < 4e9  # 35B-A3B
