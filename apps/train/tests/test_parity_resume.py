"""The job against transformers, resume, and resume at other layouts (gloo, in-process ranks).

One 4-rank run (2 "nodes" x 2, EP 2 x ep_fsdp 2) trains a transformers-saved tiny Qwen3-MoE on a mixture of two
JSONL sources of token ids (weights 3:1) of varying lengths without packing (padding, records longer than a row
split in two, uneven label counts per rank, the larger source wrapping into its next epoch); its losses must equal
a single-process transformers training on the same global batches (``moeshard.data.StepBatches``) within 1e-5.
The same ranks then resume its step-2 checkpoint (same layout: the same losses) and at EP 4 x 1; a 2-rank run
resumes it at EP 2 x 1. Each resumed model's full parameters equal the saved ones, its next losses equal the
uninterrupted run's, and so do the tokens seen per source. The checkpoint also exports to a Hub folder that
transformers loads with the same logits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from moeshard.meshes.testing import run_distributed

STEPS = 4
HPARAMS = [
    "--data.packing=false",
    "--data.seq_len=32",
    f"--train.steps={STEPS}",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=1",
    "--train.lr=1e-3",
    "--train.warmup_steps=2",
    "--train.min_lr=1e-4",
    "--train.weight_decay=0.01",
    "--train.betas=[0.9,0.95]",
    "--train.max_grad_norm=0.5",
    "--checkpoint.every_steps=2",
    "--checkpoint.keep_last=3",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


def _cfg(paths: dict, out: str, *extra: str):
    from moeshard.train.config import load_config

    return load_config(
        None,
        [
            f"--model.path={paths['hf']}",
            f"--data.sources=[{{path: {paths['a']}, weight: 3}}, {{path: {paths['b']}, weight: 1}}]",
            f"--data.tokenizer={paths['tok']}",
            *HPARAMS,
            f"--logging.output_dir={paths['root']}/{out}",
            *extra,
        ],
    )


def _full_params(job) -> dict[str, torch.Tensor] | None:
    """Full (unsharded) parameters on rank 0, from the layout-independent state dict (collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moeshard.fsdp_moe import get_state_dict

    sd = get_state_dict(job.model, job.optimizer)["model"]
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}
    return full if dist.get_rank() == 0 else None


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _four_ranks(paths: dict) -> dict:
    import os

    from moeshard.train.job import run_job as run

    step2 = f"{paths['root']}/a/checkpoints/step_00000002"
    a = run(_cfg(paths, "a"))
    b = run(_cfg(paths, "b", f"--checkpoint.resume={step2}"))
    os.environ["LOCAL_WORLD_SIZE"] = "4"  # one node of 4: EP 4 x ep_fsdp 1
    loaded = run(_cfg(paths, "c0", "--parallel.ep_size=4", "--train.steps=2", f"--checkpoint.resume={step2}"))
    c = run(_cfg(paths, "c", "--parallel.ep_size=4", f"--checkpoint.resume={step2}"))
    return {
        "a": a["losses"],
        "b": (b["start_step"], b["losses"]),
        "c": (c["start_step"], c["losses"]),
        "c_params": _full_params(loaded["job"]),
        "layout_c": loaded["job"].meshes.describe(),
    }


def _two_ranks(paths: dict) -> dict:
    from moeshard.train.errors import CheckpointSaveError
    from moeshard.train.job import run_job as run

    step2 = f"{paths['root']}/a/checkpoints/step_00000002"
    loaded = run(_cfg(paths, "d0", "--parallel.ep_size=2", "--train.steps=2", f"--checkpoint.resume={step2}"))
    d = run(_cfg(paths, "d", "--parallel.ep_size=2", f"--checkpoint.resume={step2}"))
    # A full disk on rank 1 while saving step 4: every rank raises, step 2 stays the newest complete checkpoint.
    import os

    os.environ["MOESHARD_FAULT"] = "enospc:1:during_save:4"
    try:
        run(_cfg(paths, "e"))
        error = None
    except CheckpointSaveError as e:
        error = str(e)
    finally:
        del os.environ["MOESHARD_FAULT"]
    return {"d": (d["start_step"], d["losses"]), "d_params": _full_params(loaded["job"]), "enospc": error}


