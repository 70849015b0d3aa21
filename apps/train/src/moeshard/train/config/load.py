"""Loading the job's configuration: a YAML file under the command's own defaults, ``--section.key=value``
overrides and the checks across keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import moeshard.data
from moeshard.models.common import SCOPES as AUX_SCOPES
from moeshard.train.config.parse import ConfigError, keys_of, parse_value, read_config_file, section_from_dict
from moeshard.train.config.sections import DataConfig, JobConfig
from moeshard.train.families import family_name, get_family

SCHEDULES = ("cosine", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
GRADIENT_SYNC = ("auto", "every_micro_batch", "last_micro_batch")
EXPERT_WEIGHT_GRADS = GRADIENT_SYNC
SAVE_HF = ("none", "final", "every")
HF_DTYPES = ("bfloat16", "float16", "float32")
WANDB_MODES = ("offline", "online", "disabled")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, dict[str, Any]] | None = None,
) -> JobConfig:
    """Load a YAML file (optional) and apply ``section.key=value`` overrides; validate everything.

    Args:
        base: keys under the file's (a command's own defaults, e.g. ``bench``'s geometry), by section; the file
            and the overrides win over them.

    Raises:
        ConfigError: unknown section/key, wrong type, malformed override, or an inconsistent value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = read_config_file(Path(path))
        raw = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in loaded.items()}
    for section, keys in (base or {}).items():
        given = raw.get(section, {})
        if isinstance(given, dict):
            merged = {**keys, **given}
            if section == "model" and "path" in given and "preset" not in given:
                merged.pop("preset", None)  # the file's model.path replaces the command's preset
            raw[section] = merged
    from_cli: set[str] = set()
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        dotted, value = text.split("=", 1)
        section, key = dotted.split(".", 1)
        from_cli.add(dotted)
        if "." in key:  # model.overrides.num_hidden_layers=2, logging.wandb.project=x
            key, sub = key.split(".", 1)
            group = raw.setdefault(section, {})
            if not isinstance(group.get(key), dict):  # absent, or null / true in the file
                group[key] = {}
            group[key][sub] = parse_value(value)
        else:
            raw.setdefault(section, {})[key] = parse_value(value)
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
    if "eval.path" in from_cli and isinstance(raw.get("eval"), dict) and "eval.synthetic" not in from_cli:
        raw["eval"].pop("synthetic", None)  # a held-out path on the command line replaces the file's generated rows
    cfg = config_from_dict(raw)
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """The job of a mapping of sections (a YAML file's, or ``JobConfig.to_dict()``'s: a checkpoint's saved config);
    absent sections and keys keep their defaults.

    Raises:
        ConfigError: an unknown section or key (with the key most likely meant, in any section), a value of the
            wrong type or out of its field's limits.
    """
    hints = typing.get_type_hints(JobConfig)
    known = [k for name in hints for k in keys_of(hints[name], name)]
    try:
        built = {name: section_from_dict(hints[name], name, raw[name], known) for name in raw if name != "data"}
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


