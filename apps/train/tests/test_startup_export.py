"""The job says what it trains (the start-up block), and its Hub folders are usable: the tokenizer and the generation
config go along (from ``model.path``, ``data.tokenizer`` or the prepared data), or one line says why not, and the
files get the umask's mode. The jobs run in this process, two steps of a two-layer tiny model."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from moeshard.train.__main__ import main

TINY = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--parallel.ep_size=1",
    "--train.global_batch_size=4",
    "--train.steps=2",
    "--eval.every_steps=0",
    "--eval.at_start=false",
    "--logging.progress_bar=false",
    "--logging.tensorboard=false",
    "--logging.expert_load_every=0",
]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


def _block(printed: str) -> dict[str, list[str]]:
    """The start-up block's lines by label (the lines before the meshes' description)."""
    lines: dict[str, list[str]] = {}
    for line in printed.split("\nworld ")[0].splitlines():
        label, _, text = line.partition(" ")
        if label in ("model", "parameters", "layout", "batch", "data", "outputs"):
            lines.setdefault(label, []).append(text.strip())
    return lines


def _modes(folder: Path) -> dict[str, str]:
    return {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in folder.iterdir()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_tiny_default_job_says_what_it_trains(clean_env, capsys, tmp_path):
    from moeshard.models.qwen3moe import FAMILY

    out = tmp_path / "out"
    assert main([*TINY, f"--logging.output_dir={out}", "--checkpoint.save_hf=final"]) == 0
    printed = capsys.readouterr().out
    block = _block(printed)
    total, active = FAMILY.count_parameters(FAMILY.preset_config("tiny", num_hidden_layers=2))
    assert block["model"] == ["qwen3_moe preset tiny, overrides num_hidden_layers=2"]
    (params,) = block["parameters"]
    assert params.endswith("compute dtype float32 (auto)")
    assert f"{total / 1e3:.1f}K total, {active / 1e3:.1f}K active per token" in params
    assert block["layout"] == ["world 1 = 1 node x 1 rank; ep 1, ep_fsdp 1; 1 data-parallel rank"]
    # the default micro-batch of 2: 4 rows per step are 2 micro-batches on the one rank
    assert block["batch"] == ["micro-batch 2 x 2 accumulation x 1 rank = 4 rows of 32 = 128 tokens per step, 2 steps"]
    assert block["data"] == ["synthetic: 131,072 tokens, 4,096 rows"]
    assert block["outputs"] == [f"{out} (checkpoints {out / 'checkpoints'}; Hub folders {out / 'hf'}: final)"]
    assert printed.index("model ") < printed.index("step      1")  # said before training starts
    # a preset run names no tokenizer and its config no token ids: the Hub folder says so, once, under its own name
    hub = out / "hf/step_00000002"
    assert printed.count(f"{hub}: no tokenizer: the run names none") == 1
    assert printed.count(f"{hub}: no generation_config.json: the model config sets no bos/eos/pad token id") == 1
    assert sorted(p.name for p in hub.iterdir()) == ["config.json", "model.safetensors"]


def _hub_folder(folder: Path) -> None:
    """A tiny Hub folder a user fine-tunes from: weights, config with token ids, tokenizer with a chat template and a
    generation config, its files readable by their owner only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    config = get_preset_config("tiny", num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.init_weights()
    model.save_pretrained(folder)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 100)}, "[UNK]": 100}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, temperature=0.6, do_sample=True).save_pretrained(
        folder
    )
    for f in folder.iterdir():
        f.chmod(0o600)


