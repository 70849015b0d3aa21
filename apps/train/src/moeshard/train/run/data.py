"""The job's data, built beside the model (the run's checks open it first: its identity guards the output folder):
the training rows as ``moeshard.data.StepBatches`` and the held-out set as ``EvalBatches``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeshard.data import DataConfig, Dataset, EvalBatches, StepBatches, open_dataset

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from moeshard.train.config import JobConfig


def build_data(
    cfg: JobConfig, model_config: PretrainedConfig, world: int
) -> tuple[Dataset, StepBatches, EvalBatches | None]:
    """The dataset, its step batches over ``world`` data-parallel ranks (the world over ``parallel.sp_size``: the
    ranks of a sequence group share rows) and the held-out set (None without ``eval``).

    Raises:
        moeshard.data.DataError: the file, record or key that cannot be used, and the fix.
    """
    tokens = {"vocab_size": model_config.vocab_size, "eos_id": _first(model_config.eos_token_id)}
    tokens["pad_id"] = getattr(model_config, "pad_token_id", None)
    data = open_dataset(cfg.data, **tokens)
    t = cfg.train
    batches = StepBatches(data, global_batch=t.global_batch_size, world_size=world, micro_batch=t.micro_batch_size)
    eval_batches = None
    if cfg.eval.enabled:
        eval_batches = EvalBatches(
            open_dataset(eval_data_config(cfg), **tokens),
            global_batch=t.global_batch_size,
            world_size=world,
            micro_batch=t.micro_batch_size,
            max_batches=cfg.eval.max_batches,
        )
    return data, batches, eval_batches


def eval_data_config(cfg: JobConfig) -> DataConfig:
    """The held-out set's data config: ``eval.path`` (or generated rows with another seed than the training data's)
    read with the training data's ``seq_len``, ``packing`` and ``tokenizer``, in order (no shuffle)."""
    d = cfg.data
    common = {"tokenizer": d.tokenizer, "seq_len": d.seq_len, "packing": d.packing, "shuffle": False}
    if cfg.eval.path is not None:
        return DataConfig(path=cfg.eval.path, **common)
    return DataConfig(synthetic=True, seed=d.seed + 1, synthetic_samples=d.synthetic_samples, **common)


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) else x
