"""FSDP2's reduce-scatter on a one-rank mesh without its copy: :func:`reduce_in_place_on_one_rank`.

On a mesh of one rank there is nothing to reduce, yet FSDP2's ``foreach_reduce`` allocates an output buffer as
large as its input and copies the input into it (``reduce_output.copy_(reduce_scatter_input)``), every unit and
every reducing backward: for the 30B-A3B geometry's embedding and head, 1.24 GB of float32 each per copy, on the
reduce-scatter stream beside the backward's kernels. Both buffers come from the unit's
reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``): :class:`OneRankReduceScatter` answers the output's
request with the input buffer it handed out just before, so the copy is of a tensor into itself, which
``Tensor.copy_`` skips, and the sharded gradient is a view of the input buffer (one buffer held, not two). The
values are the same bits: the copy was exact.

This leans on the order of ``foreach_reduce`` (input, then output, both through the comm, and the one-rank copy),
a private function of torch. :func:`reduce_in_place_on_one_rank` reads that order in the installed torch's source
first and changes nothing where it does not find it (FSDP2's own copy then runs, as before).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moeshard.fsdp_moe._reduced_grad import _param_groups

__all__ = ["OneRankReduceScatter", "reduce_in_place_on_one_rank"]

try:  # torch's comm interface (private module, public through FSDPModule.set_custom_reduce_scatter)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - a torch without custom comms: nothing is installed
    _ReduceScatterBase = object


class OneRankReduceScatter(_ReduceScatterBase):
    """A reduce-scatter comm for a one-rank FSDP2 unit whose output buffer is its input buffer.

    ``allocate`` hands out a new buffer, remembers it, and answers the next request of the same size, dtype and
    device (the output's) with that buffer; on CUDA only where that request comes on another stream than the first
    (the output's is made on the reduce-scatter stream, the input's on the compute stream), and the buffer is then
    recorded on that stream, where FSDP2 reads its output after it has let go of its input. ``reused`` counts the
    buffers handed out twice. A call as a collective (a group of more than one rank, which
    :func:`reduce_in_place_on_one_rank` never gives it) reduce-scatters as FSDP2's default comm does."""

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.cuda.Stream | None] | None = None
        self.reused = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer of one request (module docstring)."""
        pending, self._pending = self._pending, None
        stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
        if pending is not None:
            buffer, first_stream = pending
            same = (
                tuple(buffer.shape) == tuple(size) and buffer.dtype == dtype and buffer.device == torch.device(device)
            )
            if same and (stream is None or stream != first_stream):
                if stream is not None:
                    buffer.record_stream(stream)
                self.reused += 1
                return buffer
        buffer = torch.empty(*size, dtype=dtype, device=device)
        self._pending = (buffer, stream)
        return buffer

    def __call__(  # noqa: D102
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


# In foreach_reduce: the input's buffer from the comm, then (before any other request) the output's, and the copy
# of the one-rank case.
_INPUT = re.compile(r"reduce_scatter_input\s*=\s*reduce_scatter_comm\.allocate\(")
_OUTPUT = re.compile(r"reduce_output\s*=\s*reduce_scatter_comm\.allocate\(")
_COPY = "reduce_output.copy_(reduce_scatter_input)"


@functools.cache
def _order_holds() -> bool:
    """Whether the installed torch's ``foreach_reduce`` asks its comm for the input's buffer and then the output's
    (and no other buffer between them), and copies the one into the other on one rank."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        source = inspect.getsource(_fsdp_collectives.foreach_reduce)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    inputs, outputs = list(_INPUT.finditer(source)), list(_OUTPUT.finditer(source))
    if len(inputs) != 1 or len(outputs) != 1 or _COPY not in source:
        return False
    between = source[inputs[0].end() : outputs[0].start()]
    return between.count(".allocate(") == 0 and source.count("reduce_scatter_comm.allocate(") == 2


def reduce_in_place_on_one_rank(module: FSDPModule) -> bool:
    """Give ``module`` (an FSDP2 unit) an :class:`OneRankReduceScatter` where its mesh has one rank; returns whether
    it did.

    Changes nothing (returns False) where the mesh has more ranks, where the unit has more than one parameter group
    (several meshes), where it already has a custom reduce-scatter comm, or where the installed torch reduces in
    another order than the one this relies on (module docstring)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDP unit: fully_shard it first")
    groups = _param_groups(module)
    if len(groups) != 1 or not hasattr(module, "set_custom_reduce_scatter") or not _order_holds():
        return False
    group = groups[0]
    mesh_info = getattr(group, "mesh_info", None)
    if mesh_info is None or getattr(mesh_info, "shard_mesh_size", None) != 1:
        return False
    if type(getattr(group, "_reduce_scatter_comm", None)).__name__ != "DefaultReduceScatter":
        return False
    module.set_custom_reduce_scatter(OneRankReduceScatter())
    return True