def _reference_losses(paths: dict) -> tuple[list[float], list[float], dict[str, int]]:
    """Single-process transformers training on the same global batches (loss = token-loss sum / label tokens);
    also the tokens each source gave."""
    from transformers import Qwen3MoeForCausalLM

    from moeshard.data import StepBatches, open_dataset
    from moeshard.train.run import lr_at

    cfg = _cfg(paths, "unused")
    model = Qwen3MoeForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    model.train()
    mc = model.config
    data = open_dataset(
        cfg.data, vocab_size=mc.vocab_size, eos_id=mc.eos_token_id, pad_id=getattr(mc, "pad_token_id", None)
    )
    batches = StepBatches(data, global_batch=8, world_size=1, micro_batch=8)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / t.lr)
    losses, norms = [], []
    for step in range(STEPS):
        b = batches.global_batch(step)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
        targets = b.labels[:, 1:]
        n = (targets != -100).sum()
        loss = (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            )
            / n
        )
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, batches.tokens_per_source(0, STEPS)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    from moeshard.models.qwen3moe import get_preset_config

    root = tmp_path_factory.mktemp("parity")
    torch.manual_seed(0)
    config = get_preset_config("tiny", num_hidden_layers=2, router_aux_loss_coef=0.0)
    Qwen3MoeForCausalLM(config).save_pretrained(root / "hf")
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(100)}, "[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(root / "tok")
    rng = random.Random(0)
    for name, n in (("a", 14), ("b", 8)):
        records = [{"input_ids": [rng.randrange(512) for _ in range(rng.randint(3, 45))]} for _ in range(n)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    files = {"hf": root / "hf", "a": root / "a.jsonl", "b": root / "b.jsonl", "tok": root / "tok", "root": root}
    return {k: str(v) for k, v in files.items()}


def test_parity_resume_layouts_export(paths):
    from transformers import AutoModelForCausalLM

    from moeshard.train.export import export_hf, load_full_model

    four = run_distributed(_four_ranks, 4, paths, ranks_per_node=2, timeout=400)[0]
    ref_losses, ref_norms, ref_tokens = _reference_losses(paths)
    root = Path(paths["root"])

    # Equal to transformers: losses within 1e-5 relative, gradient norms (before clipping) close too.
    assert four["a"] == pytest.approx(ref_losses, rel=1e-5)
    norms = [r["grad_norm"] for r in _metrics(root / "a/metrics.jsonl")]
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert max(ref_norms) > 0.5  # clipping was active

    # Tokens seen per source: all ranks, padding excluded, and counted on across a resume at another layout.
    assert _metrics(root / "a/metrics.jsonl")[-1]["tokens_seen"] == ref_tokens and set(ref_tokens) == {"a", "b"}
    assert _metrics(root / "c/metrics.jsonl")[-1]["tokens_seen"] == ref_tokens
    # Resumed at the same layout: the same losses as uninterrupted.
    assert four["b"][0] == 2 and four["b"][1] == pytest.approx(four["a"][2:], rel=1e-6)
    # Resumed at EP 4 x 1: the saved parameters exactly, then the same training.
    assert "ep 4 x ep_fsdp 1" in four["layout_c"]
    saved, _ = load_full_model(root / "a/checkpoints/step_00000002")
    for name, value in saved.state_dict().items():
        assert torch.equal(four["c_params"][name], value), name
    assert four["c"][0] == 2 and four["c"][1] == pytest.approx(four["a"][2:], rel=1e-5)

    two = run_distributed(_two_ranks, 2, paths, timeout=300)[0]
    for name, value in saved.state_dict().items():
        assert torch.equal(two["d_params"][name], value), name
    assert two["d"][0] == 2 and two["d"][1] == pytest.approx(four["a"][2:], rel=1e-5)
    # Out of disk space while saving: one clear error, the previous checkpoint survives, nothing half-published.
    assert "saving the checkpoint of step 4 failed (rank 1: OSError" in two["enospc"]
    assert "No space left on device" in two["enospc"]
    ckpts = sorted(p.name for p in (root / "e/checkpoints").iterdir())
    assert ckpts == ["step_00000002"] and (root / "e/checkpoints/step_00000002/COMPLETE").is_file()

    # export-hf: transformers loads the Hub folder; its logits equal our model's; the tokenizer came along.
    from moeshard.train.__main__ import main

    out = root / "export"
    step4 = str(root / "a/checkpoints/step_00000004")
    assert main(["export-hf", "--checkpoint", step4, "--out", str(out), "--dtype", "float32"]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    ours, _ = load_full_model(root / "a/checkpoints/step_00000004")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exists and is not an empty folder; nothing was overwritten"):
        export_hf(root / "a/checkpoints/step_00000004", out)


# ---- packed SFT rows, raw and prepared ----------------------------------------------------------------------------


def _packed_runs(paths: dict, sft: dict) -> dict:
    from moeshard.train.job import run_job

    base = [*HPARAMS, "--data.packing=true", "--train.steps=2", "--train.global_batch_size=4"]
    base += ["--train.micro_batch_size=2", "--parallel.ep_size=1", "--checkpoint.every_steps=0"]
    base += [f"--model.path={paths['hf']}"]

    def run(data: str, out: str) -> list[float]:
        from moeshard.train.config import load_config

        cfg = load_config(None, [*base, f"--data.path={data}", f"--logging.output_dir={sft['root']}/{out}"])
        return run_job(cfg)["losses"]

    return {"raw": run(sft["jsonl"], "raw"), "prepared": run(sft["prepared"], "prepared")}


def test_prepare_data_then_packed_sft_rows_match_transformers_per_document(paths, tmp_path):
    """``prepare-data`` -> training on the prepared folder: the same losses as on the raw JSONL; packed rows of
    ``input_ids`` + ``labels`` records (prompt masked): the first step's loss is transformers' on each document
    piece alone, over the answer tokens only (the job gives the model ``position_ids`` and ``document_ids``)."""
    import torch.nn.functional as F
    from transformers import Qwen3MoeForCausalLM

    from moeshard.data import DataConfig, StepBatches, open_dataset
    from moeshard.train.__main__ import main

    rng = random.Random(1)
    records = []
    for _ in range(24):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 12))]
        answer = [rng.randrange(512) for _ in range(rng.randint(1, 30))]
        records.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    prepared = tmp_path / "prepared"
    args = ["--input", str(jsonl), "--output", str(prepared), "--no-eos", "--workers", "1", "--vocab-size", "512"]
    assert main(["prepare-data", *args]) == 0
    sft = {"jsonl": str(jsonl), "prepared": str(prepared), "root": str(tmp_path)}
    runs = run_distributed(_packed_runs, 1, paths, sft)[0]
    assert runs["prepared"] == runs["raw"]

    # transformers, one document piece at a time (positions from 0), the loss over the labelled tokens only
    model = Qwen3MoeForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    rows = open_dataset(DataConfig(path=str(prepared), seq_len=32), vocab_size=512)
    b = StepBatches(rows, global_batch=4, world_size=1, micro_batch=4).global_batch(0)
    total, count, unmasked, pieces = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for ids, labels, docs in zip(b.input_ids, b.labels, b.document_ids):
            pieces += len(docs.unique())
            for d in docs.unique():
                at = docs == d
                logits = model(input_ids=ids[at][None]).logits[0, :-1]
                total += float(F.cross_entropy(logits, labels[at][1:], ignore_index=-100, reduction="sum"))
                count += int((labels[at][1:] != -100).sum())
            logits = model(input_ids=ids[None]).logits[0, :-1]  # the whole row, as one causal sequence
            unmasked += float(F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum"))
    assert count == b.num_targets and int((b.labels == -100).sum()) > pieces  # prompts are no targets
    assert runs["raw"][0] == pytest.approx(total / count, rel=1e-5)
    # Without the document mask the loss differs by far more than the tolerance (a random model uses little context).
    assert abs(unmasked - total) / total > 1e-4


# ---- validation, and the balancing state across a resume ----------------------------------------------------------

BALANCING = [
    "--parallel.ep_size=2",
    "--train.aux_loss.coef=0.01",
    "--train.aux_loss.scope=global_batch",
    "--train.router_bias.update_rate=0.01",
    "--train.z_loss_coef=0.001",
    "--eval.max_batches=0",
    "--eval.every_steps=2",
    "--train.steps=3",  # 3 bias updates: every bias is an odd multiple of the rate, never 0
]


def _eval_runs(paths: dict) -> dict:
    import torch.distributed as dist

    from moeshard.models.qwen3moe import routers
    from moeshard.train.job import run_job as run

    evaluated = [*BALANCING, f"--eval.path={paths['b']}"]
    a = run(_cfg(paths, "val_a", *evaluated))
    step2 = f"{paths['root']}/val_a/checkpoints/step_00000002"
    b = run(_cfg(paths, "val_b", *evaluated, f"--checkpoint.resume={step2}"))
    return {
        "rank": dist.get_rank(),
        "a": a["losses"],
        "val_a": a["val"],
        "b": (b["start_step"], b["losses"], b["val"]),
        "biases": torch.stack([r.bias for r in routers(a["job"].model)]),
    }


def test_eval_at_step_0_equals_transformers_and_balancing_resumes_exactly(paths):
    """Two ranks, EP 2, uneven eval rows (the last global batch is partly filler rows): the validation loss before
    any update is transformers' mean token loss over the eval set; training with the global-batch aux loss, the
    router bias and the z-loss resumes exactly (the biases are in the checkpoint) and the biases are the same on
    every rank."""
    import torch.distributed.checkpoint as dcp
    from transformers import Qwen3MoeForCausalLM

    from moeshard.data import StepBatches, open_dataset
    from moeshard.train.run.data import eval_data_config

    out = run_distributed(_eval_runs, 2, paths, timeout=400)
    r0 = out[0]
    # the reference: transformers on every eval row at once (right-padded rows, the attention mask)
    cfg = _cfg(paths, "unused", *BALANCING, f"--eval.path={paths['b']}")
    model = Qwen3MoeForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    mc = model.config
    rows = open_dataset(eval_data_config(cfg), vocab_size=mc.vocab_size, eos_id=mc.eos_token_id, pad_id=None)
    assert rows.num_rows % 8 and rows.num_rows > 8  # a partial last global batch
    n = rows.num_rows
    b = StepBatches(rows, global_batch=n, world_size=1, micro_batch=n).global_batch(0)  # every row once
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    targets = b.labels[:, 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    steps, losses = zip(*r0["val_a"])
    assert steps == (0, 2, 3) and losses[0] == pytest.approx(float(want), rel=1e-5)
    val = [json.loads(x) for x in (Path(paths["root"]) / "val_a/metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 2, 3] and {r["val_tokens"] for r in val} == {int((targets != -100).sum())}
    # the balancing state resumes exactly: same losses, same evaluation at step 3
    assert r0["b"][0] == 2 and r0["b"][1] == pytest.approx(r0["a"][2:], rel=1e-6)
    assert r0["b"][2] == [(3, pytest.approx(losses[2], rel=1e-6))]
    stored = dcp.FileSystemReader(f"{paths['root']}/val_a/checkpoints/step_00000002").read_metadata()
    assert "model.model.layers.0.mlp.gate.bias" in stored.state_dict_metadata
    # aux-loss-free balancing moved the biases, identically on both ranks (from the same global counts)
    assert torch.equal(out[0]["biases"], out[1]["biases"]) and out[0]["biases"].abs().min() >= 0.01 - 1e-6
