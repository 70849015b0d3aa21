"""How a rank scales its loss so that FSDP's averaging over the world yields the global-batch mean exactly.

FSDP divides every gradient by the world size W (see ``shard_model``), i.e. it averages the ranks' losses. When
ranks have different numbers of label tokens, the mean of per-rank means is not the global mean; a rank whose
loss is ``W * sum_r / N_global`` (``sum_r`` its summed token losses, ``N_global`` all label tokens of the step)
makes the average exact: ``(1/W) * sum_r W * sum_r / N_global = sum / N_global``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["num_items_for_global_mean"]


def num_items_for_global_mean(
    local_num_items: int | torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The divisor ``N_global / W`` to pass as the model's ``num_items_in_batch`` on every rank.

    With it the rank's loss is ``sum_r / (N_global / W) = W * sum_r / N_global`` and the gradients FSDP averages
    over the W ranks are those of the global-batch mean. Without a process group it returns ``local_num_items``.

    Args:
        local_num_items: this rank's label tokens in the step (all micro-batches of gradient accumulation).
        group: the process group spanning the world; defaults to the default group.

    Returns:
        A float32 scalar tensor (on the GPU with NCCL, else on the CPU).
    """
    if not dist.is_initialized():
        return torch.as_tensor(local_num_items, dtype=torch.float32).detach().clone()
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(local_num_items, torch.Tensor):
        count = local_num_items.detach().to(device=device, dtype=torch.float32, copy=True)
    else:  # a host int: a fill kernel, not a host→device copy (which would synchronise)
        count = torch.full((), float(local_num_items), dtype=torch.float32, device=device)
    dist.all_reduce(count, group=group)
    return count / dist.get_world_size(group)
