"""LoRA through the app: the tiny Qwen3-MoE (a Hub folder, ``model.path``) with adapters on attention and the fused
experts, trained on 4 gloo ranks as 2 nodes x 2 (EP 2 x ep_fsdp 2), resumed in one process, exported.

The run's ``adapter/`` loads in ``peft.PeftModel`` over transformers' model with our model's logits; its checkpoints
hold the adapters (and their optimizer) only and resume exactly at another layout; ``export-hf --merge-lora`` gives
a Hub folder transformers loads with PEFT's logits. Bad ``lora`` input is one line each.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.meshes.testing import run_distributed
from moeshard.train.__main__ import main
from moeshard.train.errors import ExitStatus

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=64, output_router_logits=False,
    router_aux_loss_coef=0.0,
)  # fmt: skip
LORA = [
    "--lora.rank=4",
    "--lora.alpha=8",
    "--lora.target_modules=[q_proj,o_proj]",
    "--lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
]
HPARAMS = [
    "--data.seq_len=16",
    "--data.synthetic_samples=256",
    "--train.steps=4",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=1",
    "--train.lr=2e-2",
    "--train.warmup_steps=1",
    "--train.weight_decay=0.0",
    "--checkpoint.every_steps=2",
    "--checkpoint.keep_last=3",
    "--eval.every_steps=0",
    "--eval.max_batches=1",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


def _save_tiny(path, seed: int = 1234) -> str:
    torch.manual_seed(seed)
    HFQwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("hf_tiny"))


def _cfg(hf: str, out: str, *extra: str):
    from moeshard.train.config import load_config

    return load_config(None, [f"--model.path={hf}", *LORA, *HPARAMS, f"--logging.output_dir={out}", *extra])


def _two_by_two(hf: str, root: str) -> dict:
    from moeshard.train.job import run_job

    result = run_job(_cfg(hf, f"{root}/a", "--checkpoint.save_hf=final"))
    job = result["job"]
    frozen = [p for p in job.model.parameters() if not p.requires_grad]
    trained = {id(p) for o in job.optimizer.optimizers for g in o.param_groups for p in g["params"]}
    return {
        "losses": result["losses"],
        "val": result["val"],
        "base_grads": sum(p.grad is not None for p in frozen),
        "trained_are_adapters": trained == {id(p) for p in job.adapters.parameters(job.model)},
    }


def _one_process(hf: str, root: str) -> dict:
    from moeshard.train.job import run_job

    step2 = f"{root}/a/checkpoints/step_00000002"
    result = run_job(_cfg(hf, f"{root}/b", "--parallel.ep_size=1", f"--checkpoint.resume={step2}"))
    return {"start": result["start_step"], "losses": result["losses"]}


def _ours_with(hf: str, adapter: str):
    from moeshard.lora import LoraOptions, apply_lora, load_adapter, read_adapter_options
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    options = read_adapter_options(adapter)
    ours = Qwen3MoeForCausalLM.from_pretrained(hf)
    adapters = apply_lora(ours, LoraOptions(**{**options.__dict__, "init_from": None}))
    adapters.load_state_dict(ours, load_adapter(adapter, adapters))
    return ours


def test_lora_job_2x2_trains_writes_peft_adapter_resumes_in_one_process_and_merges(hf_dir, tmp_path):
    peft = pytest.importorskip("peft", reason="loading the adapter in PEFT needs the `test` extra (peft)")
    root = str(tmp_path)
    four = run_distributed(_two_by_two, 4, hf_dir, root, ranks_per_node=2, timeout=400)[0]
    assert four["base_grads"] == 0 and four["trained_are_adapters"]
    (start, before), (end, after) = four["val"][0], four["val"][-1]
    assert (start, end) == (0, 4) and after < before - 1e-3  # the adapters learn
    # The checkpoints hold the adapters and their optimizer, no base weight.
    meta = torch.distributed.checkpoint.FileSystemReader(f"{root}/a/checkpoints/step_00000004").read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    assert any(k.startswith("optimizer.state.") and "lora_A" in k for k in meta.state_dict_metadata)
    # Resumed from step 2 in one process (EP 1): steps 3 and 4 as the 4-rank run took them.
    one = run_distributed(_one_process, 1, hf_dir, root, timeout=300)[0]
    assert one["start"] == 2
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(four["losses"][2:]), rtol=1e-5, atol=1e-5)

    adapter = tmp_path / "a" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == hf_dir
    # The same adapter beside the final checkpoint's Hub folder (checkpoint.save_hf).
    beside = load_file(str(tmp_path / "a" / "hf" / "step_00000004" / "adapter" / "adapter_model.safetensors"))
    stored = load_file(str(adapter / "adapter_model.safetensors"))
    assert beside.keys() == stored.keys() and all(torch.equal(beside[k], stored[k]) for k in stored)

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    base = HFQwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(base, str(adapter))(input_ids=ids).logits
        ours = _ours_with(hf_dir, str(adapter))(ids).logits
    assert (ours - plain).abs().max() > 1e-4  # the trained adapter changes the model
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # export-hf: the adapter by default, the merged Hub folder with --merge-lora.
    ckpt = f"{root}/a/checkpoints/step_00000004"
    assert main(["export-hf", "--checkpoint", ckpt, "--out", f"{root}/exp_adapter"]) == 0
    exported = load_file(f"{root}/exp_adapter/adapter_model.safetensors")
    assert all(torch.equal(exported[k], stored[k]) for k in stored)
    args = ["export-hf", "--checkpoint", ckpt, "--out", f"{root}/merged", "--dtype", "float32", "--merge-lora"]
    assert main(args) == 0
    merged = HFQwen3MoeForCausalLM.from_pretrained(f"{root}/merged", attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, theirs, rtol=1e-4, atol=1e-4)


def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == ExitStatus.USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _job_args(hf: str, tmp_path, *extra: str) -> list[str]:
    return [
        f"--model.path={hf}", *LORA, *HPARAMS, "--parallel.ep_size=1", f"--logging.output_dir={tmp_path / 'o'}", *extra
    ]  # fmt: skip


def test_a_lora_target_that_matches_nothing_is_one_line(capsys, clean_env, hf_dir, tmp_path):
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, "--lora.target_modules=[q_proj,qkv_proj]"))
    assert "lora.target_modules entry 'qkv_proj' matches no module" in line
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, "--lora.target_parameters=[mlp.experts.up_proj]"))
    assert "lora.target_parameters entry 'mlp.experts.up_proj' matches no parameter" in line
    assert not (tmp_path / "o").exists()  # nothing written


def test_an_unknown_lora_key_is_one_line(capsys, clean_env, hf_dir, tmp_path):
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, "--lora.targets=[q_proj]"))
    assert "unknown config key lora.targets" in line


def _adapter_folder(hf: str, folder, *, base_model: str | None = None, modules=("q_proj", "o_proj")) -> str:
    from moeshard.lora import LoraOptions, apply_lora, save_adapter
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(hf)
    options = LoraOptions(
        rank=4, alpha=8, target_modules=modules,
        target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    )  # fmt: skip
    adapters = apply_lora(model, options, seed=7)
    return str(save_adapter(folder, adapters, adapters.state_dict(model), base_model=base_model or hf))


def test_an_init_from_adapter_of_another_base_or_targets_is_one_line(capsys, clean_env, hf_dir, tmp_path):
    other = _adapter_folder(hf_dir, tmp_path / "other_base", base_model="/models/another-model")
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, f"--lora.init_from={other}"))
    assert "was trained on /models/another-model" in line
    fewer = _adapter_folder(hf_dir, tmp_path / "fewer", modules=("q_proj",))
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, f"--lora.init_from={fewer}"))
    assert "use the adapter's targets" in line
    # A folder whose tensors were made for a wider model: the shapes differ.
    wider = _adapter_folder(hf_dir, tmp_path / "wider")
    tensors = load_file(f"{wider}/adapter_model.safetensors")
    tensors = {k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, f"{wider}/adapter_model.safetensors")
    line = _one_line(capsys, _job_args(hf_dir, tmp_path, f"--lora.init_from={wider}"))
    assert "where this model needs" in line


def test_init_from_starts_the_job_from_the_folder(clean_env, hf_dir, tmp_path):
    """In this process (a world of one): the job's adapters before its first update are the folder's."""
    import torch.distributed as dist

    from moeshard.train.job import run_job

    folder = _adapter_folder(hf_dir, tmp_path / "start")
    extra = ("--parallel.ep_size=1", f"--lora.init_from={folder}", "--train.lr=1e-9", "--train.steps=1")
    cfg = _cfg(hf_dir, str(tmp_path / "o"), *extra)
    try:
        job = run_job(cfg)["job"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    want = load_file(f"{folder}/adapter_model.safetensors")
    got = load_file(str(tmp_path / "o" / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == want.keys()
    for k in want:  # one AdamW step of lr 1e-9 moves each value by about that
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-8)
    assert all(p.dtype == torch.float32 for p in job.adapters.parameters(job.model))
