"""Write a tiny checkpoint of any family (HF layout, random weights) and a small JSONL data set for the examples.

    python examples/make_tiny_inputs.py /tmp/tiny                          # -> /tmp/tiny/model/, /tmp/tiny/data.jsonl
    python examples/make_tiny_inputs.py /tmp/tiny_ds --family deepseek_v3  # the DeepSeek-V3 architecture
    python examples/make_tiny_inputs.py /tmp/tiny_q35 --family qwen3_5_moe_text   # or gpt_oss

Qwen3-MoE and DeepSeek-V3 checkpoints are written by transformers' own ``save_pretrained`` (the Hub's layout);
Qwen3.5-MoE and GPT-OSS ones by the family's model at its ``tiny`` preset (``FAMILY.preset_config("tiny")``), whose
``save_pretrained`` writes folders transformers loads. The data are records ``{"input_ids": [...]}`` of varied
lengths, so ranks see different numbers of label tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moeshard.models import gptoss, qwen35moe

# Small enough for 4 CPU processes in seconds, with top-k > 1, GQA and every layer MoE.
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
)


# The same widths as DeepSeek-V3: MLA with a query LoRA, a dense first layer, 4 expert groups (2 kept), a shared
# expert, sigmoid scores with the correction bias.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=64,
    num_mtp_layers=0,
    tie_word_embeddings=False,
)


# The families written from their ``tiny`` preset (model_type -> FAMILY).
PRESET_FAMILIES = {family.name: family for family in (qwen35moe.FAMILY, gptoss.FAMILY)}
FAMILY_NAMES = ("qwen3_moe", "deepseek_v3", *PRESET_FAMILIES)


def write_model(path: Path, seed: int = 0, family: str = "qwen3_moe") -> Path:
    """A randomly initialised tiny model of ``family`` (one of :data:`FAMILY_NAMES`, a ``model_type``) saved in the
    Hub's layout."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"family {family!r} is none of {FAMILY_NAMES}; pass one of them")
    torch.manual_seed(seed)
    if family == "deepseek_v3":
        DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK_V3)).save_pretrained(path)
    elif family == "qwen3_moe":
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).save_pretrained(path)
    else:
        model = PRESET_FAMILIES[family].model_class(PRESET_FAMILIES[family].preset_config("tiny"))
        model.init_weights()  # the family's own initialisation, drawn from the seed above
        model.save_pretrained(path)
    return path


def write_data(path: Path, num_records: int = 64, seq_len: int = 24, seed: int = 0) -> Path:
    """``num_records`` JSONL records of 8..seq_len token ids (learnable: arithmetic sequences)."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(num_records):
            n = int(torch.randint(8, seq_len + 1, (), generator=g))
            start, stride = (int(v) for v in torch.randint(1, 40, (2,), generator=g))
            ids = [(start + stride * j) % TINY["vocab_size"] for j in range(n)]
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for model/ and data.jsonl")
    parser.add_argument("--family", choices=FAMILY_NAMES, default="qwen3_moe")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_model(args.out / "model", family=args.family), write_data(args.out / "data.jsonl"))


if __name__ == "__main__":
    main()
