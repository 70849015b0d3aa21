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


def _variants(path, ids_SBS):
    """One rank of 2: two steps' losses and the adapters' gradients, eager and compiled + checkpointed (the
    compiled attention half with the adapters' hooks inside, recomputed in backward)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from moeshard.lora import apply_lora, reset_adapters
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, load_hf_weights, parallelize
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config

    rank = dist.get_rank()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    out = {}
    for name, options in (
        ("eager", ParallelOptions(prefetch_depth=0)),
        ("compiled+checkpointing", ParallelOptions(prefetch_depth=0, compile=True, activation_checkpointing=True)),
    ):
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(load_hf_config(path))
        adapters = apply_lora(model, OPTIONS, seed=0)
        parallel = parallelize(model, meshes, options)
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
        for ids in ids_SBS[rank]:
            model.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()
            if p.requires_grad
        }
        assert grads and all("lora_" in n for n in grads), sorted(grads)
        out[name] = (losses, grads, counters["stats"]["unique_graphs"])
    return out


def test_lora_compiled_equals_eager(hf_dir):
    ids_RSBS = torch.randint(1, 512, (2, 2, 2, 12), generator=torch.Generator().manual_seed(4))
    for out in run_distributed(_variants, 2, hf_dir, ids_RSBS, timeout=600):
        eager_losses, eager_grads, _ = out["eager"]
        assert out["compiled+checkpointing"][2] > 0  # something compiled
        assert all(g.abs().sum() > 0 for g in eager_grads.values())  # every adapter tensor has a gradient
        for variant in ("compiled+checkpointing",):
            losses, grads, _ = out[variant]
            torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-5)
            assert grads.keys() == eager_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=f"{variant} {name}": f"{n}: {m}"
                )
