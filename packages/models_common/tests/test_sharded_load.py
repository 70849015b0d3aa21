"""load_hf_weights into EP-sliced and FSDP2-sharded models: each rank reads exactly its slice.

The ``fake`` backend plans world sizes with no communication (local shards are real tensors, so their contents
can be checked one rank at a time); gloo runs EP for real and compares logits with one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from moeshard.ep import apply_ep
from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import run_distributed
from moeshard.models.common import Experts, load_hf_config, load_hf_weights, local_region
from moeshard.models.common.testing import ToyForCausalLM


def _sharded_model(path, meshes):
    """Meta model → EP → FSDP2 bottom-up (experts on ep_fsdp, dim 1; layers and root on fsdp) → CPU memory."""
    with torch.device("meta"):
        model = ToyForCausalLM(load_hf_config(path, ToyForCausalLM.hf_format))
    info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, Experts):
                fully_shard(module, mesh=meshes.ep_fsdp, shard_placement_fn=lambda p: Shard(1))
        fully_shard(layer, mesh=meshes.fsdp)
    fully_shard(model, mesh=meshes.fsdp)
    model.to_empty(device="cpu")
    return model, info


@pytest.mark.parametrize(
    "world, ep, rank",
    [(4, 2, 0), (4, 2, 3), (8, 4, 6), (32, 8, 27)],
    ids=["w4r0", "w4r3", "w8r6", "w32r27-empty-shards"],
)
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_each_rank_gets_its_slice(toy_dir, world, ep, rank):
    full = dict(ToyForCausalLM.from_pretrained(toy_dir).named_parameters())
    with fake_process_group(world, rank):
        meshes = build_meshes(ep_size=ep, ranks_per_node=world, device_type="cpu")
        model, info = _sharded_model(toy_dir, meshes)
        report = load_hf_weights(model, toy_dir, ep_info=info)
        e_local = 8 // ep
        start = meshes.ep_rank * e_local
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            offset, local = local_region(param)
            expected = full[name]
            if name in info.params:
                assert info.params[name].expert_start == start
                expected = expected[start : start + e_local]
            box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            assert torch.equal(local, expected[box]), name
        read = {int(k.split(".")[5]) for k in report.keys_read if ".mlp.experts." in k}
        assert read == set(range(start, start + e_local))  # no other expert is read
        model.init_weights()  # also works on the sharded model


def _ep_then_ep_fsdp(path, ids, mask):
    """On 4 gloo ranks (EP 2 x ep_fsdp 2): an EP-only model (forward + backward), then an EP + FSDP2 one."""
    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = ToyForCausalLM(load_hf_config(path, ToyForCausalLM.hf_format))
    info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=info)
    out = model(ids, labels=ids, attention_mask=mask)
    out.loss.backward()

    sharded, info = _sharded_model(path, meshes)
    load_hf_weights(sharded, path, ep_info=info)
    with torch.no_grad():
        sharded_logits = sharded(ids, attention_mask=mask).logits
    return out.logits.detach(), out.loss.detach(), model.lm_head.weight.grad, sharded_logits


def test_ep_and_ep_fsdp_on_gloo_match_one_process(toy_dir, batch):
    ids, mask, _ = batch
    ref = ToyForCausalLM.from_pretrained(toy_dir)
    out = ref(ids, labels=ids, attention_mask=mask)
    out.loss.backward()
    keep = mask.bool()
    for logits, loss, head_grad, sharded_logits in run_distributed(_ep_then_ep_fsdp, 4, toy_dir, ids, mask):
        torch.testing.assert_close(logits[keep], out.logits[keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(loss, out.loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(head_grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(sharded_logits[keep], out.logits[keep], rtol=0, atol=1e-5)
