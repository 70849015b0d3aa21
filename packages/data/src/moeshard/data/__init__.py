"""moeshard.data: training rows for MoE pretraining and SFT, deterministic by (step, rank).

Example::

    from moeshard.data import DataConfig, PrefetchLoader, StepBatches, open_dataset, prepare

    prepare("corpus/*.jsonl.gz", "prepared/", tokenizer="qwen3-tokenizer/")    # once, all cores, resumable
    cfg = DataConfig(path="prepared/", seq_len=4096, shuffle=True)
    data = open_dataset(cfg, vocab_size=151936)                                 # reads headers only
    batches = StepBatches(data, global_batch=256, world_size=16, micro_batch=2)
    with PrefetchLoader(batches, rank=0, start_step=0, stop_step=1000) as loader:
        for step, micro_batches in loader:
            for b in micro_batches:
                model(b.input_ids, labels=b.labels, position_ids=b.position_ids, document_ids=b.document_ids)
"""

from moeshard.data._cli import prepare_command
from moeshard.data._config import DataConfig, SourceConfig
from moeshard.data._dataset import Dataset, StepBatches, check_batch_sizes, open_dataset
from moeshard.data._errors import DataError, ExitStatus, print_error
from moeshard.data._eval import EvalBatches
from moeshard.data._loader import PrefetchLoader
from moeshard.data._packing import Batch
from moeshard.data._prepare import PrepareResult, prepare

__all__ = [
    "Batch",
    "DataConfig",
    "DataError",
    "Dataset",
    "EvalBatches",
    "ExitStatus",
    "PrefetchLoader",
    "PrepareResult",
    "SourceConfig",
    "StepBatches",
    "check_batch_sizes",
    "open_dataset",
    "prepare",
    "prepare_command",
    "print_error",
]
