"""The dispatch permutations without a process group: sort, inverse, regroup, expand, combine; and the sync count."""

import pytest
import torch

from moeshard.ep import EPOptions
from moeshard.ep._dispatch import routed_experts
from moeshard.ep._kernels import kernels_for
from moeshard.ep._permute import (
    combine,
    expand_rows,
    expand_rows_and_weights,
    inverse_permutation,
    narrow_keys,
    permute_rows,
    regroup_by_local_expert,
    sort_by_expert,
)
from moeshard.ep.testing import count_host_syncs

# T tokens, K top-k, D hidden, E experts, El local experts, P EP size, N copies, R received rows


def test_sort_by_expert_is_stable_and_counts():
    ids_TK = torch.tensor([[2, 0], [0, 3], [2, 1]])
    order_N, counts_E = sort_by_expert(ids_TK, num_experts=5)
    # copies t*K+k: expert 0 ← copies 1, 2 (tokens 0, 1 in token order), 1 ← 5, 2 ← 0, 4, 3 ← 3, 4 ← none
    assert order_N.tolist() == [1, 2, 5, 0, 4, 3]
    assert (order_N // 2).tolist() == [0, 1, 2, 0, 2, 1]
    assert counts_E.tolist() == [2, 1, 2, 1, 0] and counts_E.dtype == torch.int64


def test_sort_by_expert_empty_and_all_to_one():
    order_N, counts_E = sort_by_expert(torch.zeros(0, 2, dtype=torch.int64), num_experts=3)
    assert order_N.numel() == 0 and counts_E.tolist() == [0, 0, 0]
    order_N, counts_E = sort_by_expert(torch.full((4, 1), 2), num_experts=3)
    assert order_N.tolist() == [0, 1, 2, 3] and counts_E.tolist() == [0, 0, 4]


def test_sort_by_expert_narrow_keys_keep_the_order():
    # The keys are sorted in the narrowest dtype that holds the expert count (one radix pass per byte on CUDA);
    # a stable sort's order depends on the values only, so it is the int64 sort's, at each width.
    for E, dtype in ((128, torch.uint8), (256, torch.int16), (40_000, torch.int32)):
        ids_TK = torch.randint(0, E, (300, 8), generator=torch.Generator().manual_seed(E))
        assert narrow_keys(ids_TK, E).dtype == dtype
        order_N, counts_E = sort_by_expert(ids_TK, E)
        assert torch.equal(order_N, torch.sort(ids_TK.reshape(-1), stable=True)[1])
        assert torch.equal(counts_E, torch.bincount(ids_TK.reshape(-1), minlength=E))


def test_inverse_permutation():
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(0))
    a = torch.arange(17) * 10
    assert torch.equal(a[perm][inverse_permutation(perm)], a)


def test_regroup_by_local_expert():
    # 3 sources x 2 local experts: rows arrive as (source, expert) blocks of these sizes
    counts_SEl = torch.tensor([[2, 1], [0, 3], [1, 1]])
    expert_of_row = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1])
    source_of_row = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    perm = regroup_by_local_expert(counts_SEl, 8)
    assert expert_of_row[perm].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert source_of_row[perm].tolist() == [0, 0, 2, 0, 1, 1, 1, 2]  # sources in order within each expert
    # one source: its rows already are grouped by local expert, no permutation
    assert regroup_by_local_expert(torch.tensor([[2, 1, 3]]), 6) is None


def test_permute_rows_backward_is_the_inverse_gather():
    perm = torch.tensor([2, 0, 3, 1])
    x = torch.arange(8.0).view(4, 2).requires_grad_(True)
    y = permute_rows(x, perm, inverse_permutation(perm))
    assert torch.equal(y, x.detach()[perm])
    g = torch.randn(4, 2)
    y.backward(g)
    assert torch.equal(x.grad[perm], g)


