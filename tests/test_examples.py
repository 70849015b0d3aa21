"""The examples compose the packages without ``moeshard.train`` and get the same numbers as the app / one process.

- ``examples/custom_trainer.py`` under torchrun (4 CPU ranks, ``build_meshes(ep_size=2, ranks_per_node=2)``) gives
  the per-step losses and gradient norms of ``moeshard-train`` run through its real entry point (``launch-local``,
  2 nodes x 2) on the same checkpoint, data and hyper-parameters; for every family's tiny folder it takes the app's
  steps on 2 ranks, and the same steps again at ``--sp-size 2`` on 4 (LoRA too, beside the app's LoRA job at sp 2);
- ``examples/toy_moe.py`` (a MoE with other module names) on 4 ranks gives the losses and gradients of the plain
  module in one process.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from moeshard.meshes.testing import run_side_by_side

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT = 300

# One config for both: moeshard.data's rows (document-masked packing, no shuffle), a constant lr without warm-up,
# gradient accumulation (2 micro-batches per rank), a clipping threshold the gradients exceed, aux-loss-free
# expert balancing (router bias), and a held-out loss after the last step.
HYPER = dict(seq_len=24, global_batch=8, micro_batch=1, steps=4, lr=3e-3, weight_decay=0.01, max_grad_norm=0.5)
ROUTER_BIAS = 0.01
APP_CONFIG = f"""
parallel: {{ep_size: 2, prefetch_depth: 1}}
data: {{shuffle: false, seq_len: {HYPER["seq_len"]}}}
train:
  steps: {HYPER["steps"]}
  global_batch_size: {HYPER["global_batch"]}
  micro_batch_size: {HYPER["micro_batch"]}
  lr: {HYPER["lr"]}
  warmup_steps: 0
  schedule: constant
  weight_decay: {HYPER["weight_decay"]}
  betas: [0.9, 0.95]
  max_grad_norm: {HYPER["max_grad_norm"]}
  router_bias: {{update_rate: {ROUTER_BIAS}}}
