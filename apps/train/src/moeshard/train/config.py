"""The job's configuration: one frozen dataclass per section, loaded from YAML plus ``--section.key=value``.

Unknown keys and wrong types are errors that name the key. The defaults *are* the embedded default job
(a tiny Qwen3-MoE on CPU, 4 processes as 2 nodes x 2, EP 2); ``apps/train/configs/default.yaml`` spells them out.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import moeshard.data


@dataclass(frozen=True)
class ModelConfig:
    """Which model: a named preset or a local HF directory (config + weights), plus field overrides."""

    preset: str | None = "tiny"
    path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"  # compute dtype: auto (bf16 on GPU, float32 on CPU) | float32 | bfloat16
    init_seed: int = 0  # random init when no path is given (presets)


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism and how it runs; the rest is derived from the launch (ranks per node from
    LOCAL_WORLD_SIZE). :func:`parallel_options` maps these keys onto ``moeshard.models.qwen3moe.ParallelOptions``."""

    ep_size: int = 2
    allow_cross_node_ep: bool = False
    prefetch_depth: int = 1  # 0 leaves FSDP's default order
    # With ep_size > 1: issue the forward prefetch at each MoE layer's host sync, not in the pre-forward hook.
    prefetch_at_host_sync: bool = True
    reshard_after_forward: bool = True
    dispatch: str = "overlapped"  # EP > 1 token exchange: overlapped | all_to_all (the plain reference)
    expert_kernels: str = "auto"  # auto (triton with train.compile, else eager) | eager | compiled | triton
    sm_carveout: int = 32  # SMs left to the exchange while an expert GEMM overlaps it (overlapped, CUDA); 0: off


