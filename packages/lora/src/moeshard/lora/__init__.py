"""moeshard.lora: LoRA adapters on linear modules and on fused 3-D expert tensors, in PEFT's folder format.

Example (any ``nn.Module`` whose module names are the transformers model's)::

    from moeshard.lora import LoraOptions, apply_lora, save_adapter

    options = LoraOptions(rank=16, alpha=32, target_modules=("q_proj", "o_proj"),
                          target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    adapters = apply_lora(model, options, seed=0)   # the base frozen, float32 adapters beside it
    optimizer = torch.optim.AdamW(adapters.parameters(model), lr=1e-4)
    ...
    save_adapter("out/adapter", adapters, adapters.state_dict(model))   # PeftModel.from_pretrained loads it
"""

from moeshard.lora._apply import (
    ExpertAdapter,
    LoraAdapters,
    LoraTarget,
    apply_lora,
    merged_weights,
    reset_adapters,
)
from moeshard.lora._grouped import expert_lora_delta, resolve_lora_gemm
from moeshard.lora._options import LoraOptions
from moeshard.lora._peft import load_adapter, read_adapter_options, save_adapter

__all__ = [
    "ExpertAdapter",
    "LoraAdapters",
    "LoraOptions",
    "LoraTarget",
    "apply_lora",
    "expert_lora_delta",
    "load_adapter",
    "merged_weights",
    "read_adapter_options",
    "reset_adapters",
    "resolve_lora_gemm",
    "save_adapter",
]
