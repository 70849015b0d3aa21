"""The row-wise top-k kernels against ``torch.topk``: the routers' ids (``topk_ids``) and the load-balancing loss's
counts (``topk_counts``). Interpreted on CPU (a child process with ``TRITON_INTERPRET=1``) against a top-k whose ties
go to the lower index, compiled for sm_90 without a GPU, and on CUDA against ``torch.topk`` itself, in ``row_topk``
(also compiled) and inside ``load_balancing_loss``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def lowest_index_topk(probs_NE: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest values, ties to the lower index (a stable sort by value, descending)."""
    return torch.sort(probs_NE.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def counts_of(ids_NK: torch.Tensor, weight_N: torch.Tensor, e: int) -> torch.Tensor:
    w = weight_N.float().repeat_interleave(ids_NK.shape[1])
    return torch.zeros(e, dtype=torch.float32).scatter_add_(0, ids_NK.reshape(-1).cpu(), w.cpu())


def tie_heavy(n: int, e: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Softmax probabilities of small logits in a 16-bit dtype: many equal values within a row."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, e, generator=g) * 0.05).to(dtype)
    logits[::5, : e // 2] = 0  # rows with half their values tied exactly
    return torch.softmax(logits.to(device), dim=-1)


CASES = [
    (200, 128, 8, torch.bfloat16),
    (67, 60, 6, torch.bfloat16),
    (9, 16, 16, torch.float32),
    (130, 256, 2, torch.float16),
]


def check(device: str) -> None:
    from moeshard.models.common._topk import row_topk
    from moeshard.models.common._topk_triton import topk_counts, topk_ids, topk_ids_op

    for i, (n, e, k, dtype) in enumerate(CASES):
        probs = tie_heavy(n, e, dtype, seed=i, device=device)
        weight = (torch.arange(n) % 7 != 3).float().to(device)  # a padding mask's zeros
        want_ids = lowest_index_topk(probs.cpu(), k)
        assert torch.equal(topk_ids(probs, k).cpu(), want_ids), i  # the order too: by value, equal values by index
        assert torch.equal(topk_ids_op(probs, k).cpu(), want_ids), i
        got = topk_counts(probs, weight, k)
        want = counts_of(want_ids, weight.cpu(), e)
        assert torch.equal(got.cpu(), want), (i, (got.cpu() - want).abs().max())
        strided = torch.cat([probs, probs[:, :3]], dim=1)[:, :e]  # rows with a stride of their own
        assert torch.equal(topk_counts(strided, weight, k).cpu(), want)
        assert torch.equal(topk_ids(strided, k).cpu(), want_ids)
    # NaN ranks first, as torch.topk ranks it; -inf values still give distinct ids of the row (never a padded column)
    odd = torch.tensor([[0.1, float("nan"), 0.3, 0.2, 0.0], [float("-inf")] * 5, [0.5, float("-inf"), 0.2, 1.0, 0.2]])
    assert topk_ids(odd.to(device), 3).cpu().tolist() == [[1, 2, 3], [0, 1, 2], [3, 0, 2]]
    # The values gathered at the ids differentiate as torch.topk's (distinct float32 scores: no tie to order).
    scores = torch.randn(40, 128, generator=torch.Generator().manual_seed(5)).to(device).requires_grad_()
    ids = topk_ids(scores.detach(), 8)
    values = scores.gather(-1, ids)
    upstream = torch.randn(40, 8).to(device)
    (grad,) = torch.autograd.grad(values, scores, upstream)
    want_values, want_ids = torch.topk(scores, 8, dim=-1)
    (want_grad,) = torch.autograd.grad(want_values, scores, upstream)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values) and torch.equal(grad, want_grad)
    # row_topk with the kernel: CPU tensors take torch.topk (the kernel is for CUDA ones)
    for got, want in zip(row_topk(scores.detach(), 8, topk_ids_op), (want_values, want_ids)):
        assert torch.equal(got, want)
    # The op traced whole by torch.compile (its fake shape; no graph break), as in the compiled attention half
    select = torch.compile(lambda s: s.gather(-1, topk_ids_op(s.detach(), 8)), fullgraph=True, backend="aot_eager")
    assert torch.equal(select(scores), want_values)
    assert torch.equal(
        topk_counts(torch.zeros(0, 8, device=device), torch.zeros(0, device=device), 2).cpu(), torch.zeros(8)
    )
    assert topk_ids(torch.zeros(0, 8, device=device), 2).shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        topk_counts(torch.zeros(3, 4, device=device), torch.ones(3, device=device), 5)
    with pytest.raises(ValueError, match="top_k"):
        topk_ids(torch.zeros(3, 40, device=device), 33)


def test_matches_the_lowest_index_topk_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked" in run.stdout


def test_kernels_compile_for_hopper():
    from moeshard.ep.testing import compile_for_hopper
    from moeshard.models.common._topk_triton import _topk_counts_kernel, _topk_ids_kernel

    bf, f32, i64 = (torch.empty(0, dtype=d, device="meta") for d in (torch.bfloat16, torch.float32, torch.int64))
    counts = compile_for_hopper(
        _topk_counts_kernel, bf, f32, f32, 131072, 128, 128, K=8, LANES=64, BLOCK_N=64, BLOCK_E=128, num_warps=4
    )
    ids = compile_for_hopper(_topk_ids_kernel, f32, i64, 16384, 128, 128, K=8, BLOCK_N=64, BLOCK_E=128, num_warps=4)
    assert counts.asm["cubin"] and ids.asm["cubin"]


def test_row_topk_is_torch_topk_off_cuda():
    from moeshard.models.common._topk import row_topk

    scores = torch.randn(6, 16)
    for got, want in zip(row_topk(scores, 4), torch.topk(scores, 4, dim=-1)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_torch_topk_on_cuda():
    check("cuda")
    from moeshard.models.common._topk_triton import topk_counts

    # torch.topk's own ids on CUDA, ties included, at the loss's shape (8 layers of 16k tokens, 128 experts)
    probs = tie_heavy(131072, 128, torch.bfloat16, seed=9, device="cuda")
    weight = torch.ones(131072, device="cuda")
    ids = torch.topk(probs, 8, dim=-1).indices
    assert torch.equal(topk_counts(probs, weight, 8).cpu(), counts_of(ids, weight, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_selection_is_torch_topks_on_cuda():
    """The routers' float32 selection at one layer's shape: the same values, the same set of ids per row; the
    order of equal values is the kernel's (by index). Compiled with fullgraph: the custom op breaks no graph."""
    from moeshard.models.common._topk import row_topk

    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(16384, 128, generator=g) * 0.02).to(torch.bfloat16)  # bf16 logits: ties in the probs
    probs = torch.softmax(logits.cuda(), dim=-1, dtype=torch.float32)
    want_values, want_ids = torch.topk(probs, 8, dim=-1)
    from moeshard.models.common._topk_triton import topk_ids_op

    for fn in (row_topk, torch.compile(row_topk, fullgraph=True)):  # compiled: the op breaks no graph
        values, ids = fn(probs, 8, topk_ids_op)
        assert torch.equal(values, want_values)
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
        assert torch.equal(ids.cpu(), lowest_index_topk(probs.cpu(), 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_loss_is_the_same_through_the_kernel_on_cuda(monkeypatch):
    from moeshard.models.common import _balancing

    g = torch.Generator().manual_seed(3)
    logits = tuple((torch.randn(4096, 128, generator=g) * 0.05).to("cuda", torch.bfloat16) for _ in range(3))
    mask = (torch.arange(4096) % 9 != 0).long().view(2, 2048).cuda()
    for attention_mask in (None, mask):
        through_kernel = _balancing.load_balancing_loss(logits, 128, 8, attention_mask)
        with monkeypatch.context() as m:
            m.setattr(_balancing, "_counts_kernel", lambda: None)
            through_topk = _balancing.load_balancing_loss(logits, 128, 8, attention_mask)
        assert torch.equal(through_kernel, through_topk)


if __name__ == "__main__":  # the interpreter run
    from moeshard.ep.testing import interpreter_numpy_fix

    interpreter_numpy_fix()
    check("cpu")
    print("checked")
