"""Configuration and data: strict keys, types, the embedded default, deterministic sample order, bad data."""

import json
from pathlib import Path

import pytest

from moeshard.train.config import ConfigError, DataConfig, JobConfig, load_config
from moeshard.train.data import GlobalBatches, build_dataset

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
        (["--train.schedule=linear"], "train.schedule must be cosine or constant"),
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


def _jsonl(tmp_path, records):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(f)


def test_unpacked_order_is_reproducible(tmp_path):
    recs = [{"input_ids": [i % 50, 1, 2, 3][: 2 + i % 3]} for i in range(20)]
    cfg = DataConfig(path=_jsonl(tmp_path, recs), synthetic=False, packing=False, seq_len=4)
    ds = build_dataset(cfg, vocab_size=64, eos_id=None, pad_id=0)
    assert len(ds) == 20
    b = ds.collate([4])
    assert b.input_ids[0, :3].tolist() == [4, 1, 2] and b.labels[0].tolist() == [4, 1, 2, -100]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 0]
    gb = GlobalBatches(20, global_batch=8, world_size=4, micro_batch=1, shuffle=False, seed=0)
    # step s uses records s*B .. s*B+B-1, each rank its contiguous share, wrapping into the next epoch
    assert gb.global_indices(1) == list(range(8, 16))
    assert gb.micro_batches(1, rank=2) == [[12], [13]]
    assert gb.global_indices(2) == [16, 17, 18, 19, 0, 1, 2, 3]
    shuffled = GlobalBatches(20, 8, 4, 1, shuffle=True, seed=3)
    assert sorted(shuffled.global_indices(0) + shuffled.global_indices(1) + shuffled.global_indices(2)[:4]) == list(
        range(20)
    )
    assert shuffled.global_indices(1) == GlobalBatches(20, 8, 4, 1, shuffle=True, seed=3).global_indices(1)


def test_packing_cuts_the_stream(tmp_path):
    cfg = DataConfig(
        path=_jsonl(tmp_path, [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]), synthetic=False, seq_len=3
    )
    ds = build_dataset(cfg, vocab_size=64, eos_id=9, pad_id=None)
    assert [x.tolist() for x in ds.ids] == [[1, 2, 3], [9, 4, 5]]


def test_bad_data_errors(tmp_path):
    with pytest.raises(ValueError, match="token id 70 outside the vocabulary \\[0, 64\\)"):
        build_dataset(
            DataConfig(path=_jsonl(tmp_path, [{"input_ids": [1, 70]}]), synthetic=False, seq_len=2),
            vocab_size=64,
            eos_id=None,
            pad_id=None,
        )
    with pytest.raises(ValueError, match="no training sample"):
        build_dataset(DataConfig(path=_jsonl(tmp_path, []), synthetic=False), vocab_size=64, eos_id=None, pad_id=None)
    with pytest.raises(ValueError, match="has 'text' but data.tokenizer is not set"):
        build_dataset(
            DataConfig(path=_jsonl(tmp_path, [{"text": "hi"}]), synthetic=False),
            vocab_size=64,
            eos_id=None,
            pad_id=None,
        )
    with pytest.raises(FileNotFoundError, match="data.path .* does not exist"):
        build_dataset(
            DataConfig(path=str(tmp_path / "none.jsonl"), synthetic=False), vocab_size=64, eos_id=None, pad_id=None
        )
    with pytest.raises(ValueError, match="fewer than one global batch of 16"):
        GlobalBatches(10, 16, 4, 1, False, 0)
    with pytest.raises(ValueError, match="global_batch_size 10 is not divisible by the world size 4"):
        GlobalBatches(100, 10, 4, 1, False, 0)
    with pytest.raises(ValueError, match="not divisible by train.micro_batch_size 3"):
        GlobalBatches(100, 16, 4, 3, False, 0)


def test_data_path_replaces_synthetic_data():
    cfg = load_config(None, ["--data.path=/d.jsonl"])
    assert cfg.data.synthetic is False and cfg.data.path == "/d.jsonl"


def test_parquet_and_text_with_a_local_tokenizer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 1, "b": 2, "c": 3, "[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    pq.write_table(pa.table({"text": ["a b c", "c b"]}), tmp_path / "d.parquet")
    cfg = DataConfig(path=str(tmp_path / "d.parquet"), tokenizer=str(tmp_path / "tok"), synthetic=False, seq_len=3)
    ds = build_dataset(cfg, vocab_size=64, eos_id=9, pad_id=None)
    assert [x.tolist() for x in ds.ids] == [[1, 2, 3], [9, 3, 2]]
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8]]}), tmp_path / "ids.parquet")
    ds = build_dataset(
        DataConfig(path=str(tmp_path / "ids.parquet"), synthetic=False, packing=False, seq_len=6),
        vocab_size=64,
        eos_id=None,
        pad_id=0,
    )
    assert ds.labels[0].tolist() == [5, 6, 7, 8, -100, -100]


def test_lr_schedule():
    from moeshard.train.train import lr_at

    cfg = load_config(None, ["--train.steps=10", "--train.warmup_steps=2", "--train.lr=1.0", "--train.min_lr=0.1"])
    lrs = [lr_at(s, cfg) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] > 0.1 and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    const = load_config(
        None, ["--train.schedule=constant", "--train.warmup_steps=0", "--train.lr=0.5", "--train.min_lr=0"]
    )
    assert {lr_at(s, const) for s in range(5)} == {0.5}


def test_a_path_on_the_command_line_replaces_the_files_preset():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml", ["--model.path=/models/q"])
    assert cfg.model.path == "/models/q" and cfg.model.preset is None
    with pytest.raises(ConfigError, match="exactly one of model.preset or model.path"):
        load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml", ["--model.path=/models/q", "--model.preset=tiny"])


def test_parallel_options_map_the_config_keys():
    from moeshard.ep import EPOptions
    from moeshard.models.qwen3moe import ParallelOptions
    from moeshard.train.config import parallel_options

    assert parallel_options(JobConfig()) == ParallelOptions()  # the defaults agree
    gpu = load_config(CONFIGS / "qwen3_30b_a3b_2x8.yaml")  # compile and activation checkpointing on, bf16
    assert parallel_options(gpu) == ParallelOptions(
        ep=EPOptions(kernels="triton"), compile=True, activation_checkpointing=True, param_dtype="bfloat16"
    )
    cfg = load_config(
        None,
        [
            "--train.compile=true",
            "--parallel.expert_kernels=compiled",
            "--parallel.dispatch=all_to_all",
            "--parallel.sm_carveout=0",
            "--parallel.prefetch_depth=2",
            "--parallel.prefetch_at_host_sync=false",
            "--parallel.reshard_after_forward=false",
        ],
    )
    assert parallel_options(cfg) == ParallelOptions(
        ep=EPOptions(dispatch="all_to_all", kernels="compiled", sm_carveout=0),
        compile=True,
        reshard_after_forward=False,
        prefetch_depth=2,
        prefetch_at_host_sync=False,
    )


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--parallel.dispatch=tokens", "parallel.dispatch must be one of overlapped, all_to_all, got 'tokens'"),
        ("--parallel.expert_kernels=fast", "parallel.expert_kernels must be one of auto, eager, compiled, triton"),
        ("--parallel.sm_carveout=-1", "parallel.sm_carveout must be >= 0"),
    ],
)
def test_parallel_option_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])
