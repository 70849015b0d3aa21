"""The expert units' own options of ``shard_model`` on the toy MoE LM, 4 gloo processes as 2 nodes x 2, EP 2 x
ep_fsdp 2 (the cross-node expert FSDP path):

- ``expert_reshard_after_forward=False``: the same loss and gradients as the default (bit for bit), half the
  expert all-gathers (one per micro-batch instead of two);
- ``expert_reduce_dtype=torch.bfloat16``: the expert reduce-scatter runs in bfloat16 (gloo sums bfloat16 as
  bfloat16), the gradients still land in float32 ``.grad``; with bfloat16 compute the expert gradients stay within
  1e-2 of the float32 reduction's (relative to each tensor's largest entry: one bfloat16 rounding of a sum of two)
  and every other gradient is unchanged.
"""

import pytest
import torch

from moeshard.meshes.testing import run_distributed

MICRO = 2  # micro-batches per step: the all-gathers are counted per micro-batch
VARIANTS = {
    "default": {},
    "kept": {"expert_reshard_after_forward": False},
    "bf16_reduce": {"expert_reduce_dtype": torch.bfloat16},
}


def _step(param_dtype, options):
    """One rank: the toy model sharded with ``options``, two micro-batches forward and backward; the loss, every
    full gradient, the ep_fsdp collectives seen (kind, dtype) and the expert gradients' dtypes."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import num_items_for_global_mean, shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM, full_tensors
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=2)
    torch.manual_seed(0)
    model = ToyMoELM()
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units = shard_model(model, meshes, ep_info=ep_info, mp_policy=policy, **options)
    assert len(units.experts) == 2 and not units.local_experts  # expert units on ep_fsdp 2

    ep_fsdp = dist.get_process_group_ranks(meshes.ep_fsdp.get_group())
    seen: list[tuple[str, torch.dtype]] = []

    def spy(kind, fn):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            if a.get("group") is not None and dist.get_process_group_ranks(a["group"]) == ep_fsdp:
                seen.append((kind, a.get("input_tensor", a.get("input")).dtype))
            return fn(*args, **kwargs)

        return counted

    # FSDP2 looks them up on torch.distributed at each call (torch 2.13: *_single; *_into_tensor / *_tensor before).
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor")}
    names["reduce_scatter"] = ("reduce_scatter_single", "reduce_scatter_tensor")
    originals = {n: getattr(dist, n) for ns in names.values() for n in ns if hasattr(dist, n)}
    for kind, ns in names.items():
        for n in ns:
            if n in originals:
                setattr(dist, n, spy(kind, originals[n]))
    try:
        ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1)).chunk(meshes.world_size)
        ids = ids[meshes.rank]
        n = num_items_for_global_mean(ids[:, 1:].numel())
        losses = []
        for mids in ids.chunk(MICRO):
            loss = model(mids, mids, num_items_in_batch=n)
            loss.backward()
            losses.append(loss.detach().float())
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    grad_dtypes = {p.grad.dtype for _, m in units.experts for p in m.parameters()}
    return torch.stack(losses), full_tensors(model, grads=True), seen, grad_dtypes


def _variants():
    return {dtype: {name: _step(dtype, opts) for name, opts in VARIANTS.items()} for dtype in (None, torch.bfloat16)}


@pytest.fixture(scope="module")
def runs():
    """Rank 0's results (every rank checks the same full tensors), float32 (None) and bfloat16 compute."""
    return run_distributed(_variants, 4, ranks_per_node=2)[0]


def _expert(name: str) -> bool:
    return ".experts." in name


def test_experts_kept_gathered_from_forward_to_backward(runs):
    for dtype in (None, torch.bfloat16):
        losses, grads, seen, _ = runs[dtype]["default"]
        kept_losses, kept_grads, kept_seen, _ = runs[dtype]["kept"]
        assert torch.equal(kept_losses, losses)
        assert kept_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert torch.equal(kept_grads[name], grad), name
        gathers = sum(kind == "all_gather" for kind, _ in seen)
        assert gathers == 2 * 2 * MICRO  # 2 layers' expert units, forward and backward, each micro-batch
        assert sum(kind == "all_gather" for kind, _ in kept_seen) == gathers // 2
        reductions = [k for k in seen if k[0] == "reduce_scatter"]
        assert [k for k in kept_seen if k[0] == "reduce_scatter"] == reductions


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32_compute", "bf16_compute"])
def test_bf16_expert_reduction(runs, param_dtype):
    _, grads, seen, grad_dtypes = runs[param_dtype]["default"]
    _, bf16_grads, bf16_seen, bf16_grad_dtypes = runs[param_dtype]["bf16_reduce"]
    # The reduce-scatter over ep_fsdp (the experts' only one) runs in bfloat16; the sharded gradient is float32.
    assert {dtype for kind, dtype in seen if kind == "reduce_scatter"} == {torch.float32}
    assert {dtype for kind, dtype in bf16_seen if kind == "reduce_scatter"} == {torch.bfloat16}
    assert sum(kind == "reduce_scatter" for kind, _ in bf16_seen) == 2 * MICRO
    assert grad_dtypes == bf16_grad_dtypes == {torch.float32}
    worst = 0.0
    for name, grad in grads.items():
        if not _expert(name):
            assert torch.equal(bf16_grads[name], grad), name  # reduced as before
            continue
        rel = float((bf16_grads[name] - grad).abs().max() / grad.abs().max())
        worst = max(worst, rel)
        assert 0 < rel < 1e-2, (name, rel)  # one bfloat16 rounding (2^-8 relative) of a sum, then exact / W
    print(f"param dtype {param_dtype}: expert gradients, bf16 against fp32 reduction: max rel error {worst:.2e}")
