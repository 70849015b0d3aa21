"""The options of LoRA adapters: rank, scaling, what they target, where they start from.

Passed to :func:`moeshard.lora.apply_lora` and to the PEFT folder functions; the names follow PEFT's
``LoraConfig`` (``r`` is ``rank``, ``lora_alpha`` is ``alpha``), and so does the scaling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["LoraOptions"]


@dataclass(frozen=True)
class LoraOptions:
    """LoRA on linear modules (``target_modules``) and fused 3-D expert tensors (``target_parameters``).

    ``rank == 0`` is off (no adapter, nothing frozen). Each field's ``help`` metadata is one line for front ends.
    Invalid values raise ``ValueError`` naming the field as ``LoraOptions.<field>``.
    """

    rank: int = field(default=0, metadata={"help": "adapter rank r (PEFT's `r`); 0 turns LoRA off."})
    alpha: float = field(
        default=16.0,
        metadata={
            "help": "PEFT's `lora_alpha`: the adapter's output is scaled by alpha/r (alpha/sqrt(r) with rslora)."
        },
    )
    use_rslora: bool = field(
        default=False,
        metadata={"help": "rank-stabilised scaling alpha/sqrt(r) instead of alpha/r (PEFT's `use_rslora`)."},
    )
    target_modules: tuple[str, ...] | str = field(
        default=(),
        metadata={
            "help": "linear modules by name, PEFT's rules: a list matches a module whose name equals an entry or ends "
            "with `.entry` (`q_proj`, `o_proj`, `kv_b_proj`, `shared_experts.down_proj`); a string is a regular "
            "expression the whole name must match, or `all-linear`: every linear module but the LM head, as PEFT's."
        },
    )
    target_parameters: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "fused 3-D expert tensors by name, PEFT's rules (`mlp.experts.gate_up_proj`, "
            "`mlp.experts.down_proj`): an entry matches `module.param` names that equal it or end with `.entry`."
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={"help": "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from."},
    )
    dropout: float = field(
        default=0.0,
        metadata={
            "help": "PEFT's `lora_dropout`: dropout on a linear adapter's input while training (the model in train "
            "mode); PEFT takes none on tensors it wraps as parameters (fused experts), so neither does this."
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"LoraOptions.rank={self.rank!r} must be an integer >= 0 (0 turns LoRA off)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraOptions.alpha={self.alpha!r} must be a number > 0 (PEFT's lora_alpha)")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"LoraOptions.use_rslora={self.use_rslora!r} must be true or false")
        if isinstance(self.target_modules, (list, tuple)):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.target_parameters, (list, tuple)):
            object.__setattr__(self, "target_parameters", tuple(self.target_parameters))
        tm = self.target_modules
        if not (isinstance(tm, str) or all(isinstance(t, str) and t for t in tm)):
            raise ValueError(
                f"LoraOptions.target_modules={tm!r} must be a list of module names (or one regular expression)"
            )
        if isinstance(tm, str) and not tm:
            raise ValueError("LoraOptions.target_modules is an empty regular expression; give module names instead")
        tp = self.target_parameters
        if not isinstance(tp, tuple) or not all(isinstance(t, str) and t for t in tp):
            raise ValueError(
                f"LoraOptions.target_parameters={tp!r} must be a list of parameter names like 'mlp.experts.down_proj'"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraOptions.dropout={self.dropout!r} must be a number in [0, 1) (PEFT's lora_dropout)")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"LoraOptions.init_from={self.init_from!r} must be the path of a PEFT adapter folder")
        if self.rank > 0 and not tm and not tp:
            raise ValueError(
                f"LoraOptions.rank={self.rank} but nothing is targeted: set target_modules (e.g. ['q_proj', 'o_proj']) "
                "and/or target_parameters (e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])"
            )

    @property
    def enabled(self) -> bool:
        """True when ``rank > 0``."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The factor of the adapter's output, as PEFT computes it: ``alpha / r``, or ``alpha / sqrt(r)`` with rslora."""
        if self.rank == 0:
            raise ValueError("LoraOptions.scaling: LoRA is off (rank 0)")
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraOptions:
        """Options from a mapping (a YAML section); an unknown key is a ``ValueError`` that names it."""
        known = [f.name for f in fields(cls)]
        for key in values:
            if key not in known:
                raise ValueError(f"lora: unknown option {key!r}; the options are {', '.join(known)}")
        return cls(**dict(values))

    def describe(self) -> str:
        """One line for logs and plans."""
        if not self.enabled:
            return "lora: off"
        tm = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules) or "-"
        scale = f"alpha/sqrt(r) = {self.scaling:g}" if self.use_rslora else f"alpha/r = {self.scaling:g}"
        start = f", from {self.init_from}" if self.init_from else ""
        dropout = f", dropout {self.dropout:g}" if self.dropout else ""
        return (
            f"lora: rank {self.rank}, {scale}{dropout}; modules: {tm}; parameters: "
            f"{', '.join(self.target_parameters) or '-'}{start}"
        )
