"""Pointwise kernels of the model, swappable for ``torch.compile``-fused versions (a GPU speed option).

Each entry is a pure function; :func:`set_compiled_kernels` replaces them with compiled versions of the same
functions (one fused kernel each way instead of several memory passes), and switches the expert path's kernels
in ``moeshard.ep`` too. Eager is the default: nothing compiles unless asked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KERNELS: dict[str, Callable] = {}
_EAGER: dict[str, Callable] = {}
_COMPILED = [False]


def compiled_kernels_enabled() -> bool:
    """Whether :func:`set_compiled_kernels` turned the compiled kernels on."""
    return _COMPILED[0]


def set_compiled_kernels(enabled: bool) -> None:
    """Use ``torch.compile``-fused RMSNorm, RoPE, chunked cross-entropy and expert-path kernels, or eager ones;
    when on, each decoder layer's attention half (norms, projections, RoPE, attention, residual) runs as one
    compiled graph (``layers.attention_block``)."""
    from moeshard.ep import set_compiled_kernels as set_ep_kernels
    from moeshard.ep._dispatch import compile_rows_dynamic

    if not _EAGER:
        _EAGER.update(KERNELS)
    for name, fn in _EAGER.items():
        # The loss chunk's row count varies (the last chunk); the norms and RoPE see one shape per run.
        KERNELS[name] = (compile_rows_dynamic(fn) if name == "ce_chunk" else torch.compile(fn)) if enabled else fn
    set_ep_kernels(enabled)
    _COMPILED[0] = enabled
