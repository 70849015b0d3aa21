"""The shared blocks alone: FP8 block dequantisation of any slice, and one RoPE for default and scaled configs."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig

from moeshard.models.common import RotaryEmbedding
from moeshard.models.common._fp8 import dequantize


def test_any_slice_dequantises_as_the_whole_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g)
    block = (16, 8)
    scale = torch.rand(3, 7, generator=g) + 0.5
    q = w.to(torch.float8_e4m3fn)
    full = q.float() * scale.repeat_interleave(16, 0).repeat_interleave(8, 1)[:37, :50]
    for rows, cols in ((slice(0, 37), slice(0, 50)), (slice(5, 30), slice(9, 41)), (slice(16, 17), slice(49, 50))):
        got = dequantize(q[rows, cols], scale, (rows, cols), block, torch.float32)
        assert torch.equal(got, full[rows, cols]), (rows, cols)


def test_rope_default_and_yarn_follow_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    qwen = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    pos = torch.arange(10)[None]
    cos, _ = RotaryEmbedding(qwen)(pos, torch.float32)
    inv = 1.0 / (qwen.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(cos, torch.cat([pos[..., None] * inv] * 2, -1).cos(), rtol=0, atol=0)
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    ds = DeepseekV3Config(qk_rope_head_dim=8, max_position_embeddings=256, rope_parameters=rope)
    cos, _ = RotaryEmbedding(ds)(pos, torch.float32)
    inv, scaling = ROPE_INIT_FUNCTIONS["yarn"](ds, "cpu")
    torch.testing.assert_close(cos, torch.cat([pos[..., None] * inv] * 2, -1).cos() * scaling)
