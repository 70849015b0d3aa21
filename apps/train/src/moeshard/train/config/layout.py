"""The job's config against a world layout (nodes x ranks per node), with no process group.

:func:`check_layout` refuses everything training refuses before its first step for the config's or the layout's
sake: an EP size that does not divide the world, the ranks of a node or the experts; a global batch that does not
split into the data-parallel ranks and micro-batches; a model config that cannot be resolved or does not hold the
sequence. Training (``run.prepare``), ``plan`` and ``launch-local`` all call it, so the three refuse the same
things in the same words, and ``launch-local`` does before it starts a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeshard.data import DataError, check_batch_sizes
from moeshard.meshes import plan_layout
from moeshard.train.config.load import layout_error_for_config, resolve_model_config
from moeshard.train.config.parse import ConfigError
from moeshard.train.families import routed_experts

__all__ = ["CheckedLayout", "check_layout", "check_model_fits"]


@dataclass(frozen=True)
class CheckedLayout:
    """What :func:`check_layout` found: the mesh layout (``moeshard.meshes.MeshLayout``), the resolved model config
    and the micro-batches of a step on each rank."""

    mesh: Any
    model_config: Any
    micro_batches: int


def check_layout(cfg: Any, *, world_size: int, ranks_per_node: int) -> CheckedLayout:
    """Check ``cfg`` (a ``JobConfig``) for a job of ``world_size`` ranks, ``ranks_per_node`` on each node.

    Raises:
        ConfigError: one message naming the key to change and how.
    """
    p, t = cfg.parallel, cfg.train
    try:
        mesh = plan_layout(
            world_size, ranks_per_node, p.ep_size, allow_cross_node_ep=p.allow_cross_node_ep, sp_size=p.sp_size
        )
    except ValueError as e:  # the package speaks of its argument; the user sets a config key
        text = layout_error_for_config(e)
        key = "sp_size" if text.startswith("sp_size") else "ep_size" if "ep_size" in text else None
        raise ConfigError(f"parallel.{key}: {text}" if key else text) from None
    dp = mesh.dp_size  # the ranks of a sequence group share rows
    rows = dp * t.micro_batch_size
    if t.global_batch_size < rows:  # every data-parallel rank needs a micro-batch of rows each step
        raise ConfigError(
            f"train.global_batch_size {t.global_batch_size} is smaller than the {dp} data-parallel ranks x "
            f"train.micro_batch_size {t.micro_batch_size}; use at least {rows} (a multiple of {rows}), or a smaller "
            "train.micro_batch_size"
        )
    try:
        micro_batches = check_batch_sizes(t.global_batch_size, dp, t.micro_batch_size)
    except DataError as e:
        raise ConfigError(str(e)) from None
    try:
        model_config = resolve_model_config(cfg)
    except (ValueError, OSError) as e:  # an unknown preset or override, a model.path without a config
        raise ConfigError(str(e).splitlines()[0]) from None
    check_model_fits(cfg, model_config)
    return CheckedLayout(mesh, model_config, micro_batches)


def check_model_fits(cfg: Any, model_config: Any) -> None:
    """Raises ConfigError (naming the key to change) when the data or the EP size do not fit the model."""
    if cfg.data.seq_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}; lower data.seq_len"
        )
    sp = cfg.parallel.sp_size
    if sp > 1:
        from moeshard.sequence import check_sequence_parallel

        try:
            check_sequence_parallel(sp, seq_len=cfg.data.seq_len, num_heads=model_config.num_attention_heads)
        except ValueError as e:  # the package names its arguments; the user sets config keys
            text = str(e).replace("seq_len=", "data.seq_len=").replace("sp_size=", "parallel.sp_size=")
            raise ConfigError(text.replace("set seq_len", "set data.seq_len")) from None
    experts = routed_experts(model_config)
    if experts % cfg.parallel.ep_size:
        raise ConfigError(
            f"parallel.ep_size {cfg.parallel.ep_size} does not divide the model's {experts} experts; choose an "
            "ep_size that divides the number of experts"
        )
