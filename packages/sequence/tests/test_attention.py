"""Key/value replication for sp above the KV heads, and the single-rank path (no group: attention as is)."""

import pytest
import torch
import torch.nn.functional as F

from moeshard.sequence import UlyssesAttention, heads_to_sequence, kv_replication, sequence_to_heads, ulysses_attention
from moeshard.sequence._attention import replicate_kv_heads


def test_kv_replication_factor():
    assert kv_replication(32, 4, 1) == 1
    assert kv_replication(32, 4, 4) == 1  # one KV head per rank
    assert kv_replication(32, 4, 8) == 2  # Qwen3-30B-A3B at sp 8: each KV head on two ranks
    assert kv_replication(32, 4, 32) == 8
    assert kv_replication(12, 6, 4) == 2  # sp neither divides G nor is a multiple of it: lcm(6, 4) = 12 copies
    assert kv_replication(16, 16, 4) == 1  # MHA (MLA's keys and values)
    with pytest.raises(ValueError, match="choose sp_size among"):
        kv_replication(32, 4, 3)


@pytest.mark.parametrize("H,G,sp", [(32, 4, 8), (8, 2, 4), (12, 6, 4), (8, 1, 4), (8, 4, 2)])
def test_each_rank_gets_the_kv_heads_its_query_heads_read(H, G, sp):
    k = kv_replication(H, G, sp)
    kv = torch.arange(G).float().reshape(1, G, 1, 1)  # head j holds the value j
    copies = replicate_kv_heads(kv, H, sp).flatten().tolist()
    g_local, h_local = G * k // sp, H // sp
    for r in range(sp):
        mine = copies[r * g_local : (r + 1) * g_local]  # the copies the exchange gives rank r
        for q in range(r * h_local, (r + 1) * h_local):
            # GQA inside the rank: local query head i reads local key/value head i // (h_local / g_local)
            i = q - r * h_local
            assert mine[i // (h_local // g_local)] == q // (H // G), (r, q)


def test_replicated_kv_gives_the_same_attention():
    torch.manual_seed(0)
    H, G, S, D = 8, 2, 6, 4
    q, k, v = torch.randn(1, H, S, D), torch.randn(1, G, S, D), torch.randn(1, G, S, D)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rk, rv = replicate_kv_heads(k, H, 8), replicate_kv_heads(v, H, 8)
    assert rk.shape == (1, 8, S, D)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, rk, rv, is_causal=True, enable_gqa=True), ref)


def test_without_a_group_everything_is_the_identity():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    assert sequence_to_heads(q, None) is q and heads_to_sequence(q, None) is q

    def attn(q, k, v, mask, *, scale, enable_gqa):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
        )

    ref = attn(q, k, v, None, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(ulysses_attention(attn, q, k, v, None, scale=0.5, enable_gqa=True, group=None), ref)
    torch.testing.assert_close(UlyssesAttention(attn, None)(q, k, v, None, scale=0.5, enable_gqa=True), ref)