eval: {{every_steps: 0, at_start: false, max_batches: 0}}
checkpoint: {{resume: none}}
logging: {{tensorboard: false, progress_bar: false, expert_load_every: 0}}
"""


def _run(*cmds: list[str], cwd: Path) -> None:
    """Run ``cmds`` side by side (independent jobs: their start-ups overlap); each must succeed."""
    for cmd, res in zip(cmds, run_side_by_side(*cmds, timeout=TIMEOUT, cwd=cwd, env=ENV)):
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}"


def _torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny HF checkpoint and JSONL data, written by examples/make_tiny_inputs.py."""
    spec = importlib.util.spec_from_file_location("_make_tiny_inputs", EXAMPLES / "make_tiny_inputs.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    out = tmp_path_factory.mktemp("tiny")
    make.write_model(out / "model")
    make.write_data(out / "data.jsonl", seq_len=HYPER["seq_len"])
    return out


def _imports(script: Path) -> set[str]:
    tree = ast.parse(script.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_examples_do_not_use_the_app_and_the_toy_not_the_model():
    for script in sorted(EXAMPLES.glob("*.py")):
        assert not any(m == "moeshard.train" or m.startswith("moeshard.train.") for m in _imports(script)), script
    assert not any(m.startswith("moeshard.models") for m in _imports(EXAMPLES / "toy_moe.py"))


@pytest.mark.slow
def test_custom_trainer_matches_the_app(tiny, tmp_path):
    (tmp_path / "app.yaml").write_text(APP_CONFIG)
    app_out = tmp_path / "app"
    losses_file, ckpt = tmp_path / "example_losses.json", tmp_path / "example_ckpt"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in HYPER.items()]
    _run(
        [
            sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "2", "--nproc-per-node", "2", "--",
            "--config", str(tmp_path / "app.yaml"), f"--data.path={tiny / 'data.jsonl'}",
            f"--model.path={tiny / 'model'}", f"--logging.output_dir={app_out}", f"--eval.path={tiny / 'data.jsonl'}",
        ],
        _torchrun(
            4, EXAMPLES / "custom_trainer.py", f"--model={tiny / 'model'}", f"--data={tiny / 'data.jsonl'}",
            "--ep-size=2", "--ranks-per-node=2", *flags, f"--losses={losses_file}", f"--checkpoint={ckpt}",
            f"--router-bias={ROUTER_BIAS}", f"--eval-data={tiny / 'data.jsonl'}",
        ),
        cwd=tmp_path,
    )  # fmt: skip
    records = [json.loads(line) for line in (app_out / "metrics.jsonl").read_text().splitlines()]
    app = [r for r in records if "loss" in r]
    app_eval = [r for r in records if "val_loss" in r]
    example = json.loads(losses_file.read_text())

    assert [m["step"] for m in app] == list(range(1, HYPER["steps"] + 1))
    assert example["loss"] == pytest.approx([m["loss"] for m in app], rel=1e-5)
    assert example["grad_norm"] == pytest.approx([m["grad_norm"] for m in app], rel=1e-4)
    assert max(example["grad_norm"]) > HYPER["max_grad_norm"], "pick a threshold that clipping acts on"
    assert [r["step"] for r in app_eval] == [HYPER["steps"]]
    assert example["val_loss"] == pytest.approx(app_eval[0]["val_loss"], rel=1e-5)
    # the checkpoint of moeshard.checkpoint.save_checkpoint, published atomically
    assert (ckpt / f"step_{HYPER['steps']:08d}/COMPLETE").is_file() and (
        ckpt / f"step_{HYPER['steps']:08d}/.metadata"
    ).is_file()


def test_custom_trainer_checkpoint_exports_to_a_hub_folder(tiny, tmp_path, capsys):
    """The example's checkpoint (one rank, one step) becomes a Hub folder with ``moeshard-train export-hf``:
    transformers loads it with the example's weights, and the write rate is not ``0.00 GB/s``."""
    import shutil

    from transformers import AutoModelForCausalLM, GenerationConfig

    from moeshard.train.__main__ import main
    from moeshard.train.export import load_full_model

    model = shutil.copytree(tiny / "model", tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "max_new_tokens": 9}))  # goes along
    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.json"
    cmd = _torchrun(
        1, EXAMPLES / "custom_trainer.py", f"--model={model}", f"--data={tiny / 'data.jsonl'}",
        "--ep-size=1", "--steps=1", "--global-batch=2", f"--losses={losses}", f"--checkpoint={ckpt}",
    )  # fmt: skip
    (res,) = run_side_by_side(cmd, timeout=TIMEOUT, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.stderr[-4000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("checkpoint ")]
    assert "0.00 GB/s" not in line and line.endswith(("B/s per rank", "- per rank")), line

    src = ckpt / "step_00000001"
    assert main(["export-hf", "--checkpoint", str(src), "--out", str(tmp_path / "hf"), "--dtype=float32"]) == 0
    said = capsys.readouterr().out
    assert f"{tmp_path / 'hf'}: no tokenizer: the run names none" in said  # the tiny model folder has none
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert GenerationConfig.from_pretrained(tmp_path / "hf").max_new_tokens == 9
    ours, job_config = load_full_model(src)
    assert job_config is None  # not a moeshard-train checkpoint
    ids = torch.randint(0, theirs.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


LORA = dict(
    rank=4, alpha=8, modules=("q_proj", "o_proj"), experts=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
)
LORA_APP_CONFIG = (
    APP_CONFIG.replace(f"  router_bias: {{update_rate: {ROUTER_BIAS}}}\n", "")
    .replace("lr: 0.003", "lr: 0.02")
    .replace(f"steps: {HYPER['steps']}", "steps: 3")
    + f"lora: {{rank: {LORA['rank']}, alpha: {LORA['alpha']}, target_modules: [{', '.join(LORA['modules'])}], "
    f"target_parameters: [{', '.join(LORA['experts'])}]}}\n"
)


@pytest.mark.slow
def test_custom_trainer_with_lora_matches_the_app(tiny, tmp_path):
    """``--lora-*`` (moeshard.lora's public API) on 2 CPU ranks, EP 2: the app's LoRA job on the same checkpoint,
    data and hyper-parameters takes the same steps, and the two PEFT folders hold the same adapters."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    assert "router_bias" not in LORA_APP_CONFIG and "lr: 0.02" in LORA_APP_CONFIG and "steps: 3" in LORA_APP_CONFIG
    (tmp_path / "app.yaml").write_text(LORA_APP_CONFIG)
    app_out, losses_file, adapter = tmp_path / "app", tmp_path / "example_losses.json", tmp_path / "example_adapter"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**HYPER, "steps": 3, "lr": 0.02}.items()]
    _run(
        [
            sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "1", "--nproc-per-node", "2", "--",
            "--config", str(tmp_path / "app.yaml"), f"--data.path={tiny / 'data.jsonl'}",
            f"--model.path={tiny / 'model'}", f"--logging.output_dir={app_out}",
        ],
        _torchrun(
            2, EXAMPLES / "custom_trainer.py", f"--model={tiny / 'model'}", f"--data={tiny / 'data.jsonl'}",
            "--ep-size=2", "--ranks-per-node=2", *flags, f"--losses={losses_file}", f"--lora-rank={LORA['rank']}",
            f"--lora-alpha={LORA['alpha']}", "--lora-modules", *LORA["modules"], "--lora-experts", *LORA["experts"],
            f"--adapter={adapter}", f"--checkpoint={tmp_path / 'example_ckpt'}",
        ),
        cwd=tmp_path,
    )  # fmt: skip
    app = [json.loads(line) for line in (app_out / "metrics.jsonl").read_text().splitlines()]
    app = [r for r in app if "loss" in r]
    example = json.loads(losses_file.read_text())
    assert [m["step"] for m in app] == [1, 2, 3]
    assert example["loss"] == pytest.approx([m["loss"] for m in app], rel=1e-5)
    assert example["grad_norm"] == pytest.approx([m["grad_norm"] for m in app], rel=1e-4)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and sorted(config["target_parameters"]) == sorted(LORA["experts"])
    ours, theirs = (
        load_file(str(adapter / "adapter_model.safetensors")),
        load_file(str(app_out / "adapter" / "adapter_model.safetensors")),
    )
    assert ours.keys() == theirs.keys() and any("experts" in k for k in ours)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-6, msg=k)
    assert any(v.abs().sum() > 0 for k, v in ours.items() if "lora_B" in k)  # trained (B starts at zero)
    # --checkpoint holds the adapters and their optimizer state, as the app's LoRA checkpoints do: no base weight.
    meta = dcp.FileSystemReader(tmp_path / "example_ckpt" / "step_00000003").read_metadata()
    model_keys = {k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")}
    adapters = {k.removeprefix("base_model.model.").replace(".weight", "") for k in ours}
    experts = {k for k in model_keys if "experts" in k}
    assert model_keys - experts == {k for k in adapters if "experts" not in k}  # the linear modules' A and B
    assert experts and all(k.endswith(("_lora_A", "_lora_B")) for k in experts)  # the fused experts' A and B
    state_keys = [k for k in meta.state_dict_metadata if k.startswith("optimizer.state.")]
    assert state_keys and all("lora_" in k for k in state_keys)
    # export-hf knows it as a LoRA checkpoint (its extra records the options): the same adapter, or merged
    from moeshard.train.__main__ import main

    ckpt = tmp_path / "example_ckpt" / "step_00000003"
    assert main(["export-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "adapter_model.safetensors"))
    assert exported.keys() == ours.keys() and all(torch.equal(exported[k], ours[k]) for k in ours)
    assert main(["export-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merge-lora"]) == 0
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.slow
def test_toy_moe_matches_one_process(tmp_path):
    _run(
        [sys.executable, str(EXAMPLES / "toy_moe.py"), f"--out={tmp_path / 'one.pt'}"],
        _torchrun(4, EXAMPLES / "toy_moe.py", "--ranks-per-node=2", f"--out={tmp_path / 'four.pt'}"),
        cwd=tmp_path,
    )
    one, four = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "four.pt")
    assert four["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert sorted(four["grads"]) == sorted(one["grads"])
    assert any(".ffn.routed.w_in" in fqn for fqn in one["grads"])
    for fqn, grad in one["grads"].items():
        torch.testing.assert_close(four["grads"][fqn], grad, rtol=1e-4, atol=1e-6, msg=fqn)


def _example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_trainer_knows_every_family_the_app_trains():
    """The example picks its family by the folder's ``model_type`` through each family package's ``FAMILY``: every
    ``model_type`` the app trains (the Hub's Qwen3.5-MoE vision-language folders too), each to its family."""
    from moeshard.train.families import FAMILIES, get_family

    families = _example_module("custom_trainer").FAMILIES
    assert set(families) == set(FAMILIES)
    for model_type, family in families.items():
        assert family is get_family(model_type), model_type
        assert model_type == family.name or family.hf_format.layout_of(model_type) is not None


SP_HYPER = {**HYPER, "steps": 3}


@pytest.mark.slow
# Qwen3-MoE's example against the app is test_custom_trainer_matches_the_app, its sp 2 against sp 1 the LoRA test
# below: the suite's time goes to the families nothing else runs through the example.
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe_text", "gpt_oss"])
def test_custom_trainer_every_family_matches_the_app_and_sp2_matches_sp1(family, tmp_path):
    """For each family's tiny folder (``make_tiny_inputs.py --family``): the example on 2 ranks (EP 2) takes the
    app's steps (``launch-local``, one node of 2, the same folder, data and hyper-parameters), and at ``--sp-size 2``
    on 4 ranks (each row split over a sequence group of 2; the same 2 data-parallel groups) the same steps again."""
    make = _example_module("make_tiny_inputs")
    model, data = make.write_model(tmp_path / "model", family=family), make.write_data(tmp_path / "data.jsonl")
    assert json.loads((model / "config.json").read_text())["model_type"] == family
    (tmp_path / "app.yaml").write_text(APP_CONFIG.replace(f"steps: {HYPER['steps']}", f"steps: {SP_HYPER['steps']}"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SP_HYPER.items()]
    common = [f"--model={model}", f"--data={data}", "--ep-size=2", "--ranks-per-node=2", *flags]
    common += [f"--router-bias={ROUTER_BIAS}", f"--eval-data={data}"]
    _run(
        [
            sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "1", "--nproc-per-node", "2", "--",
            "--config", str(tmp_path / "app.yaml"), f"--data.path={data}", f"--model.path={model}",
            f"--logging.output_dir={tmp_path / 'app'}", f"--eval.path={data}",
        ],
        _torchrun(2, EXAMPLES / "custom_trainer.py", *common, f"--losses={tmp_path / 'sp1.json'}"),
        _torchrun(4, EXAMPLES / "custom_trainer.py", *common, "--sp-size=2", f"--losses={tmp_path / 'sp2.json'}"),
        cwd=tmp_path,
    )  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "app" / "metrics.jsonl").read_text().splitlines()]
    app, app_eval = [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]
    sp1, sp2 = (json.loads((tmp_path / f"sp{n}.json").read_text()) for n in (1, 2))
    assert [m["step"] for m in app] == list(range(1, SP_HYPER["steps"] + 1))
    for example in (sp1, sp2):
        assert example["loss"] == pytest.approx([m["loss"] for m in app], rel=1e-5)
        assert example["grad_norm"] == pytest.approx([m["grad_norm"] for m in app], rel=1e-4)
        assert example["val_loss"] == pytest.approx(app_eval[0]["val_loss"], rel=1e-5)
        # aux-loss-free balancing sees the same global expert load at either sp (each token counted once)
        assert example["expert_load_max_over_mean"] == pytest.approx(sp1["expert_load_max_over_mean"], rel=1e-6)


def _optimizer_moments(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The AdamW first moments (``exp_avg``: a running mean of the gradients) in a DCP checkpoint, by parameter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.parent / "state.pt")
    state = torch.load(checkpoint.parent / "state.pt", weights_only=False)
    moments = {name: entry["exp_avg"] for name, entry in state["optimizer"]["state"].items()}
    assert moments and all("lora_" in name for name in moments)  # the adapters' state only: the base is frozen
    return moments


@pytest.mark.slow
def test_custom_trainer_lora_under_sequence_parallelism_matches_sp1(tiny, tmp_path):
    """A LoRA job (linear modules and fused experts) at ``--sp-size 2`` (4 ranks, EP 2) takes the steps of the same
    job at sp 1 (2 ranks, EP 2): the same losses and gradient norms, the same adapter gradients (AdamW's first
    moments in the checkpoint after 2 steps) and the same adapters written in PEFT's format; so does the app's LoRA
    job at ``parallel.sp_size: 2`` (``launch-local``, one node of 4)."""
    from safetensors.torch import load_file

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**HYPER, "steps": 2, "lr": 0.02}.items()]
    lora = [f"--lora-rank={LORA['rank']}", f"--lora-alpha={LORA['alpha']}", "--lora-modules", *LORA["modules"]]
    common = [f"--model={tiny / 'model'}", f"--data={tiny / 'data.jsonl'}", "--ep-size=2", "--ranks-per-node=2"]
    common += [*flags, *lora, "--lora-experts", *LORA["experts"]]
    runs = {
        sp: [f"--sp-size={sp}", f"--losses={tmp_path / f'sp{sp}.json'}", f"--adapter={tmp_path / f'adapter{sp}'}",
             f"--checkpoint={tmp_path / f'ckpt{sp}'}"]
        for sp in (1, 2)
    }  # fmt: skip
    app_config = LORA_APP_CONFIG.replace("steps: 3", "steps: 2").replace("{ep_size: 2,", "{ep_size: 2, sp_size: 2,")
    assert "sp_size: 2" in app_config and "steps: 2" in app_config
    (tmp_path / "app.yaml").write_text(app_config)
    app = [
        sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "1", "--nproc-per-node", "4", "--",
        "--config", str(tmp_path / "app.yaml"), f"--data.path={tiny / 'data.jsonl'}",
        f"--model.path={tiny / 'model'}", f"--logging.output_dir={tmp_path / 'app'}",
    ]  # fmt: skip
    examples = (_torchrun(2 * sp, EXAMPLES / "custom_trainer.py", *common, *extra) for sp, extra in runs.items())
    _run(app, *examples, cwd=tmp_path)
    sp1, sp2 = (json.loads((tmp_path / f"sp{sp}.json").read_text()) for sp in (1, 2))
    records = [json.loads(line) for line in (tmp_path / "app" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    app_sp2 = {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps]}
    for other in (sp2, app_sp2):
        assert other["loss"] == pytest.approx(sp1["loss"], rel=1e-5)
        assert other["grad_norm"] == pytest.approx(sp1["grad_norm"], rel=1e-4)

    m1, m2 = (_optimizer_moments(tmp_path / f"ckpt{sp}" / "step_00000002") for sp in (1, 2))
    assert m1.keys() == m2.keys() and any("experts" in k for k in m1) and any("q_proj" in k for k in m1)
    scale = max(float(m.abs().max()) for m in m1.values())
    for name, moment in m1.items():
        torch.testing.assert_close(m2[name], moment, rtol=1e-4, atol=1e-5 * scale, msg=name)

    a1, a2, a_app = (
        load_file(str(folder / "adapter_model.safetensors"))
        for folder in (tmp_path / "adapter1", tmp_path / "adapter2", tmp_path / "app" / "adapter")
    )
    assert any(v.abs().sum() > 0 for k, v in a1.items() if "lora_B" in k)  # trained (B starts at zero)
    for other in (a2, a_app):
        assert other.keys() == a1.keys()
        for name, weight in a1.items():
            # AdamW moves a weight by about lr whatever its gradient's size: where a gradient is near AdamW's eps,
            # its float32 rounding (another summation order across shards) moves the weight by a small part of lr.
            torch.testing.assert_close(other[name], weight, rtol=1e-4, atol=0.02 * 1e-2, msg=name)
