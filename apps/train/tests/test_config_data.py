"""Configuration: strict keys, types, the embedded default; the data section is moeshard.data's DataConfig.

(How rows are made from data is moeshard.data's, tested in packages/data/tests.)
"""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import moeshard.data
from moeshard.train.config import ConfigError, DataConfig, JobConfig, load_config
from moeshard.train.run.build import balancing_options

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_default_yaml_is_the_embedded_default():
    assert load_config(CONFIGS / "default.yaml") == JobConfig()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    load_config(CONFIGS / name)


def test_overrides_and_types():
    cfg = load_config(None, ["--train.lr=1e-3", "--model.overrides.num_hidden_layers=2", "--train.betas=[0.9,0.99]"])
    assert cfg.train.lr == 1e-3 and cfg.model.overrides == {"num_hidden_layers": 2} and cfg.train.betas == (0.9, 0.99)
    assert load_config(None, ["--model.path=/m"]).model.preset is None  # a path replaces the default preset


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--train.lrr=1"], "unknown config key train.lrr; did you mean train.lr?"),
        (["--trian.lr=1"], "unknown config section 'trian'; did you mean train?"),
        (["--train.steps=1.5"], "train.steps must be an integer, got 1.5"),
        (["--train.lr=fast"], "train.lr must be a number, got 'fast'"),
        (["--data.packing=maybe"], "data.packing must be true or false"),
        (["--data.sources=[{path: a, wieght: 2}]"], "unknown config key data.sources[0].wieght; did you mean"),
        (["--data.seqlen=8"], "unknown config key data.seqlen; did you mean data.seq_len?"),
        (["--train.schedule=linear"], "train.schedule must be one of cosine, constant, wsd"),
        (["--train.decay_shape=sqrt"], "train.decay_shape one of linear, cosine, 1-sqrt"),
        (["--train.decay_fraction=0"], "train.decay_fraction must be in (0, 1]"),
        (["--train.aux_loss.scope=global"], "train.aux_loss.scope must be one of micro_batch, global_batch, sequence"),
        (
            ["--train.gradient_sync=last"],
            "train.gradient_sync must be one of auto, every_micro_batch, last_micro_batch",
        ),
        (
            ["--train.expert_weight_grads=never"],
            "train.expert_weight_grads must be one of auto, every_micro_batch, last_micro_batch",
        ),
        (["--train.aux_loss.cof=1"], "unknown config key train.aux_loss.cof; did you mean train.aux_loss.coef?"),
        (["--train.z_loss_coef=-1"], "train.aux_loss.coef and train.z_loss_coef must be >= 0"),
        (["--train.router_bias.update_rate=0"], "train.router_bias.update_rate must be > 0"),
        (["--eval.path=/v.jsonl", "--eval.synthetic=true"], "set one of eval.path or eval.synthetic"),
        (["--eval.max_batches=-1"], "eval.every_steps and eval.max_batches must be >= 0"),
        (["--model.path=/m", "--model.preset=tiny"], "exactly one of model.preset or model.path"),
        (["train.lr"], "must look like --section.key=value"),
    ],
)
def test_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)


def test_unknown_key_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown config key train.stepz"):
        load_config(f)


def test_data_path_replaces_synthetic_data():
    cfg = load_config(None, ["--data.path=/d.jsonl"])
    assert cfg.data.synthetic is False and cfg.data.path == "/d.jsonl"
    assert load_config(None, ["--data.seq_len=8"]).data.synthetic  # no source given: the embedded default


