"""Sharding, exact gradients, clipping and checkpoints on the toy MoE LM (gloo, 4 processes as 2 nodes x 2)."""

import torch

from moeshard.fsdp_moe.testing import ToyMoELM
from moeshard.meshes.testing import run_distributed

STEPS, LR, MAX_NORM, B, S, VOCAB = 3, 1e-2, 0.5, 8, 6, 32


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[torch.rand(B, S, generator=g) < 0.3] = -100  # ranks get different numbers of label tokens
        out.append((ids, labels))
    return out


def _reference():
    torch.manual_seed(0)
    model = ToyMoELM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    steps = []
    for ids, labels in _batches():
        loss = model(ids, labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        steps.append((loss.item(), norm.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return steps


def _train(ep_size):
    import torch.distributed as dist

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import clip_grad_norm_, num_items_for_global_mean, shard_model
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=ep_size)
    torch.manual_seed(0)
    model = ToyMoELM()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    shard_model(model, meshes)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    W, r = meshes.world_size, meshes.rank
    steps = []
    for ids, labels in _batches():
        ids, labels = ids.chunk(W)[r], labels.chunk(W)[r]
        n = num_items_for_global_mean((labels[:, 1:] != -100).sum())
        loss = model(ids, labels, num_items_in_batch=n)
        loss.backward()
        grads = full_tensors(model, grads=True)
        norm = clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        steps.append((logged.item(), norm.item(), _np(grads), _np(full_tensors(model))))
    return steps


def _np(tensors):
    # Tensors cross the result queue by shared memory, which dies with the rank; numpy goes by value.
    return {k: v.numpy() for k, v in tensors.items()}


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_toy_training_matches_single_process():
    ref = _reference()
    for ep in (2,):
        out = run_distributed(_train, 4, ep, ranks_per_node=2)
        for rank_steps in out[:1]:
            for i, ((loss, norm, grads, params), (rl, rn, rg, rp)) in enumerate(zip(rank_steps, ref)):
                _close(torch.tensor(loss), torch.tensor(rl), f"ep{ep} step {i} loss")
                _close(torch.tensor(norm), torch.tensor(rn), f"ep{ep} step {i} norm")
                assert grads.keys() == rg.keys()
                for k in rg:
                    _close(torch.from_numpy(grads[k]), rg[k], f"ep{ep} step {i} grad {k}")
                    _close(torch.from_numpy(params[k]), rp[k], f"ep{ep} step {i} param {k}")
