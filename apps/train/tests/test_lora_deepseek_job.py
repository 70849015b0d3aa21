"""LoRA through the app on DeepSeek-V3: the tiny preset's model (a Hub folder saved by transformers) with adapters on
MLA's projections (``q_a_proj``, ``kv_b_proj``, ``o_proj``), the shared experts' linears and the fused routed experts,
trained on 4 gloo ranks as 2 nodes x 2 (EP 2 x ep_fsdp 2), then resumed in one process at EP 1.

The run's ``adapter/`` loads in ``peft.PeftModel`` over transformers' ``DeepseekV3ForCausalLM`` with our model's
logits. The other families' targets: each tiny model's attention and expert tensors resolve, and a name another
family uses is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeshard.lora import LoraOptions, apply_lora
from moeshard.meshes.testing import run_distributed

MLA_AND_SHARED = ("q_a_proj", "kv_b_proj", "o_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                  "shared_experts.down_proj")  # fmt: skip
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
LORA = [
    "--lora.rank=4",
    "--lora.alpha=8",
    f"--lora.target_modules=[{','.join(MLA_AND_SHARED)}]",
    f"--lora.target_parameters=[{','.join(EXPERTS)}]",
]


def _cfg(hf: str, out: str, *extra: str):
    from moeshard.train.config import load_config

    return load_config(
        None,
        [
            "--model.family=deepseek_v3",
            f"--model.path={hf}",
            *LORA,
            "--data.seq_len=16",
            "--data.synthetic_samples=256",
            "--train.steps=4",
            "--train.global_batch_size=8",
            "--train.micro_batch_size=1",
            "--train.lr=2e-2",
            "--train.warmup_steps=1",
            "--train.weight_decay=0.0",
            "--checkpoint.every_steps=2",
            "--eval.every_steps=0",
            "--eval.max_batches=1",
            "--logging.tensorboard=false",
            "--logging.progress_bar=false",
            "--logging.expert_load_every=0",
            f"--logging.output_dir={out}",
            *extra,
        ],
    )


def _two_by_two(hf: str, root: str) -> dict:
    from moeshard.train.job import run_job

    result = run_job(_cfg(hf, f"{root}/a"))
    job = result["job"]
    kinds = [t.kind for t in job.adapters.targets]
    return {
        "losses": result["losses"],
        "val": result["val"],
        "layout": job.meshes.describe(),
        "base_grads": sum(p.grad is not None for p in job.model.parameters() if not p.requires_grad),
        "targets": (kinds.count("linear"), kinds.count("experts")),
    }


def _one_process(hf: str, root: str) -> dict:
    from moeshard.train.job import run_job

    step2 = f"{root}/a/checkpoints/step_00000002"
    result = run_job(_cfg(hf, f"{root}/b", "--parallel.ep_size=1", f"--checkpoint.resume={step2}"))
    return {"start": result["start_step"], "losses": result["losses"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from transformers import DeepseekV3ForCausalLM

    from moeshard.models.deepseekv3 import get_preset_config

    root = tmp_path_factory.mktemp("deepseek_lora")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(get_preset_config("tiny", pad_token_id=0))
    with torch.no_grad():  # biases that change the selection, as a trained model's do
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(root / "hf")
    return str(root / "hf")


def test_deepseek_v3_lora_job_2x2_trains_writes_peft_adapter_and_resumes_in_one_process(hf_dir, tmp_path):
    peft = pytest.importorskip("peft", reason="loading the adapter in PEFT needs the `test` extra (peft)")
    from transformers import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

    from moeshard.lora import load_adapter, read_adapter_options
    from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM
    from moeshard.train.__main__ import main

    root = str(tmp_path)
    four = run_distributed(_two_by_two, 4, hf_dir, root, ranks_per_node=2, timeout=400)[0]
    assert "ep 2 x ep_fsdp 2" in four["layout"] and four["base_grads"] == 0
    # 3 layers x (q_a, kv_b, o) + 2 MoE layers x 3 shared-expert linears; 2 MoE layers x 2 fused tensors
    assert four["targets"] == (3 * 3 + 2 * 3, 2 * 2)
    (start, before), (end, after) = four["val"][0], four["val"][-1]
    assert (start, end) == (0, 4) and after < before - 1e-3  # the adapters learn
    one = run_distributed(_one_process, 1, hf_dir, root, timeout=300)[0]
    assert one["start"] == 2
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(four["losses"][2:]), rtol=1e-5, atol=1e-5)

    adapter = str(tmp_path / "a" / "adapter")
    config = json.loads((tmp_path / "a" / "adapter" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == set(MLA_AND_SHARED[:3])
    assert set(config["target_parameters"]) == {*EXPERTS, *(f"{m}.weight" for m in MLA_AND_SHARED[3:])}
    ids = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    options = read_adapter_options(adapter)
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    adapters = apply_lora(ours, LoraOptions(**{**options.__dict__, "init_from": None}))
    assert [t.kind for t in adapters.targets].count("linear") == four["targets"][0]
    tensors = load_adapter(adapter, adapters)
    adapters.load_state_dict(ours, tensors)
    with torch.no_grad():
        mine = ours(ids).logits
    # Every target, shared experts included: the merged Hub folder in transformers' model gives our logits.
    ckpt = f"{root}/a/checkpoints/step_00000004"
    args = ["export-hf", "--checkpoint", ckpt, "--out", f"{root}/merged", "--dtype", "float32", "--merge-lora"]
    assert main(args) == 0
    merged = HFDeepseekV3ForCausalLM.from_pretrained(f"{root}/merged", attn_implementation="sdpa", dtype=torch.float32)
    base = HFDeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, mine, rtol=1e-4, atol=1e-4)
    assert (mine - plain).abs().max() > 1e-4  # the trained adapter changes the model

    # Every target, the shared experts' linears included, loads in PEFT as written (they are named by their weights
    # in target_parameters, which PEFT on transformers 5 does not retarget onto the fused experts).
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
