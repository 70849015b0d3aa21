"""The job's configuration: one frozen dataclass per section (:mod:`.sections`; ``parallel:`` is the packages'
``ParallelOptions`` plus the mesh keys, :mod:`.parallel`), loaded from YAML plus ``--section.key=value``
(:mod:`.load`, :mod:`.parse`).

Unknown keys and wrong types are errors that name the key. The defaults *are* the embedded default job
(a tiny Qwen3-MoE on CPU, 4 processes as 2 nodes x 2, EP 2); ``apps/train/configs/default.yaml`` spells them out.
"""

from moeshard.train.config.layout import CheckedLayout, check_layout
from moeshard.train.config.load import (
    config_from_dict,
    gradient_sync,
    layout_error_for_config,
    load_config,
    resolve_model_config,
    validate,
)
from moeshard.train.config.parallel import ParallelConfig, parallel_options
from moeshard.train.config.parse import ConfigError
from moeshard.train.config.sections import (
    GROUP_OFF,
    TABLE_BEGIN,
    TABLE_END,
    AuxLossConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    JobConfig,
    LoggingConfig,
    MlflowConfig,
    ModelConfig,
    ProfileConfig,
    RouterBiasConfig,
    TrainConfig,
    WandbConfig,
    config_table,
    describe_keys,
)

__all__ = [
    "GROUP_OFF",
    "TABLE_BEGIN",
    "TABLE_END",
    "AuxLossConfig",
    "CheckedLayout",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "JobConfig",
    "LoggingConfig",
    "MlflowConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RouterBiasConfig",
    "TrainConfig",
    "WandbConfig",
    "check_layout",
    "config_from_dict",
    "gradient_sync",
    "config_table",
    "describe_keys",
    "layout_error_for_config",
    "load_config",
    "parallel_options",
    "resolve_model_config",
    "validate",
]