def test_expand_rows_sorted_weights_and_combine():
    kernels = kernels_for("eager")
    ids_TK = torch.tensor([[1, 0], [0, 1]])
    order_N, _ = sort_by_expert(ids_TK, num_experts=2)
    inv_N = inverse_permutation(order_N)
    x_TD = torch.tensor([[10.0], [20.0]], requires_grad=True)
    x_sorted = expand_rows(x_TD, order_N, inv_N, 2, kernels)
    assert x_sorted.flatten().tolist() == [10.0, 20.0, 10.0, 20.0]  # expert 0: tokens 0, 1; expert 1: tokens 0, 1
    x_sorted.sum().backward()
    assert x_TD.grad.flatten().tolist() == [2.0, 2.0]  # each token's K copies added
    # with each copy's routing weight in the same order, in float32, its gradient back in the weights' place
    w_TK = torch.tensor([[0.5, 0.25], [1.0, 2.0]], dtype=torch.bfloat16, requires_grad=True)
    x2_TD = x_TD.detach().clone().requires_grad_(True)
    x_sorted2, w_sorted = expand_rows_and_weights(x2_TD, w_TK, order_N, inv_N, 2, kernels)
    assert torch.equal(x_sorted2, x_sorted)
    assert w_sorted.dtype == torch.float32 and w_sorted.tolist() == [0.25, 1.0, 0.5, 2.0]
    (w_sorted * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward(retain_graph=True)
    assert w_TK.grad.dtype == torch.bfloat16 and w_TK.grad.tolist() == [[3.0, 1.0], [2.0, 4.0]]
    assert x2_TD.grad is None  # only the weights were used
    (x_sorted2.sum() + w_sorted.sum()).backward()
    assert x2_TD.grad.flatten().tolist() == [2.0, 2.0]
    # the combine un-sorts and adds each token's copies (weighted by the expert pass already)
    y_copy_ND = torch.tensor([[1.0], [2.0], [3.0], [4.0]], requires_grad=True)  # outputs in copy order t*K+k
    y_TD = combine(y_copy_ND[order_N], order_N, inv_N, 2, kernels)
    assert y_TD.flatten().tolist() == [3.0, 7.0]
    y_TD.backward(torch.tensor([[5.0], [6.0]]))
    assert y_copy_ND.grad.flatten().tolist() == [5.0, 5.0, 6.0, 6.0]  # each copy gets its token's gradient


@pytest.mark.parametrize("tier", ["eager", "compiled"])
def test_combine_sums_in_float32_and_rounds_once(tier):
    # bf16 copies added in float32 and rounded once to the caller's dtype; each copy's gradient is its token's
    kernels = kernels_for(tier)
    g = torch.Generator().manual_seed(0)
    T, K, E, D = 37, 4, 8, 24
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    order_N, _ = sort_by_expert(ids, E)
    inv_N = inverse_permutation(order_N)
    y = torch.randn(T * K, D, generator=g).to(torch.bfloat16).requires_grad_()
    gy_TD = torch.randn(T, D, generator=g).to(torch.bfloat16)
    out = combine(y, order_N, inv_N, K, kernels)
    want = y.detach().float()[inv_N].view(T, K, D).sum(dim=1).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.backward(gy_TD)
    assert torch.equal(y.grad, gy_TD[order_N // K])


def test_ep1_host_syncs():
    g = torch.Generator().manual_seed(0)
    x_TD, ids_TK, w_TK = torch.randn(6, 8, generator=g), torch.randint(4, (6, 2), generator=g), torch.rand(6, 2)
    w1, w2 = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 4, generator=g)
    with count_host_syncs() as syncs:
        routed_experts(x_TD, ids_TK, w_TK, w1, w2, num_experts=4, options=EPOptions(gemm="grouped_mm"))
    assert dict(syncs) == {}  # grouped_mm takes device offsets
    with count_host_syncs() as syncs:
        routed_experts(x_TD, ids_TK, w_TK, w1, w2, num_experts=4, options=EPOptions(gemm="loop"))
    assert dict(syncs) == {"tolist": 1}  # the loop's row counts
    with count_host_syncs() as syncs:
        torch.tensor([1]).item()
        torch.tensor([1, 0]).nonzero()
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert dict(syncs) == {"_local_scalar_dense": 1, "nonzero": 1, "repeat_interleave without output_size": 1}