def test_data_section_is_moeshard_datas_config(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text(
        "data:\n"
        "  sources:\n"
        "    - {path: /data/web, weight: 0.7}\n"
        "    - {path: [/data/code/a.parquet, /data/code/b.parquet], weight: 0.3, name: code}\n"
        "  seq_len: 128\n"
        "  shuffle: true\n"
    )
    cfg = load_config(f)
    assert isinstance(cfg.data, moeshard.data.DataConfig) and not cfg.data.synthetic and cfg.data.packing
    assert [(s.name, s.weight) for s in cfg.data.sources] == [("web", 0.7), ("code", 0.3)]
    assert cfg.data.sources[1].path == ("/data/code/a.parquet", "/data/code/b.parquet")
    # config.yaml (what the job writes) loads back to the same job
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert load_config(tmp_path / "config.yaml") == cfg
    # a path or sources on the command line replaces the file's data source
    assert load_config(f, ["--data.path=/d.jsonl"]).data == DataConfig(path="/d.jsonl", seq_len=128, shuffle=True)
    listed = load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml", ["--data.sources=[{path: /p/a}, {path: /p/b}]"]).data
    assert listed.path is None and [s.name for s in listed.sources] == ["a", "b"]


def test_balancing_and_eval_keys():
    cfg = load_config(None, ["--train.aux_loss.scope=global_batch", "--train.router_bias=true"])
    assert cfg.train.aux_loss.scope == "global_batch" and cfg.train.aux_loss.coef is None
    sequence = load_config(None, ["--train.aux_loss.scope=sequence", "--train.aux_loss.coef=1e-4"])
    assert sequence.train.aux_loss.scope == "sequence" and sequence.train.aux_loss.coef == 1e-4
    options = balancing_options(sequence, SimpleNamespace())  # what the job's Balancing is built with
    assert options.scope == "sequence" and options.aux_loss_coef == 1e-4
    assert cfg.train.router_bias.update_rate == 1e-3 and JobConfig().train.router_bias is None
    assert load_config(None, ["--train.router_bias.update_rate=0.01"]).train.router_bias.update_rate == 0.01
    # the default job evaluates generated held-out rows; a job on real data evaluates only what eval.path names
    assert JobConfig().eval.synthetic and JobConfig().eval.enabled
    assert not load_config(None, ["--data.path=/d.jsonl"]).eval.enabled
    ev = load_config(None, ["--data.path=/d.jsonl", "--eval.path=/v.jsonl", "--eval.every_steps=100"]).eval
    assert ev.enabled and ev.path == "/v.jsonl" and not ev.synthetic
    assert (ev.every_steps, ev.max_batches, ev.at_start) == (100, 2, True)


def test_lr_schedule():
    from moeshard.train.run import lr_at

    cfg = load_config(None, ["--train.steps=10", "--train.warmup_steps=2", "--train.lr=1.0", "--train.min_lr=0.1"])
    lrs = [lr_at(s, cfg) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] > 0.1 and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    const = load_config(
        None, ["--train.schedule=constant", "--train.warmup_steps=0", "--train.lr=0.5", "--train.min_lr=0"]
    )
    assert {lr_at(s, const) for s in range(5)} == {0.5}
    # WSD: warm-up, stable at lr, then the last decay_fraction of the steps down to min_lr (reached at the last step)
    wsd = ["--train.schedule=wsd", "--train.steps=20", "--train.warmup_steps=2", "--train.lr=1.0", "--train.min_lr=0.0"]
    shapes = {}
    for shape in ("linear", "cosine", "1-sqrt"):
        cfg = load_config(None, [*wsd, "--train.decay_fraction=0.25", f"--train.decay_shape={shape}"])
        shapes[shape] = [lr_at(s, cfg) for s in range(20)]
        assert shapes[shape][:2] == [0.5, 1.0] and set(shapes[shape][2:15]) == {1.0} and shapes[shape][19] == 0.0
    at = 16  # the second of 5 decay steps: progress 2/5
    assert shapes["linear"][at] == pytest.approx(0.6)
    assert shapes["cosine"][at] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.4)))
    assert shapes["1-sqrt"][at] == pytest.approx(1 - math.sqrt(0.4))


def test_a_resume_with_another_schedule_says_what_the_lr_does():
    from moeshard.train.run import schedule_change

    before = load_config(None, ["--train.steps=100", "--train.lr=1.0", "--train.min_lr=0.0", "--train.warmup_steps=0"])
    saved = before.to_dict()["train"]
    assert schedule_change(saved, before, 50) is None
    longer = load_config(None, ["--train.steps=200", "--train.lr=1.0", "--train.min_lr=0.0", "--train.warmup_steps=0"])
    line = schedule_change(saved, longer, 50)
    assert line.startswith("resuming after step 50 with a changed schedule (train.steps 100 -> 200): the learning rate")
    assert "0.854 at step 51 (the checkpoint's schedule: 0.5)" in line and "at its last step 200" in line
    wsd = load_config(None, ["--train.steps=100", "--train.lr=1.0", "--train.min_lr=0.0", "--train.schedule=wsd"])
    assert "train.schedule cosine -> wsd" in schedule_change(saved, wsd, 50)


def test_a_path_on_the_command_line_replaces_the_files_preset():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml", ["--model.path=/models/q"])
    assert cfg.model.path == "/models/q" and cfg.model.preset is None
    with pytest.raises(ConfigError, match="exactly one of model.preset or model.path"):
        load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml", ["--model.path=/models/q", "--model.preset=tiny"])


