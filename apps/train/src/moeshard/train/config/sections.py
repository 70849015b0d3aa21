"""The job's configuration sections: one frozen dataclass each (``parallel``: :mod:`.parallel`), every
key with its default and meaning (:func:`describe_keys`, :func:`config_table`); loading is :mod:`.load`.

Unknown keys and wrong types are errors that name the key. The defaults *are* the embedded default job
(a tiny Qwen3-MoE on CPU, 4 processes as 2 nodes x 2, EP 2); ``apps/train/configs/default.yaml`` spells them out.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import moeshard.data
from moeshard.lora import LoraOptions
from moeshard.train.config.parallel import ParallelConfig
from moeshard.train.config.parse import yaml_key


def _key(
    default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING, name: str = ""
) -> Any:
    """A config key: its default and its one-line meaning, the one place both are written (``moeshard-train config
    --show`` prints them; a test checks that every key has a meaning). ``name``: the YAML key where it is not the
    field's (``checkpoint.async``, a Python keyword)."""
    meta = {"help": help, **({"key": name} if name else {})}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    """Which model: a named preset or a local HF directory (config + weights), plus field overrides."""

    family: str | None = _key(
        None, "qwen3_moe | deepseek_v3; default: the model.path folder's model_type, else qwen3_moe"
    )
    preset: str | None = _key(
        "tiny",
        "a named model of the family: tiny | qwen3-30b-a3b | deepseek-v3-16b | deepseek-v3-671b (null with model.path)",
    )
    path: str | None = _key(None, "a local HF folder (config.json + safetensors, either expert layout) to start from")
    overrides: dict[str, Any] = _key(factory=dict, help="config fields to change, e.g. {num_hidden_layers: 8}")
    init_seed: int = _key(0, "seed of the random initialisation (presets; not with model.path)")


@dataclass(frozen=True)
class DataConfig(moeshard.data.DataConfig):
    """The data section: ``moeshard.data.DataConfig`` (``path`` or weighted ``sources`` or ``synthetic``,
    ``tokenizer``, ``seq_len``, ``packing``, ``shuffle``, ``seed``, ...; its keys and checks) plus one key of the
    job: ``allow_changed``, a resume continues on data whose content or settings changed since the run began
    (the change is logged) instead of stopping."""

    # The meanings of the keys moeshard.data's DataConfig defines (the job's own keys carry theirs).
    HELP: ClassVar[dict[str, str]] = {
        "path": "a file, folder, glob, HF save_to_disk folder, prepared folder, or a list of them (one source)",
        "sources": "or a weighted mixture: [{path, weight, name}, ...]",
        "tokenizer": "a local tokenizer folder, for text / messages records (copied into Hub exports)",
        "seq_len": "tokens per row",
        "packing": "document-masked packing (rows are windows of the token stream); false: one padded document per row",
        "shuffle": "a seeded permutation of each source's rows per epoch",
        "seed": "seed of the shuffle",
        "synthetic": "generated sequences instead of files (the CPU smoke test)",
        "synthetic_samples": "rows of synthetic data",
    }

    allow_changed: bool = _key(False, "a resume may continue on changed data (logged) instead of stopping")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.allow_changed, bool):
            raise moeshard.data.DataError(f"data.allow_changed must be true or false, got {self.allow_changed!r}")


@dataclass(frozen=True)
class EvalConfig:
    """Validation (``moeshard.train.run.evaluation``): the mean loss over every predicted token of a held-out set, all
    ranks, in global batches of ``train.global_batch_size`` rows split over the ranks like training's."""

    path: str | tuple[str, ...] | None = _key(
        None, "held-out data: anything data.path takes (read with data's seq_len, packing and tokenizer)"
    )
    synthetic: bool | None = _key(
        None,
        "held-out generated rows (data.synthetic's kind, another seed); default (null): data.synthetic, unless "
        "eval.path is set",
    )
    every_steps: int = _key(20, "evaluate after every N steps (and after the last); 0: only after the last step")
    max_batches: int = _key(2, "global batches per evaluation: the set's first N; 0: the whole set")
    at_start: bool = _key(True, "also evaluate before the first update (step 0)")

    @property
    def enabled(self) -> bool:
        """Whether there is a set to evaluate."""
        return self.path is not None or bool(self.synthetic)


@dataclass(frozen=True)
class AuxLossConfig:
    """The router's load-balancing loss (``moeshard.train.run.train_step``)."""

    coef: float | None = _key(
        None,
        "weight of the balancing loss; default (null): the model's router_aux_loss_coef (0.001 for 30B-A3B); 0: off",
    )
    scope: str = _key(
        "micro_batch",
        "expert frequencies of: micro_batch (per rank and micro-batch, transformers' loss) | global_batch (the step's "
        "micro-batches so far on all ranks: one all-reduce of [layers, experts] per micro-batch) | sequence "
        "(DeepSeek-V3's complementary sequence-wise balance loss: per row of the micro-batch, the routers' own "
        "selection and normalised scores; DeepSeek-V3 used coef 1e-4)",
    )


