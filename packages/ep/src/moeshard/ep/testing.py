"""Test helpers: a plain reference for the routed experts and a toy MoE model with a parallel plan.

# T tokens, K top-k, D hidden, E experts, F expert width

The reference shares no code with the dispatchers (:class:`moeshard.ep.ExpertDispatch`): it loops over tokens
and their K choices in plain torch, with all experts in one process. The toy model's experts route through
``self.dispatch`` (a :class:`moeshard.ep.LocalDispatch` until ``apply_ep`` installs the EP one).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from moeshard.ep._dispatch import LocalDispatch
from moeshard.ep._plan import ParallelPlan
from moeshard.ep._torch_internals import TorchDispatchMode

__all__ = [
    "ToyExperts",
    "ToyMoE",
    "compile_for_hopper",
    "count_host_syncs",
    "interpreter_numpy_fix",
    "reference_routed_experts",
    "toy_plan",
]


def reference_routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_up_EXD: torch.Tensor,
    w_down_EDF: torch.Tensor,
) -> torch.Tensor:
    """``y_t = Σ_k w_tk · down_e(silu(gate_e x_t) * up_e x_t)`` token by token, all experts local (slow)."""
    T, D = x_TD.shape
    F_ = w_down_EDF.shape[2]
    rows = []
    for t in range(T):
        acc_D = torch.zeros(D, dtype=torch.float32, device=x_TD.device)
        for k in range(topk_ids_TK.shape[1]):
            e = int(topk_ids_TK[t, k])
            h_X = w_gate_up_EXD[e] @ x_TD[t]
            a_F = F.silu(h_X[:F_]) * h_X[F_:]
            acc_D = acc_D + topk_weights_TK[t, k].float() * (w_down_EDF[e] @ a_F).float()
        rows.append(acc_D)
    y_TD = torch.stack(rows) if rows else torch.zeros(0, D, dtype=torch.float32, device=x_TD.device)
    return y_TD.to(x_TD.dtype)


class ToyExperts(nn.Module):
    """Fused experts in the transformers 5.x layout: ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * width, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, width) / width**0.5)
        self.dispatch = LocalDispatch(num_experts)  # apply_ep replaces it

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """The routed experts' output ``y_TD``."""
        return self.dispatch(x_TD, topk_ids_TK, topk_weights_TK, self.gate_up_proj, self.down_proj)


class _ToyMLP(nn.Module):
    def __init__(self, num_experts: int, hidden: int, width: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ToyExperts(num_experts, hidden, width)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        weights_TK, ids_TK = torch.softmax(self.gate(x_TD), dim=-1).topk(self.top_k, dim=-1)
        return self.experts(x_TD, ids_TK, weights_TK)


class _ToyLayer(nn.Module):
    def __init__(self, num_experts: int, hidden: int, width: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = _ToyMLP(num_experts, hidden, width, top_k)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD + self.mlp(self.norm(x_TD))


class ToyMoE(nn.Module):
    """``layers.{i}.mlp.experts.{gate_up_proj, down_proj}`` plus a router and a norm per layer.

    ``forward(x_TD)``: each layer adds its routed experts' output (softmax router, top ``top_k``) to ``x_TD``.
    """

    def __init__(self, num_layers: int = 2, num_experts: int = 8, hidden: int = 16, width: int = 8, top_k: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(_ToyLayer(num_experts, hidden, width, top_k) for _ in range(num_layers))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``x_TD`` after every layer."""
        for layer in self.layers:
            x_TD = layer(x_TD)
        return x_TD


def toy_plan() -> ParallelPlan:
    """The plan of :class:`ToyMoE`."""
    return ParallelPlan(
        ep_plan={"layers.*.mlp.experts.gate_up_proj": Shard(0), "layers.*.mlp.experts.down_proj": Shard(0)},
        fsdp_units=("layers.*",),
    )


# aten ops that read a device value on the host, or whose output shape depends on the data (so CUDA must sync).
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique2", "equal", "is_nonzero"}


class _SyncOpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__  # "nonzero" of aten::nonzero.default
        if name in _SYNC_OPS:
            self.counts[name] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.counts["repeat_interleave without output_size"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Count what would make a device→host sync on CUDA, while running on any device.

    Counts ``Tensor.tolist()`` calls (patched for the duration) and the aten ops that read a value on the host
    (``.item()``, ``bool()``, ``int()`` all reach ``_local_scalar_dense``) or have data-dependent output shapes
    (``nonzero``, ``masked_select``, ``bincount``, ``unique``, ``repeat_interleave`` without ``output_size``).
    Yields a ``Counter``; ``sum(counter.values())`` is the number of syncs. Not thread-safe.
    """
    counts: Counter = Counter()
    original = torch.Tensor.tolist

    def tolist(self):
        counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with _SyncOpCounter(counts):
            yield counts
    finally:
        torch.Tensor.tolist = original


def interpreter_numpy_fix() -> None:
    """Let triton 3.6's interpreter (``TRITON_INTERPRET=1``) take a runtime loop bound with numpy >= 2.4.

    The interpreter turns a one-element array into a loop bound with ``int()``, which numpy 2.4 refuses for arrays
    of one dimension; this patches the interpreter's tensor ``__index__`` to take the element. Call it once in the
    process that runs the kernels interpreted, before the first launch."""
    import triton.runtime.interpreter as ti

    patch = ti._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched


_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.bool: "i1",
}


def compile_for_hopper(fn, *args, num_warps: int = 4, **constexprs):
    """Compile the triton kernel ``fn`` for an H100/H200 (sm_90) on a machine without a GPU, with the PTX assembler
    the triton wheel brings: what triton's interpreter does not check (types, layouts, lowering, assembly).

    ``args``: one example per runtime argument, in order: a tensor (any device, ``meta`` too) stands for a pointer
    to its dtype, an int for an int32 (an int64 beyond 32 bits), a float for a float32, and a string is triton's type itself (e.g. a host
    tensor descriptor's, ``"tensordesc<bf16[1,128,128]>"``); ``constexprs`` by name. Returns the compiled
    kernel (``.asm["ptx"]``, ``.asm["cubin"]``). Raises what triton's compiler raises.

    Specialised as a launch specialises it: pointers aligned to 16 bytes (as torch allocates) and ints that are
    multiples of 16 are marked so, which is what lets the compiler vectorise the loads and stores."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    names = [n for n in params if n not in constexprs]
    if len(names) != len(args):
        raise ValueError(f"{fn.fn.__name__} takes {len(names)} runtime arguments {names}, got {len(args)}")
    examples = dict(zip(names, args))
    signature, attrs = {}, {}
    for i, name in enumerate(params):  # in the kernel's order
        a = examples.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[a.dtype]
        elif isinstance(a, str):
            signature[name] = a
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"{name}: a tensor, an int, a float or a type stands for a runtime argument, got {a!r}")
        else:
            # as a launch types it: an int that fits 32 bits is an int32
            signature[name] = ("i32" if -(2**31) <= a < 2**31 else "i64") if isinstance(a, int) else "fp32"
        if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