def test_parallel_options_map_the_config_keys():
    from moeshard.ep import EPOptions
    from moeshard.models.common import ParallelOptions
    from moeshard.train.config import parallel_options

    assert parallel_options(JobConfig()) == ParallelOptions()  # the defaults are the package's
    gpu = load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml")  # compile and activation checkpointing on, bf16
    assert parallel_options(gpu) == ParallelOptions(
        ep=EPOptions(kernels="triton"), compile=True, activation_checkpointing=True, param_dtype="bfloat16"
    )
    new = [
        "--parallel.compile=true",
        "--parallel.ep.kernels=compiled",
        "--parallel.ep.dispatch=all_to_all",
        "--parallel.ep.sm_carveout=0",
        "--parallel.prefetch_depth=3",  # any int >= 0, as ParallelOptions takes it
        "--parallel.prefetch_at_host_sync=false",
        "--parallel.reshard_after_forward=false",
        "--parallel.expert_reshard_after_forward=true",
        "--parallel.expert_reduce_dtype=bfloat16",
    ]
    expected = ParallelOptions(
        ep=EPOptions(dispatch="all_to_all", kernels="compiled", sm_carveout=0),
        compile=True,
        reshard_after_forward=False,
        expert_reduce_dtype="bfloat16",
        expert_reshard_after_forward=True,
        prefetch_depth=3,
        prefetch_at_host_sync=False,
    )
    assert parallel_options(load_config(None, new)) == expected


@pytest.mark.parametrize(
    ("override", "needle"),
    [  # a key that moved is named where it is now, in one line
        ("--parallel.dispatch=all_to_all", "unknown config key parallel.dispatch; did you mean parallel.ep.dispatch?"),
        ("--parallel.sm_carveout=0", "unknown config key parallel.sm_carveout; did you mean parallel.ep.sm_carveout?"),
        (
            "--parallel.expert_kernels=eager",
            "unknown config key parallel.expert_kernels; did you mean parallel.ep.kernels?",
        ),
        ("--train.compile=true", "unknown config key train.compile; did you mean parallel.compile?"),
        ("--parallel.ep.compile=true", "unknown config key parallel.ep.compile; did you mean parallel.compile?"),
        (
            "--parallel.ep.dispach=all_to_all",
            "unknown config key parallel.ep.dispach; did you mean parallel.ep.dispatch?",
        ),
        ("--train.seq_len=8", "unknown config key train.seq_len; did you mean data.seq_len?"),
    ],
)
def test_a_key_in_the_wrong_place_names_the_right_one(override, needle, tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == needle
    section, rest = override[2:].split("=")[0].split(".", 1)
    value = yaml.safe_load(override.split("=", 1)[1])
    for part in reversed(rest.split(".")):
        value = {part: value}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({section: value}))
    with pytest.raises(ConfigError) as info:  # the same line from a file
        load_config(tmp_path / "job.yaml")
    assert str(info.value) == needle


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--parallel.ep.dispatch=tokens", "parallel.ep.dispatch must be one of overlapped, all_to_all, got 'tokens'"),
        ("--parallel.ep.kernels=fast", "parallel.ep.kernels must be one of eager, compiled, triton"),
        ("--parallel.ep.sm_carveout=-1", r"parallel.ep.sm_carveout=-1 is not allowed: an int >= 0"),
        ("--parallel.prefetch_depth=-1", r"parallel.prefetch_depth=-1 is not allowed: an int >= 0"),
        ("--parallel.expert_reduce_dtype=fp16", "parallel.expert_reduce_dtype must be one of float32, bfloat16, got"),
        ("--parallel.expert_reshard_after_forward=2", "parallel.expert_reshard_after_forward must be true or false"),
        ("--parallel.activation_checkpointing=some", "parallel.activation_checkpointing must be one of none, full"),
        ("--parallel.ep_size=0", "parallel.ep_size=0 is not allowed: an int >= 1"),
        ("--parallel.allow_cross_node_ep=1", "parallel.allow_cross_node_ep must be true or false, got 1"),
        (
            "--parallel.ep.recompute=mlp",
            "parallel.ep.recompute='mlp' is not allowed: set parallel.activation_checkpointing='selective' and "
            "parallel.selective_recompute='mlp' instead",
        ),
    ],
)
def test_parallel_option_errors(override, needle):
    with pytest.raises(ConfigError) as info:  # each field's own limits, in the job's key names
        load_config(None, [override])
    assert needle in str(info.value) and "Options" not in str(info.value) and "\n" not in str(info.value)