@dataclass(frozen=True)
class RouterBiasConfig:
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the routing scores for the top-k selection only."""

    update_rate: float = _key(
        1e-3, "after each optimizer step, bias += rate * sign(mean load - load) from the step's global expert load"
    )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation. ``global_batch_size`` counts sequences over all ranks per optimizer step."""

    steps: int = _key(60, "optimizer steps of the run")
    global_batch_size: int = _key(16, "sequences per optimizer step, all ranks together")
    micro_batch_size: int = _key(2, "sequences per forward; accumulation = global / world / micro")
    lr: float = _key(3e-3, "peak learning rate (AdamW)")
    warmup_steps: int = _key(5, "steps of linear warm-up")
    schedule: str = _key("cosine", "learning rate after warm-up: cosine | constant | wsd (warmup-stable-decay)")
    min_lr: float | None = _key(None, "learning rate at the end of the decay; default (null): a tenth of train.lr")
    decay_fraction: float = _key(0.1, "wsd: the last fraction of train.steps that decays to min_lr")
    decay_shape: str = _key("linear", "wsd: the decay's shape: linear | cosine | 1-sqrt")
    weight_decay: float = _key(0.01, "AdamW weight decay")
    betas: tuple[float, float] = _key((0.9, 0.95), "AdamW betas")
    max_grad_norm: float = _key(1.0, "clip the global gradient norm to this")
    seed: int = _key(0, "seed of the run's random state (dropout-free model: little else)")
    # moeshard.fsdp_moe.build_optimizer's argument of the same name.
    fuse_local_experts: bool = _key(
        True, "experts outside FSDP (ep_fsdp 1): one fused AdamW pass from their compute-dtype gradients"
    )
    gradient_sync: str = _key(
        "auto",
        "when FSDP reduce-scatters gradients: every_micro_batch | last_micro_batch (once per step; every FSDP unit "
        "holds unsharded float32 gradients meanwhile) | auto (last_micro_batch on one rank, where that costs no "
        "memory; every_micro_batch on more)",
    )
    expert_weight_grads: str = _key(
        "auto",
        "when the weight gradients of experts outside FSDP (ep_fsdp 1) are formed: every_micro_batch | "
        "last_micro_batch (each micro-batch's factors kept, all formed in the last backward: each gradient written "
        "once) | auto (last_micro_batch where the kept factors hold at most 1.1x the gradients, e.g. 128 local "
        "experts; every_micro_batch elsewhere)",
    )
    aux_loss: AuxLossConfig = _key(factory=AuxLossConfig, help="expert balancing loss: {coef, scope}")
    router_bias: RouterBiasConfig | None = _key(
        None, "aux-loss-free expert balancing: {update_rate} (true: its default); null: off"
    )
    z_loss_coef: float = _key(0.0, "weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2); 0: off")
    timeout_s: float = _key(
        100.0,
        "a rank that finishes no step (nor the save or evaluation after it) for this long ends the job, naming the "
        "rank that did not arrive; 0: off",
    )
    init_timeout_s: float = _key(300.0, "the same before the first step ends (start-up, compilation)")

    def __post_init__(self) -> None:
        if self.min_lr is None and isinstance(self.lr, (int, float)):
            # a tenth of lr, as its decimal literal (3e-4, not 3.0000000000000003e-4: the figure one reads back)
            object.__setattr__(self, "min_lr", float(f"{self.lr / 10:.12g}"))


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints (DCP); layout independent, atomic."""

    dir: str | None = _key(None, "where checkpoints go; default (null): <output_dir>/checkpoints")
    every_steps: int = _key(0, "save every N steps; 0: only at the end")
    save_final: bool = _key(True, "also save after the last step (off for throughput runs)")
    keep_last: int = _key(2, "complete checkpoints kept (older ones are pruned)")
    resume: str = _key("auto", "auto (the newest complete checkpoint) | none | a checkpoint folder")
    async_: bool = _key(
        False,
        "save in the background (DCP async_save, pinned staging on CUDA): training goes on meanwhile",
        name="async",
    )
    save_hf: str = _key(
        "none", "also write a Hub folder (<output_dir>/hf/step_N) from a checkpoint: none | final | every"
    )
    hf_dtype: str = _key("bfloat16", "dtype of the Hub folder's weights: bfloat16 | float16 | float32")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (``pip install 'moeshard-train[wandb]'``); rank 0 logs the config and every metric."""

    project: str = _key("moeshard", "the W&B project")
    mode: str = _key("offline", "offline (files under <output_dir>/wandb, no network) | online | disabled")
    entity: str | None = _key(None, "the W&B team or user (default: yours)")
    name: str | None = _key(None, "the run's name (default: the output folder's name)")
    group: str | None = _key(None, "a group of runs")
    tags: tuple[str, ...] = _key((), "tags of the run")


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow (``pip install 'moeshard-train[mlflow]'``); rank 0 logs the config and every metric."""

    tracking_uri: str | None = _key(None, "where runs go; default (null): sqlite:///<output_dir>/mlflow.db (no server)")
    experiment: str = _key("moeshard", "the MLflow experiment")
    run_name: str | None = _key(None, "the run's name (default: the output folder's name)")


@dataclass(frozen=True)
class ProfileConfig:
    """torch.profiler over a range of steps (``moeshard.train.observe.profiling``)."""

    steps: tuple[int, int] = _key((2, 3), "first and last step to profile (counting from 1)")
    memory: bool = _key(False, "also record a CUDA memory snapshot of those steps (GPU only)")


@dataclass(frozen=True)
class LoggingConfig:
    """Where metrics, TensorBoard events and checkpoints go."""

    output_dir: str = _key("outputs/default", "metrics, TensorBoard, checkpoints, run.json, Hub exports, traces")
    every_steps: int = _key(1, "a metrics line every N steps (and the last)")
    tensorboard: bool = _key(True, "TensorBoard events under <output_dir>/tensorboard")
    expert_load_every: int = _key(10, "per-layer expert load in TensorBoard every N steps; 0: off")
    comm_accounting: bool = _key(False, "count every collective's calls and bytes per step (metrics.jsonl comm)")
    progress_bar: bool = _key(True, "a progress bar with ETA on stderr when it is a terminal")
    wandb: WandbConfig | None = _key(None, "Weights & Biases: {project, mode, entity, name, group, tags}; null: off")
    mlflow: MlflowConfig | None = _key(None, "MLflow: {tracking_uri, experiment, run_name}; null: off")
    profile: ProfileConfig | None = _key(None, "torch.profiler trace of {steps: [a, b], memory}; null: off")


@dataclass(frozen=True)
class JobConfig:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # moeshard.lora's options themselves (each key its field, help and checks), as parallel is ParallelOptions.
    lora: LoraOptions = field(default_factory=LoraOptions)
    data: DataConfig = field(default_factory=lambda: DataConfig(synthetic=True))
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-safe)."""

        def conv(v: Any) -> Any:
            if dataclasses.is_dataclass(v):
                return {yaml_key(f): conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
            if isinstance(v, (tuple, list)):
                return [conv(x) for x in v]
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            return v

        return conv(self)

    def __post_init__(self) -> None:
        if self.eval.synthetic is None:  # held-out generated rows for generated training rows, none for real data
            synthetic = bool(self.data.synthetic) and self.eval.path is None
            object.__setattr__(self, "eval", dataclasses.replace(self.eval, synthetic=synthetic))


GROUP_OFF = "(off)"  # describe_keys' value of a key in an optional group that is off


TABLE_BEGIN = "<!-- config-table:begin (generated by `moeshard-train config --markdown`; edit the fields' help) -->"
TABLE_END = "<!-- config-table:end -->"


def config_table(cfg: JobConfig | None = None) -> str:
    """Every key of the job with its default and meaning as a Markdown table, between :data:`TABLE_BEGIN` and
    :data:`TABLE_END` (the README's table; a test keeps it equal to this)."""
    rows = [TABLE_BEGIN, "", "| key | default | meaning |", "|---|---|---|"]
    for key, _, default, meaning in describe_keys(cfg or JobConfig()):
        shown = json.dumps(default, default=str) if not dataclasses.is_dataclass(default) else "{...}"
        rows.append(f"| `{key}` | `{shown}` | {meaning.replace('|', '/')} |")
    return "\n".join([*rows, "", TABLE_END]) + "\n"


def describe_keys(cfg: JobConfig) -> list[tuple[str, Any, Any, str]]:
    """Every key of the job as ``(dotted key, value, default, meaning)``, in file order; the keys of an optional
    group (``logging.wandb.project``) follow the group's row, with the value :data:`GROUP_OFF` where it is off."""
    rows: list[tuple[str, Any, Any, str]] = []

    def walk(prefix: str, cls: type, value: Any, default: Any) -> None:
        inherited, hints = getattr(cls, "HELP", {}), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{yaml_key(f)}"
            v = getattr(value, f.name) if value is not None else GROUP_OFF
            rows.append((key, v, getattr(default, f.name), f.metadata.get("help") or inherited.get(f.name, "")))
            args = typing.get_args(hints[f.name])
            group = [a for a in args if dataclasses.is_dataclass(a)] if type(None) in args else []
            if group:  # an optional group of keys (logging.wandb): its own defaults
                walk(key, group[0], None if v is GROUP_OFF else v, group[0]())
            elif dataclasses.is_dataclass(hints[f.name]):  # a group that is always there (train.aux_loss)
                walk(key, hints[f.name], v, getattr(default, f.name))

    defaults = JobConfig()
    for f in dataclasses.fields(JobConfig):
        walk(f.name, typing.get_type_hints(JobConfig)[f.name], getattr(cfg, f.name), getattr(defaults, f.name))
    return rows