@dataclass(frozen=True)
class DataConfig(moeshard.data.DataConfig):
    """The data section: ``moeshard.data.DataConfig`` (``path`` or weighted ``sources`` or ``synthetic``,
    ``tokenizer``, ``seq_len``, ``packing``, ``shuffle``, ``seed``, ...; its keys and checks) plus one key of the
    job: ``allow_changed``, a resume continues on data whose content or settings changed since the run began
    (the change is logged) instead of stopping."""

    allow_changed: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.allow_changed, bool):
            raise moeshard.data.DataError(f"data.allow_changed must be true or false, got {self.allow_changed!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation. ``global_batch_size`` counts sequences over all ranks per optimizer step."""

    steps: int = 60
    global_batch_size: int = 16
    micro_batch_size: int = 2
    lr: float = 3e-3
    warmup_steps: int = 5
    schedule: str = "cosine"  # cosine | constant
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 0
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each layer's attention half and the loss chunk (a GPU speed option)
    # Experts outside FSDP (ep_fsdp of one rank): one AdamW pass updates them from their compute-dtype gradients
    # and writes the next forward's compute copy (moeshard.fsdp_moe.build_optimizer's fuse_local_experts).
    fused_expert_update: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints (DCP); layout independent, atomic."""

    dir: str | None = None  # default: <output_dir>/checkpoints
    every_steps: int = 0  # 0: only at the end
    save_final: bool = True  # also save after the last step (off for throughput runs)
    keep_last: int = 2
    resume: str = "auto"  # auto | none | a checkpoint path


@dataclass(frozen=True)
class LoggingConfig:
    """Where metrics, TensorBoard events and checkpoints go."""

    output_dir: str = "outputs/default"
    every_steps: int = 1
    tensorboard: bool = True
    expert_load_every: int = 10
    comm_accounting: bool = False
    progress_bar: bool = True


@dataclass(frozen=True)
class JobConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(synthetic=True))
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-safe)."""

        def conv(v: Any) -> Any:
            if isinstance(v, (tuple, list)):
                return [conv(x) for x in v]
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v

        return {
            s.name: {k: conv(v) for k, v in dataclasses.asdict(getattr(self, s.name)).items()}
            for s in dataclasses.fields(self)
        }


DISPATCH = ("overlapped", "all_to_all")
EXPERT_KERNELS = ("auto", "eager", "compiled", "triton")


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _section_from_dict(cls: type, name: str, raw: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {name}.{near[0]}?" if near else f"; known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown config key {name}.{key}{hint}")
    return cls(**{k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in raw.items()})


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def _read_config_file(p: Path) -> dict[str, Any]:
    """The file's mapping of sections. Raises ConfigError (one line: ``file:line:column`` for a YAML error) for a
    missing, unreadable or empty file and for anything but a mapping of section names."""
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem, context = getattr(e, "problem", None), getattr(e, "context", None)
        what = f"{problem}{f' ({context})' if context else ''}" if problem else str(e).replace("\n", " ")
        raise ConfigError(f"config file {where}: YAML syntax error: {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {e}") from None
    if loaded is None:
        raise ConfigError(
            f"config file {p} is empty; give it sections (model:, train:, ...), or leave out --config for the "
            "embedded default job"
        )
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config file {p} must hold a mapping of sections (model:, train:, ...), got a {type(loaded).__name__}"
        )
    for key in loaded:
        if not isinstance(key, str):
            raise ConfigError(f"config file {p}: section names are words (model, train, ...), got {key!r}")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load a YAML file (optional) and apply ``section.key=value`` overrides; validate everything.

    Raises:
        ConfigError: unknown section/key, wrong type, malformed override, or an inconsistent value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = _read_config_file(Path(path))
        raw = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in loaded.items()}
    from_cli: set[str] = set()
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        from_cli.add(dotted)
        if "." in key:  # model.overrides.num_hidden_layers=2
            key, sub = key.split(".", 1)
            raw.setdefault(section, {}).setdefault(key, {})[sub] = _parse_value(value)
        else:
            raw.setdefault(section, {})[key] = _parse_value(value)
    sections = {f.name: f.type for f in dataclasses.fields(JobConfig)}
    for name in raw:
        if name not in sections:
            near = difflib.get_close_matches(name, sections, n=1)
            hint = f"; did you mean {near[0]}?" if near else f"; sections: {', '.join(sections)}"
            raise ConfigError(f"unknown config section {name!r}{hint}")
    # A path replaces the default preset; a path on the command line also replaces the YAML file's preset (unless
    # the command line sets that too).
    model = raw.get("model", {})
    if isinstance(model, dict) and model.get("path") is not None:
        if "preset" not in model or ("model.preset" not in from_cli and "model.path" in from_cli):
            model["preset"] = None
    _data_source(raw.get("data"), from_cli)
    cfg = config_from_dict(raw)
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """The job of a mapping of sections (a YAML file's, or ``JobConfig.to_dict()``'s); absent sections and keys
    keep their defaults.

    Raises:
        ConfigError: an unknown section or key, or a value of the wrong type.
    """
    hints = typing.get_type_hints(JobConfig)
    try:
        built = {name: _section_from_dict(hints[name], name, raw[name]) for name in raw if name != "data"}
        if "data" in raw:
            built["data"] = DataConfig.from_dict(raw["data"], "data")  # moeshard.data's keys and checks
    except moeshard.data.DataError as e:
        raise ConfigError(str(e)) from None
    return JobConfig(**built)