def _check_usable(folder: Path) -> None:
    """transformers loads the folder's tokenizer (with its chat template), generation config and model; every file
    has the umask's mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok("w5 w7")["input_ids"] == [5, 7] and tok.eos_token == "</s>"
    assert tok.chat_template == CHAT_TEMPLATE
    gen = GenerationConfig.from_pretrained(folder)
    assert (gen.eos_token_id, gen.temperature) == (2, 0.6)  # the Hub folder's, sampling settings included
    AutoModelForCausalLM.from_pretrained(folder)
    mode = oct(0o666 & ~_umask())
    assert _modes(folder) == {name: mode for name in _modes(folder)}, "0600 files are unreadable to others"


def test_a_job_from_a_hub_folder_names_it_and_its_exports_carry_its_tokenizer(clean_env, capsys, tmp_path):
    hub, out, exported = tmp_path / "hub", tmp_path / "out", tmp_path / "exported"
    _hub_folder(hub)
    args = [*TINY[1:], f"--model.path={hub}", f"--logging.output_dir={out}", "--checkpoint.save_hf=final"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert _block(printed)["model"] == [f"qwen3_moe from {hub} (model_type qwen3_moe)"]
    assert "no tokenizer" not in printed and "no generation_config" not in printed
    _check_usable(out / "hf/step_00000002")  # checkpoint.save_hf during the run

    # export-hf, also after the Hub folder moved: the checkpoint found the tokenizer's folder at start-up
    assert main(["export-hf", "--checkpoint", str(out / "checkpoints/step_00000002"), "--out", str(exported)]) == 0
    _check_usable(exported)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "hub", "out"]  # no staging folder left


def test_the_tokenizer_of_prepared_data_and_the_generation_config_of_token_ids(tmp_path):
    from moeshard.models.qwen3moe import get_preset_config
    from moeshard.train.config import load_config
    from moeshard.train.export import _add_generation_config, find_tokenizer

    tok, prepared = tmp_path / "tok", tmp_path / "prepared"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    prepared.mkdir()
    (prepared / "header.json").write_text(json.dumps({"format": "moeshard-tokens", "tokenizer": {"path": str(tok)}}))
    from_header = find_tokenizer(load_config(None, [f"--data.path={prepared}"]), None)
    assert from_header == (str(tok), "the prepared data's header")
    # data.tokenizer first; model.path last
    given = load_config(None, [f"--data.path={prepared}", f"--data.tokenizer={tok}"])
    assert find_tokenizer(given, None) == (str(tok), "data.tokenizer")
    assert find_tokenizer(load_config(None, []), str(tok)) == (str(tok), "model.path")
    assert find_tokenizer(load_config(None, []), str(tmp_path))[0] is None

    from transformers import GenerationConfig

    folder = tmp_path / "hf"
    folder.mkdir()
    assert _add_generation_config(folder, get_preset_config("tiny", eos_token_id=7), None) is None
    assert GenerationConfig.from_pretrained(folder).eos_token_id == 7
    why = _add_generation_config(tmp_path, get_preset_config("tiny"), None)
    assert why.startswith("no generation_config.json: the model config sets no bos/eos/pad token id")


def test_a_checkpoint_without_a_model_config_is_one_line(tmp_path):
    import torch.distributed.checkpoint as dcp

    from moeshard.train.export import export_hf

    src = tmp_path / "step_00000001"
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(src), no_dist=True)
    (src / "extra.json").write_text(json.dumps({"step": 1}))
    (src / "COMPLETE").write_text(json.dumps({"step": 1, "world_size": 1}))
    with pytest.raises(ValueError, match=r"records no model config: .* needs 'model_config'"):
        export_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    # A loop of one's own saved LoRA adapters without its options: which options it needs, not a missing base weight
    from moeshard.models.qwen3moe import get_preset_config

    lora = tmp_path / "step_00000002"
    dcp.save({"model": {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2)}}, checkpoint_id=str(lora))
    (lora / "extra.json").write_text(json.dumps({"step": 2, "model_config": get_preset_config("tiny").to_dict()}))
    (lora / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1}))
    with pytest.raises(ValueError, match=r"holds LoRA adapters but its extra records no 'lora': save with extra="):
        export_hf(lora, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_block_counts_sequence_groups_and_says_what_lora_trains(tmp_path):
    """Under sp the data-parallel degree is world / sp: the layout names the groups and the accumulation is per
    group; a LoRA job's line says what trains (the adapters' options, counts and parameters)."""
    import types

    from moeshard.lora import apply_lora
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config
    from moeshard.train.config import load_config
    from moeshard.train.run.startup import startup_block

    keys = ["--parallel.sp_size=2", "--parallel.ep_size=2", "--train.global_batch_size=8", "--train.micro_batch_size=1"]
    keys += ["--lora.rank=4", "--lora.target_modules=all-linear", "--data.seq_len=32"]
    cfg = load_config(None, keys)
    config = get_preset_config("tiny")
    with torch.device("meta"):
        adapters = apply_lora(Qwen3MoeForCausalLM(config), cfg.lora)
    meshes = types.SimpleNamespace(world_size=8, ep_size=2, ep_fsdp_size=4)
    data = types.SimpleNamespace(summary=lambda: {"synthetic": {"tokens": 1024, "rows": 32}})
    text = startup_block(cfg, config, meshes, 4, data, torch.device("cpu"), tmp_path, adapters)
    block = {line[:12].strip(): line[12:] for line in text.splitlines()}
    assert (
        block["layout"]
        == "world 8 = 2 nodes x 4 ranks; ep 2, ep_fsdp 4; sp 2: 4 data-parallel groups of 2 ranks, each row split over one"
    )
    assert block["batch"] == "micro-batch 1 x 2 accumulation x 4 groups = 8 rows of 32 = 256 tokens per step, 60 steps"
    L, D, H, KV, Dh, r = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                          config.num_key_value_heads, config.head_dim, 4)  # fmt: skip
    per_layer = r * (D + H * Dh) + r * (D + KV * Dh) * 2 + r * (H * Dh + D)  # q, k and v, o: A [r, in], B [out, r]
    assert block["lora"] == (
        f"rank 4, alpha/r = 4; modules: all-linear; parameters: - ({4 * L} linear modules, 0 expert tensors); "
        f"{L * per_layer / 1e3:.1f}K trained, the base frozen"
    )