def gradient_sync(train: Any, world_size: int) -> str:
    """``train.gradient_sync`` for a job of ``world_size`` ranks: ``auto`` is ``last_micro_batch`` on one rank (its
    unsharded gradients are its sharded ones: holding them costs nothing) and ``every_micro_batch`` on more (the
    unsharded gradients of every unit held through the step; ``plan`` shows what they would cost)."""
    if train.gradient_sync != "auto":
        return train.gradient_sync
    return "last_micro_batch" if world_size == 1 else "every_micro_batch"


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group (world-size checks happen at launch)."""
    m, t, c = cfg.model, cfg.train, cfg.checkpoint
    if (m.preset is None) == (m.path is None):
        raise ConfigError("model: set exactly one of model.preset or model.path")
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
    if t.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got {t.schedule!r}")
    if not 0 < t.decay_fraction <= 1 or t.decay_shape not in DECAY_SHAPES:
        raise ConfigError(
            f"train.decay_fraction must be in (0, 1] and train.decay_shape one of {', '.join(DECAY_SHAPES)} "
            f"(got {t.decay_fraction}, {t.decay_shape!r})"
        )
    if t.gradient_sync not in GRADIENT_SYNC:
        raise ConfigError(f"train.gradient_sync must be one of {', '.join(GRADIENT_SYNC)}, got {t.gradient_sync!r}")
    if t.expert_weight_grads not in EXPERT_WEIGHT_GRADS:
        raise ConfigError(
            f"train.expert_weight_grads must be one of {', '.join(EXPERT_WEIGHT_GRADS)}, got {t.expert_weight_grads!r}"
        )
    if t.aux_loss.scope not in AUX_SCOPES:
        raise ConfigError(f"train.aux_loss.scope must be one of {', '.join(AUX_SCOPES)}, got {t.aux_loss.scope!r}")
    if (t.aux_loss.coef is not None and t.aux_loss.coef < 0) or t.z_loss_coef < 0:
        raise ConfigError(
            f"train.aux_loss.coef and train.z_loss_coef must be >= 0 (got {t.aux_loss.coef}, {t.z_loss_coef})"
        )
    if t.router_bias is not None and not t.router_bias.update_rate > 0:
        raise ConfigError(
            f"train.router_bias.update_rate must be > 0 (null turns aux-loss-free balancing off), got "
            f"{t.router_bias.update_rate}"
        )
    ev = cfg.eval
    if ev.path is not None and ev.synthetic:
        raise ConfigError("eval: set one of eval.path or eval.synthetic, not both")
    if ev.every_steps < 0 or ev.max_batches < 0:
        raise ConfigError(
            f"eval.every_steps and eval.max_batches must be >= 0 (0: after the last step only; the whole set), got "
            f"{ev.every_steps} and {ev.max_batches}"
        )
    if t.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(
            f"train.min_lr must be between 0 and train.lr (got min_lr={t.min_lr}, lr={t.lr}); leave it out for a "
            "tenth of train.lr"
        )
    if c.keep_last < 1:
        raise ConfigError(
            f"checkpoint.keep_last must be >= 1 (the newest checkpoint is always kept), got {c.keep_last}"
        )
    if c.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps must be >= 0, got {c.every_steps}")
    for key in ("timeout_s", "init_timeout_s"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0 (0: no hang check), got {getattr(t, key)}")
    for key, allowed in (("save_hf", SAVE_HF), ("hf_dtype", HF_DTYPES)):
        if getattr(c, key) not in allowed:
            raise ConfigError(f"checkpoint.{key} must be one of {', '.join(allowed)}, got {getattr(c, key)!r}")
    lg = cfg.logging
    if lg.wandb is not None and lg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {lg.wandb.mode!r}")
    if lg.profile is not None:
        first, last = lg.profile.steps
        if not 1 <= first <= last:
            raise ConfigError(
                f"logging.profile.steps must be [first, last] with 1 <= first <= last (steps count from 1), got "
                f"{list(lg.profile.steps)}"
            )


def layout_error_for_config(error: ValueError) -> str:
    """``moeshard.meshes``' layout error in the words of the job's config (its key, not the Python argument)."""
    return str(error).replace("pass allow_cross_node_ep=True", "set parallel.allow_cross_node_ep=true")


def resolve_model_config(cfg: JobConfig):
    """The transformers config of the model to train (preset or local dir of ``model.family``), with
    ``model.overrides`` applied.

    Raises:
        ValueError: an override names a field the config does not have.
    """
    family = get_family(family_name(cfg.model.family, cfg.model.path))
    if cfg.model.path is not None:
        config = family.load_config(cfg.model.path)
        for k, v in cfg.model.overrides.items():
            if not hasattr(config, k):
                raise ValueError(f"model.overrides.{k}: {type(config).__name__} has no field {k!r}")
            setattr(config, k, v)
        return config
    return family.preset_config(cfg.model.preset, **cfg.model.overrides)
