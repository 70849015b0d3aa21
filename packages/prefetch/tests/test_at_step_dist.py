"""prefetch_next_forward_at_step on 2 gloo processes (the toy MoE, FSDP over both ranks): the first stages are
gathered at the end of each optimizer step, training is unchanged bit for bit, and a parameter changed between
the step and the next forward is gathered afresh (the stale prefetch dropped)."""

import torch
import torch.distributed as dist

from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed
from moeshard.prefetch import apply_schedule, build_schedule, prefetch_next_forward_at_step
from moeshard.prefetch.testing import ToyMoE, shard_toy

STEPS = 3


def _run(at_step: bool, edit: bool):
    meshes = build_meshes(ep_size=1, device_type="cpu")
    torch.manual_seed(0)
    model = ToyMoE(num_layers=3, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
    stages = shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)
    schedule = build_schedule(stages, depth=1)
    apply_schedule(schedule)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = prefetch_next_forward_at_step(schedule, optim) if at_step else None
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses, gathered_after_step = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, 32, (2, 8), generator=gen)
        loss = model(tokens, torch.roll(tokens, -1, dims=1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        # the prefetched units hold their gathered parameters until their forward
        gathered_after_step.append(len(hooks.pending) if hooks is not None else 0)
        if edit and step == 1:
            with torch.no_grad():
                model.embed.weight.mul_(0.5)  # after the prefetch: the next forward must see it
        losses.append(loss.item())
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    counts = (hooks.issued, hooks.dropped) if hooks is not None else (0, 0)
    return losses, params, gathered_after_step, counts


def _body():
    return {(at_step, edit): _run(at_step, edit) for at_step in (False, True) for edit in (False, True)}


def test_step_end_prefetch_changes_nothing_and_drops_stale_copies():
    for out in run_distributed(_body, 2):
        for edit in (False, True):
            ref_losses, ref_params, _, _ = out[False, edit]
            losses, params, gathered, (issued, dropped) = out[True, edit]
            assert losses == ref_losses, (edit, losses, ref_losses)
            for name, p in ref_params.items():
                assert torch.equal(params[name], p), (edit, name)
            # the embedding, layer 0 and layer 0's expert unit, gathered after each step, consumed by the forward
            assert gathered == [3] * STEPS and issued == 3 * STEPS
            assert dropped == (1 if edit else 0)
        assert out[False, True][0][2] != out[False, False][0][2]  # the edit did change the training
