"""The load-balancing loss's counts kernel (``topk_counts``) against ``torch.topk``'s ids counted: interpreted on CPU
(a child process with ``TRITON_INTERPRET=1``) against a top-k whose ties go to the lower index, compiled for sm_90
without a GPU, and on CUDA against ``torch.topk`` itself and inside ``load_balancing_loss``."""

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
    from moeshard.models.common._topk_counts_triton import topk_counts

    for i, (n, e, k, dtype) in enumerate(CASES):
        probs = tie_heavy(n, e, dtype, seed=i, device=device)
        weight = (torch.arange(n) % 7 != 3).float().to(device)  # a padding mask's zeros
        got = topk_counts(probs, weight, k)
        want = counts_of(lowest_index_topk(probs.cpu(), k), weight.cpu(), e)
        assert torch.equal(got.cpu(), want), (i, (got.cpu() - want).abs().max())
        strided = torch.cat([probs, probs[:, :3]], dim=1)[:, :e]  # rows with a stride of their own
        assert torch.equal(topk_counts(strided, weight, k).cpu(), want)
    assert torch.equal(
        topk_counts(torch.zeros(0, 8, device=device), torch.zeros(0, device=device), 2).cpu(), torch.zeros(8)
    )
    with pytest.raises(ValueError, match="top_k"):
        topk_counts(torch.zeros(3, 4, device=device), torch.ones(3, device=device), 5)


def test_matches_the_lowest_index_topk_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked" in run.stdout


def test_kernel_compiles_for_hopper():
    from moeshard.ep.testing import compile_for_hopper
    from moeshard.models.common._topk_counts_triton import _topk_counts_kernel

    bf, f32 = (torch.empty(0, dtype=d, device="meta") for d in (torch.bfloat16, torch.float32))
    k = compile_for_hopper(
        _topk_counts_kernel, bf, f32, f32, 131072, 128, 128, K=8, LANES=64, BLOCK_N=64, BLOCK_E=128, num_warps=4
    )
    assert k.asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_torch_topk_on_cuda():
    check("cuda")
    from moeshard.models.common._topk_counts_triton import topk_counts

    # torch.topk's own ids on CUDA, ties included, at the loss's shape (8 layers of 16k tokens, 128 experts)
    probs = tie_heavy(131072, 128, torch.bfloat16, seed=9, device="cuda")
    weight = torch.ones(131072, device="cuda")
    ids = torch.topk(probs, 8, dim=-1).indices
    assert torch.equal(topk_counts(probs, weight, 8).cpu(), counts_of(ids, weight, 128))


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
