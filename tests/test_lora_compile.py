"""LoRA under ``parallelize(compile=True)`` equals LoRA eager: the linear adapters' hooks run inside each layer's
compiled attention half (and its recompute under activation checkpointing), the expert adapters in the grouped expert
pass. The tiny Qwen3-MoE on 2 gloo ranks (EP 2), adapters on every linear but the head (``all-linear``: q/k/v/o)
and on both fused expert tensors with non-zero ``B`` (so every adapter tensor gets a gradient), the same batches in
each variant; float32 on CPU."""

import pytest
import torch
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.lora import LoraOptions
from moeshard.meshes.testing import run_distributed
from moeshard.models.qwen3moe import get_preset_config

OPTIONS = LoraOptions(
    rank=4, alpha=8, target_modules="all-linear",
    target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    torch.manual_seed(1234)
    config = get_preset_config("tiny")  # 4 layers of 8 experts, vocabulary 512
    config.num_hidden_layers = 2
    HFQwen3MoeForCausalLM(config).save_pretrained(path)
    return str(path)


VARIANTS = {
    "eager": dict(prefetch_depth=0),
    "checkpointing": dict(prefetch_depth=0, activation_checkpointing=True),
    "compiled": dict(prefetch_depth=0, compile=True),
    "compiled+checkpointing": dict(prefetch_depth=0, compile=True, activation_checkpointing=True),
}


def _variants(path, ids_SBS, lora=OPTIONS, names=("eager", "compiled+checkpointing")):
    """One rank of 2: two steps' losses and the adapters' gradients in each variant of ``names`` (compiled +
    checkpointed: the compiled attention half with the adapters' hooks inside, recomputed in backward); each step's
    forward from one seed (LoRA's dropout draws the same masks where the variants draw alike)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from moeshard.lora import apply_lora, reset_adapters
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, load_hf_weights, parallelize
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config

    rank = dist.get_rank()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    out = {}
    for name in names:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(load_hf_config(path))
        adapters = apply_lora(model, lora, seed=0)
        parallel = parallelize(model, meshes, ParallelOptions(**VARIANTS[name]))
        model.to_empty(device="cpu")
        load_hf_weights(model, path, ep_info=parallel.ep_info)
        reset_adapters(model, adapters, 0, ep_rank=parallel.ep_info.ep_rank)
        g = torch.Generator().manual_seed(7 + rank)  # the same B in every variant (this rank's shard of it)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.copy_(torch.randn(local.shape, generator=g) * 0.1)
        losses = []
        for step, ids in enumerate(ids_SBS[rank]):
            model.zero_grad()
            torch.manual_seed(100 + step)
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()
            if p.requires_grad
        }
        assert grads and all("lora_" in n for n in grads), sorted(grads)
        torch.manual_seed(999)
        with torch.no_grad():  # no optimizer step ran: the first step's parameters, other dropout masks if any
            reseeded = model(ids_SBS[rank][0], labels=ids_SBS[rank][0]).loss.item()
        out[name] = (losses, grads, counters["stats"]["unique_graphs"], reseeded)
    return out


def test_lora_compiled_equals_eager(hf_dir):
    ids_RSBS = torch.randint(1, 512, (2, 2, 2, 12), generator=torch.Generator().manual_seed(4))
    for out in run_distributed(_variants, 2, hf_dir, ids_RSBS, timeout=600):
        eager_losses, eager_grads, _, reseeded = out["eager"]
        assert reseeded == pytest.approx(eager_losses[0].item(), rel=1e-6)  # no dropout: no draw changes the loss
        assert out["compiled+checkpointing"][2] > 0  # something compiled
        assert all(g.abs().sum() > 0 for g in eager_grads.values())  # every adapter tensor has a gradient
        for variant in ("compiled+checkpointing",):
            losses, grads, *_ = out[variant]
            torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-5)
            assert grads.keys() == eager_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=f"{variant} {name}": f"{n}: {m}"
                )


def test_lora_dropout_draws_the_same_masks_when_checkpointing_recomputes(hf_dir):
    """LoRA's dropout under activation checkpointing: the recompute in backward draws the masks forward drew (the
    checkpoint restores the RNG), so the checkpointed run trains as the plain one, eager and compiled."""
    dropout = LoraOptions(rank=4, alpha=8, target_modules="all-linear", dropout=0.3)
    ids_RSBS = torch.randint(1, 512, (2, 2, 2, 12), generator=torch.Generator().manual_seed(4))
    names = ("eager", "checkpointing", "compiled", "compiled+checkpointing")
    for out in run_distributed(_variants, 2, hf_dir, ids_RSBS, dropout, names, timeout=600):
        for plain, checkpointed in (("eager", "checkpointing"), ("compiled", "compiled+checkpointing")):
            (l0, g0, *_), (l1, g1, *_) = out[plain], out[checkpointed]
            torch.testing.assert_close(torch.stack(l1), torch.stack(l0), rtol=1e-5, atol=1e-5)
            for name, grad in g1.items():
                torch.testing.assert_close(grad, g0[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # the masks matter: the first step's batch from another seed gives another loss (the parameters are the same)
        assert abs(out["eager"][3] - out["eager"][0][0]) > 1e-4