def _data_source(data: Any, from_cli: set[str]) -> None:
    """Where the rows come from: ``data.path``, ``data.sources`` or ``data.synthetic`` (the embedded default when
    none is given). A path or sources given on the command line replaces the YAML file's (unless the command
    line sets that too)."""
    if not isinstance(data, dict):
        return  # DataConfig.from_dict names the problem
    keys = ("path", "sources", "synthetic")
    if any(f"data.{k}" in from_cli for k in ("path", "sources")):
        for k in keys:
            if f"data.{k}" not in from_cli:
                data.pop(k, None)
    if data.get("path") is None and not data.get("sources") and "synthetic" not in data:
        data["synthetic"] = True


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group (world-size checks happen at launch)."""
    m, t, c = cfg.model, cfg.train, cfg.checkpoint
    if (m.preset is None) == (m.path is None):
        raise ConfigError("model: set exactly one of model.preset or model.path")
    if m.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be auto, float32 or bfloat16, got {m.dtype!r}")
    p = cfg.parallel
    if p.prefetch_depth not in (0, 1, 2):
        raise ConfigError(f"parallel.prefetch_depth must be 0 (off), 1 or 2, got {p.prefetch_depth}")
    for key, allowed in (("dispatch", DISPATCH), ("expert_kernels", EXPERT_KERNELS)):
        if getattr(p, key) not in allowed:
            raise ConfigError(f"parallel.{key} must be one of {', '.join(allowed)}, got {getattr(p, key)!r}")
    if p.sm_carveout < 0:
        raise ConfigError(f"parallel.sm_carveout must be >= 0 (0: off), got {p.sm_carveout}")
    if t.warmup_steps < 0 or t.max_grad_norm <= 0 or t.weight_decay < 0:
        raise ConfigError(
            "train.warmup_steps must be >= 0, train.max_grad_norm > 0 and train.weight_decay >= 0 "
            f"(got {t.warmup_steps}, {t.max_grad_norm}, {t.weight_decay})"
        )
    if cfg.logging.every_steps < 1 or cfg.logging.expert_load_every < 0:
        raise ConfigError(
            f"logging.every_steps must be >= 1 and logging.expert_load_every >= 0 (0: off), got "
            f"{cfg.logging.every_steps} and {cfg.logging.expert_load_every}"
        )
    if c.resume == "":
        raise ConfigError("checkpoint.resume must be auto, none or a checkpoint folder")
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    if t.schedule not in ("cosine", "constant"):
        raise ConfigError(f"train.schedule must be cosine or constant, got {t.schedule!r}")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"train.lr must be > 0 and 0 <= train.min_lr <= train.lr (got lr={t.lr}, min_lr={t.min_lr})")
    if c.keep_last < 1:
        raise ConfigError(
            f"checkpoint.keep_last must be >= 1 (the newest checkpoint is always kept), got {c.keep_last}"
        )
    if c.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps must be >= 0, got {c.every_steps}")


def parallel_options(cfg: JobConfig):
    """The one mapping of the job's keys onto ``moeshard.models.qwen3moe.ParallelOptions`` (training, ``plan`` and
    ``bench`` all build through it): ``parallel.*``, ``train.compile``, ``train.activation_checkpointing`` and
    ``model.dtype``. ``parallel.expert_kernels: auto`` is triton with ``train.compile``, else eager."""
    from moeshard.ep import EPOptions
    from moeshard.models.qwen3moe import ParallelOptions

    p, t = cfg.parallel, cfg.train
    kernels = p.expert_kernels if p.expert_kernels != "auto" else ("triton" if t.compile else "eager")
    return ParallelOptions(
        ep=EPOptions(dispatch=p.dispatch, kernels=kernels, sm_carveout=p.sm_carveout),
        compile=t.compile,
        activation_checkpointing=t.activation_checkpointing,
        param_dtype=cfg.model.dtype,
        reshard_after_forward=p.reshard_after_forward,
        prefetch_depth=p.prefetch_depth,
        prefetch_at_host_sync=p.prefetch_at_host_sync,
    )


def resolve_model_config(cfg: JobConfig):
    """The transformers config of the model to train (preset or local dir), with ``model.overrides`` applied.

    Raises:
        ValueError: an override names a field the config does not have.
    """
    from moeshard.models.qwen3moe import get_preset_config, load_hf_config

    if cfg.model.path is not None:
        config = load_hf_config(cfg.model.path)
        for k, v in cfg.model.overrides.items():
            if not hasattr(config, k):
                raise ValueError(f"model.overrides.{k}: Qwen3MoeConfig has no field {k!r}")
            setattr(config, k, v)
        return config
    return get_preset_config(cfg.model.preset, **cfg.model.overrides)
