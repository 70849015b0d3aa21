"""Sequence-sharded attention equals whole-row attention, forward and gradients of q, k and v, on gloo ranks.

Every rank builds the same whole rows (a fixed seed per sequence group), computes the whole-row reference in one
process, then attends from its own token shard through the two all-to-alls; outputs and the gradients that reach
its shard of q, k, v must be the reference's slices. Plain causal (SDPA's ``is_causal``), document-masked (a dense
boolean mask, and flex_attention's ``BlockMask`` in forward only: it has no backward on CPU; both built for the
whole row), GQA with G a multiple of sp, sp above the KV heads, sp neither, and MLA's shape (as many KV heads as
query heads, value width unlike the key's).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from moeshard.meshes.testing import run_distributed
from moeshard.sequence import UlyssesAttention, heads_to_sequence, sequence_to_heads, ulysses_attention

TOL = dict(rtol=1e-5, atol=1e-6)


def attend(q, k, v, mask, *, scale, enable_gqa):
    """The models' attention call (``moeshard.models.common.attend``'s SDPA and flex paths)."""
    if mask is not None and not torch.is_tensor(mask):
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa
    )


def _documents(B, S, gen):
    """Whole-row document ids: each row cut at random points into pieces."""
    rows = []
    for _ in range(B):
        cuts = torch.zeros(S, dtype=torch.int64)
        cuts[torch.randperm(S - 1, generator=gen)[:3] + 1] = 1
        rows.append(cuts.cumsum(0))
    return torch.stack(rows)


def _mask(kind, doc_BS):
    B, S = doc_BS.shape
    if kind == "causal":
        return None
    if kind == "document":
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        return ((doc_BS[:, :, None] == doc_BS[:, None, :]) & causal)[:, None]

    def same_document_causal(b, h, q, kv):
        return (doc_BS[b, q] == doc_BS[b, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, B, None, S, S, device="cpu")


def _case(group, seed, B, S, H, G, Dq, Dv, kind):
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, Dq, generator=gen, dtype=torch.float64).float()
    k = torch.randn(B, G, S, Dq, generator=gen, dtype=torch.float64).float()
    v = torch.randn(B, G, S, Dv, generator=gen, dtype=torch.float64).float()
    w = torch.randn(B, H, S, Dv, generator=gen, dtype=torch.float64).float()  # d loss / d out
    mask = _mask(kind, _documents(B, S, gen))
    scale = Dq**-0.5

    s = S // sp
    mine = slice(r * s, (r + 1) * s)
    # flex_attention has no backward on CPU: its case checks the forward (the exchanges' backward is the same)
    grads = kind != "flex"
    ref_q, ref_k, ref_v = (t.clone().requires_grad_(grads) for t in (q, k, v))
    ref = attend(ref_q, ref_k, ref_v, mask, scale=scale, enable_gqa=G != H)
    lq, lk, lv = (t[:, :, mine].clone().requires_grad_(grads) for t in (q, k, v))
    out = ulysses_attention(attend, lq, lk, lv, mask, scale=scale, enable_gqa=G != H, group=group)
    assert out.shape == (B, H, s, Dv)
    torch.testing.assert_close(out, ref[:, :, mine].detach(), **TOL)
    if grads:
        (ref * w).sum().backward()
        (out * w[:, :, mine]).sum().backward()  # each rank its own tokens' part of the loss
        for name, local, whole in (("q", lq, ref_q), ("k", lk, ref_k), ("v", lv, ref_v)):
            torch.testing.assert_close(local.grad, whole.grad[:, :, mine], **TOL, msg=lambda m, n=name: f"d{n}: {m}")
    return f"{kind} H{H} G{G} sp{sp}"


def _round_trip(group):
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    B, H, S, D = 2, 2 * sp, 4 * sp, 3
    whole = torch.arange(B * H * S * D, dtype=torch.float32).reshape(B, H, S, D)
    s, h = S // sp, H // sp
    x = whole[:, :, r * s : (r + 1) * s].clone().requires_grad_()
    y = sequence_to_heads(x, group)
    assert torch.equal(y, whole[:, r * h : (r + 1) * h])  # its head shard, every token in row order
    assert torch.equal(heads_to_sequence(y, group), x)
    y.backward(y.detach() * 2)  # the backward is the inverse exchange
    assert torch.equal(x.grad, 2 * x.detach())
    # [B, S, H, D]: heads on dim 2, tokens on dim 1
    x_BsHD = whole.transpose(1, 2)[:, r * s : (r + 1) * s]
    y_BShD = sequence_to_heads(x_BsHD, group, head_dim=2, seq_dim=1)
    assert torch.equal(y_BShD, whole.transpose(1, 2)[:, :, r * h : (r + 1) * h])
    assert torch.equal(heads_to_sequence(y_BShD, group, head_dim=2, seq_dim=1), x_BsHD)


def _sp_whole_world():
    group = dist.group.WORLD
    sp = dist.get_world_size()
    _round_trip(group)
    done = []
    if sp == 2:
        cases = [
            (4, 2, 8, 8, "causal"),  # G a multiple of sp
            (4, 1, 8, 8, "document"),  # sp above the KV heads
            (4, 2, 8, 8, "flex"),
        ]
    else:
        cases = [
            (8, 2, 8, 8, "causal"),  # sp 4 over 2 KV heads: each KV head on two ranks
            (8, 2, 8, 8, "document"),
            (12, 6, 8, 8, "document"),  # sp neither divides G nor is a multiple of it
            (4, 4, 12, 8, "document"),  # MLA's shape: H KV heads, value width unlike the key's
            (8, 1, 8, 8, "flex"),
        ]
    for i, (H, G, Dq, Dv, kind) in enumerate(cases):
        done.append(_case(group, 100 + i, 2, 4 * sp, H, G, Dq, Dv, kind))
    # the wrapper: a drop-in for the attention call
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 2 * sp, 8, generator=gen) for _ in range(3))
    r, s = dist.get_rank(), 2
    mine = slice(r * s, (r + 1) * s)
    got = UlyssesAttention(attend, group)(
        q[:, :, mine], k[:, :, mine], v[:, :, mine], None, scale=1.0, enable_gqa=False
    )
    torch.testing.assert_close(got, attend(q, k, v, None, scale=1.0, enable_gqa=False)[:, :, mine], **TOL)
    return done


def _two_groups_of_two():
    # ranks [0, 1] and [2, 3] share a row each (consecutive ranks), with rows of their own
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = dist.get_rank() // 2
    group = groups[mine]
    _round_trip(group)
    return _case(group, 10 + mine, 2, 8, 4, 1, 8, 8, "document")


def test_world_2():
    res = run_distributed(_sp_whole_world, 2)
    assert res[0] == res[1] == ["causal H4 G2 sp2", "document H4 G1 sp2", "flex H4 G2 sp2"]


def test_world_4():
    res = run_distributed(_sp_whole_world, 4)
    assert len(set(map(tuple, res))) == 1 and len(res[0]) == 5


def test_world_4_as_two_sequence_groups_of_two():
    assert run_distributed(_two_groups_of_two, 4) == ["document H4 G1 sp2"] * 4