def test_run_identity_of_the_data(tmp_path, monkeypatch):
    """run.json's data: paths recorded absolute but the content decides; what changed, in words."""
    import json

    from moeshard.data import open_dataset
    from moeshard.train.run.prepare import data_changes, run_identity

    monkeypatch.chdir(tmp_path)
    for name, docs in (("a", [[1, 2, 3]] * 8), ("b", [[4, 5]] * 8), ("c", [[5, 4]] * 8)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))

    def ident(*overrides: str) -> dict:
        cfg = load_config(None, ["--data.seq_len=4", *overrides])
        return json.loads(json.dumps(run_identity(cfg, open_dataset(cfg.data, vocab_size=64))))  # as in run.json

    mix = ident("--data.sources=[{path: a.jsonl, weight: 3}, {path: b.jsonl}]")
    assert mix["data"]["sources"][0]["path"] == str(tmp_path / "a.jsonl")
    absolute = ident(f"--data.sources=[{{path: {tmp_path}/a.jsonl, weight: 3}}, {{path: b.jsonl}}]")
    assert data_changes(mix, absolute) == []
    assert data_changes(mix, ident("--data.sources=[{path: a.jsonl}, {path: c.jsonl, name: b}]")) == [
        "source 'a' weight 0.75 -> 0.5",
        "source 'b' weight 0.25 -> 0.5",
        "source 'b' holds other content (the same 8 documents and 16 tokens)",
    ]
    assert data_changes(mix, ident("--data.path=a.jsonl", "--data.seq_len=2")) == [
        "data.seq_len 4 -> 2",
        "source 'a' weight 0.75 -> 1",
        "source 'b' is gone",
    ]
    assert data_changes(ident("--data.path=a.jsonl"), mix)[-1] == "source 'b' is new (8 documents, 16 tokens)"


def test_readme_config_table_is_generated():
    """The README's table of keys is `moeshard-train config --markdown`: it cannot drift from the fields."""
    from moeshard.train.config import TABLE_BEGIN, TABLE_END, config_table

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    begin, end = readme.index(TABLE_BEGIN), readme.index(TABLE_END) + len(TABLE_END) + 1
    assert readme[begin:end] == config_table(), "run: moeshard-train config --markdown, paste it into the README"
    assert "`parallel.ep.kernels`" in readme[begin:end] and "`parallel.prefetch_depth`" in readme[begin:end]


def test_expert_weight_grads_budget():
    """``train.expert_weight_grads`` as the local experts' budget (``moeshard.fsdp_moe.expert_grad_budget``): never,
    always, or (``auto``) its default where the step's factors fit it, never where they do not. What the factors
    hold, as ``plan`` asks the packages (the dispatcher's report, ``moeshard.ep.kept_factor_elements``): at EP 1 of
    30B-A3B (128 local experts) 4 micro-batches of 4,096 tokens 1.04x the gradients; at EP 2 the overlapped
    dispatcher's factors also hold the own copies' sorted rows (``2D (P - 1) / P`` elements per copy)."""
    from moeshard.fsdp_moe import expert_grad_budget
    from moeshard.train.commands.plan_build import _kept_factor_ratio as kept_factor_ratio
    from moeshard.train.config import load_config, resolve_model_config

    def budget(value, ratio=None):
        return expert_grad_budget(value, ratio)

    assert budget("every_micro_batch") is None and budget("every_micro_batch", 0.5) is None
    assert budget("last_micro_batch") == budget("last_micro_batch", 3.0) == float("inf")
    assert budget("auto") == budget("auto", 1.04) == 1.1 and budget("auto", 1.2) is None
    config = resolve_model_config(load_config(None, ["--model.preset=qwen3-30b-a3b"]))
    per_copy, gradient = 2 * 2048 + 3 * 768, 128 * 3 * 2048 * 768  # elements per routed copy; per layer, EP 1
    assert kept_factor_ratio(config, 4096, 4, 1, "overlapped") == pytest.approx(3 * 4096 * 8 * per_copy / gradient)
    assert kept_factor_ratio(config, 4096, 4, 1, "overlapped") == pytest.approx(1.04, abs=0.005)
    assert kept_factor_ratio(config, 4096, 1, 1, "overlapped") == 0
    ep2 = 4096 * 8 * (per_copy + 2048) / (gradient / 2)
    assert kept_factor_ratio(config, 4096, 2, 2, "overlapped") == pytest.approx(ep2)
    assert kept_factor_ratio(config, 4096, 2, 2, "all_to_all") == pytest.approx(4096 * 8 * per_copy / (gradient / 2))
