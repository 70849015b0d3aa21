"""Your own training loop on moeshard's pieces (no ``moeshard.train``): EP + expert FSDP2 for any model family
(Qwen3-MoE, the DeepSeek-V3 architecture, Qwen3.5-MoE, GPT-OSS): the checkpoint's ``model_type`` picks it, through
each family package's ``FAMILY``.

    python examples/make_tiny_inputs.py /tmp/tiny        # --family deepseek_v3 | qwen3_5_moe_text | gpt_oss
    torchrun --nproc-per-node 4 examples/custom_trainer.py --model /tmp/tiny/model --data /tmp/tiny/data.jsonl \
        --ep-size 2 --ranks-per-node 2 --losses /tmp/tiny/losses.json        # CPU: 4 gloo ranks as 2 nodes x 2

Order of composition: meshes -> model on meta -> ``parallelize`` (EP plan -> expert-aware FSDP2 -> prefetch) ->
memory and weights -> ``build_optimizer`` -> the data (``moeshard.data``) -> the loop (zero_grad -> micro-batches
forward/backward -> clip -> step). The loss is the mean over every label token of the global batch: each rank
passes ``N_global / W`` as ``num_items_in_batch`` and FSDP averages gradients over the W ranks. Data: rows of
``seq_len`` tokens with document-masked packing (``position_ids`` restart in every document, ``document_ids`` keep
attention inside it); the global batch of step s is a pure function of s, rank r takes its contiguous share in
micro-batches (gradient accumulation), and a ``PrefetchLoader`` prepares the next steps in a background thread.
Optional: aux-loss-free expert balancing (``--router-bias RATE``: a selection bias per expert, moved after each step
from the step's global expert load) and a held-out loss at the end (``--eval-data``), both from the packages.

Sequence parallelism (Ulysses, ``--sp-size N``): N consecutive ranks of a node share each row, each holding
``seq_len / N`` contiguous tokens (``moeshard.models.common.model_inputs``, i.e. ``moeshard.sequence.shard_row``);
``parallelize`` runs every attention (and linear-attention mixer) on head shards of the whole row between two
all-to-alls. The data-parallel degree is then ``world / N``: the ranks of a sequence group read the same rows.

LoRA (``moeshard.lora``): ``--lora-rank 16 --lora-modules q_proj o_proj --lora-experts mlp.experts.gate_up_proj
mlp.experts.down_proj --adapter OUT`` freezes the base (held in the compute dtype, no gradient or optimizer state)
and trains adapters beside it, sharded with what they adapt (the EP plan slices the expert adapters with their
experts); ``OUT`` is written in PEFT's format (``peft.PeftModel.from_pretrained`` loads it). It composes with
``--sp-size``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from moeshard.checkpoint import model_state, save_checkpoint
from moeshard.data import DataConfig, EvalBatches, PrefetchLoader, StepBatches, open_dataset
from moeshard.ep import EPOptions
from moeshard.fsdp_moe import ExpertGradOptions, build_optimizer, num_items_for_global_mean
from moeshard.lora import LoraOptions, apply_lora, reset_adapters, save_adapter
from moeshard.meshes import build_meshes
from moeshard.models import deepseekv3, gptoss, qwen3moe, qwen35moe
from moeshard.models.common import (
    Balancing,
    BalancingOptions,
    ParallelOptions,
    evaluate,
    load_hf_weights,
    model_inputs,
    parallelize,
)

# model_type -> ModelFamily: each family's own name, and the other folders it loads from (Qwen3.5-MoE's Hub folders
# are vision-language ones, ``qwen3_5_moe``, whose language model is read), as its checkpoint format lists them.
FAMILIES = {
    model_type: family
    for family in (qwen3moe.FAMILY, deepseekv3.FAMILY, qwen35moe.FAMILY, gptoss.FAMILY)
    for model_type in (family.name, *(layout.model_type for layout in family.hf_format.layouts))
}


def print0(*args: object) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="A hand-written EP + expert-FSDP2 training loop for any MoE family.")
    p.add_argument("--model", type=Path, required=True, help="local HF checkpoint (config.json + safetensors)")
    p.add_argument("--data", required=True, help="JSONL/Parquet file, folder, glob or prepared folder (moeshard.data)")
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--no-packing", action="store_true", help="one padded document per row instead of packing")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--sp-size", type=int, default=1, help="sequence parallelism: ranks sharing each row (Ulysses)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--dispatch", choices=("overlapped", "all_to_all"), default="overlapped", help="EP token exchange")
    p.add_argument("--router-bias", type=float, default=0.0, help="aux-loss-free balancing: bias update rate")
    p.add_argument("--eval-data", default=None, help="held-out data (as --data): its loss after the last step")
    p.add_argument("--losses", type=Path, default=None, help="write the per-step losses here (JSON)")
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint folder: step_N/ written at the end")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA: the adapters' rank (0: train every weight)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA: the scaling's numerator (default: 2 x rank)")
    p.add_argument("--lora-modules", nargs="*", default=(), help="LoRA: linear modules (q_proj o_proj ...)")
    p.add_argument("--lora-experts", nargs="*", default=(), help="LoRA: fused expert tensors (mlp.experts.down_proj)")
    p.add_argument("--adapter", type=Path, default=None, help="LoRA: write the adapter here (PEFT's format)")
    args = p.parse_args()

    # 1. Process group and meshes: EP groups inside a node, expert FSDP across nodes; sequence groups (--sp-size)
    # are consecutive ranks inside a node too, and cut neither mesh.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(
        args.ep_size, device_type=device.type, ranks_per_node=args.ranks_per_node, sp_size=args.sp_size
    )
    # The rows are read by data-parallel rank: the ranks of a sequence group read the same rows, each its shard.
    dp_rank, dp_size, sp_rank = meshes.dp_rank, meshes.dp_size, meshes.sp_rank
    print0(meshes.describe())

    # 2. The model on meta (no memory), parallelised in one call: experts sliced on dim 0 to this EP rank's share
    # (EP), attention on head shards (sp > 1), then FSDP2 (experts: dim 1 over ep_fsdp; the rest: dim 0 over all
    # ranks), then the prefetch schedule.
    model_type = json.loads((args.model / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise SystemExit(f"{args.model}: model_type {model_type!r} is none of the families {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    config = family.load_config(args.model)
    with torch.device("meta"):
        model = family.model_class(config)
    adapters, lora = None, None
    if args.lora_rank:
        # Before parallelize, so the EP plan slices the expert adapters with their experts. The frozen base is held
        # in the compute dtype (bf16 on GPU): it needs no float32 master, gradient or optimizer state.
        lora = LoraOptions(
            rank=args.lora_rank,
            alpha=args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank,
            target_modules=tuple(args.lora_modules),
            target_parameters=tuple(args.lora_experts),
        )
        base_dtype = torch.bfloat16 if device.type == "cuda" else None
        adapters = apply_lora(model, lora, seed=0, base_dtype=base_dtype)
        print0(adapters.describe())
    options = ParallelOptions(
        ep=EPOptions(dispatch=args.dispatch), prefetch_depth=args.prefetch_depth, sp_size=args.sp_size
    )
    parallel = parallelize(model, meshes, options)
    print0("\n".join(options.describe()))

    # 3. Memory, then weights: every rank reads only the slices it holds.
    model.to_empty(device=device)
    load_hf_weights(model, args.model, ep_info=parallel.ep_info)  # ep_info: the experts this EP rank holds
    if adapters is not None:  # their values were lost on meta: each rank takes its share of the same initial ones
        reset_adapters(model, adapters, seed=0, ep_rank=parallel.ep_info.ep_rank)
    if args.router_bias:
        model.enable_router_bias()  # after the HF weights (their format has no bias), before any DCP load or save
    # AdamW for every trainable parameter (with LoRA: the adapters only; fused on GPU); experts kept out of FSDP (ep_fsdp of one rank) get one fused pass
    # from their compute-dtype gradients. One step(), zero_grad(), state_dict() and clip_grad_norm_() for all.
    # expert_grads: those experts' weight gradients kept over a step's micro-batches, formed once in the last.
    expert_grads = ExpertGradOptions(micro_batches=max(1, args.global_batch // dp_size // args.micro_batch))
    optimizer = build_optimizer(
        model, lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay, expert_grads=expert_grads
    )

    # 4. The data: rows of the model's tokens (EOS after each document), validated before training starts; the
    # micro-batches of (step, rank) are a pure function of both, so a resume needs only the step.
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id

    def rows_of(path: str):
        data = DataConfig(path=path, seq_len=args.seq_len, packing=not args.no_packing)
        return open_dataset(
            data, vocab_size=config.vocab_size, eos_id=eos, pad_id=getattr(config, "pad_token_id", None)
        )

    rows = rows_of(args.data)
    step_batches = StepBatches(rows, global_batch=args.global_batch, world_size=dp_size, micro_batch=args.micro_batch)
    # Expert balancing, one object with the hooks the loop calls: transformers' aux loss per micro-batch at the
    # model's coefficient and, with --router-bias, aux-loss-free selection biases moved after each step. Under
    # sequence parallelism its statistics are summed over the sequence group, so a row's tokens count once.
    options = BalancingOptions(aux_loss_coef=model.router_aux_loss_coef, router_bias_rate=args.router_bias or None)
    sequence_group = meshes.sp.get_group() if meshes.sp is not None else None
    balancing = Balancing(model, options, device=device, sequence_group=sequence_group)
    losses, grad_norms, imbalance = [], [], []
    # A background thread prepares the next steps' batches (in pinned memory on CUDA: the copies below are async).
    loader = PrefetchLoader(step_batches, dp_rank, start_step=0, stop_step=args.steps, pin_memory=device.type == "cuda")
    with loader:
        for step, micro_batches in loader:
            optimizer.zero_grad(set_to_none=True)
            # This rank's view of the rows: the whole rows at sp 1; else its shard of every row, with the targets
            # shifted before the split (a shard's last token predicts the next shard's first) and the whole row's
            # document ids and padding mask (attention sees the whole row after its all-to-all).
            inputs = [model_inputs(b, sp_rank=sp_rank, sp_size=args.sp_size) for b in micro_batches]
            # N_global / W: with it each rank's loss is W * (its token-loss sum) / N_global, and FSDP's average over
            # W ranks is the global-batch mean however unevenly label tokens fall on ranks (or shards).
            num_items = num_items_for_global_mean(sum(i.num_targets for i in inputs)).clamp_min(1.0 / world)
            lm_sum = torch.zeros((), device=device)
            balancing.start_step(len(inputs))
            for i in inputs:
                i = i.to(device, non_blocking=True)
                # kwargs: input_ids; labels (-100: not a target: prompt tokens of SFT records, padding, document
                # starts), or a shard's shift_labels; position_ids (restart at 0 in every document of a packed row);
                # document_ids (a token attends to the earlier tokens of its own document only); attention_mask
                # (None unless rows are padded: --no-packing).
                # return_logits=False: the loss goes through the head in chunks, never holding the [B, S, V] logits.
                out = model(**i.kwargs, num_items_in_batch=num_items, output_router_logits=True, return_logits=False)
                # The LM loss plus the balancing term (the aux loss, a per-micro-batch mean, averaged over the step).
                (out.lm_loss + balancing.micro_batch_loss(out, i.token_mask, rows=i.rows)).backward()
                lm_sum += out.lm_loss.detach()
            # One norm over both meshes (a device tensor, no host sync); the step may apply the clip coefficient.
            grad_norm = optimizer.clip_grad_norm_(args.max_grad_norm)
            load_LE = balancing.end_step().expert_load  # one all-reduce of [layers, experts]: the same on every rank
            optimizer.step()
            balancing.after_optimizer_step()  # --router-bias: identical biases on every rank
            imbalance.append((load_LE.max(-1).values / load_LE.mean(-1)).max().item())
            dist.all_reduce(lm_sum)
            losses.append(lm_sum.item() / world)
            grad_norms.append(grad_norm.item())
            print0(
                f"step {step + 1}: loss {losses[-1]:.6f} grad_norm {grad_norms[-1]:.4f} "
                f"expert load max/mean {imbalance[-1]:.2f}"
            )

    # 5. A held-out loss: the mean over every predicted token of the eval rows on all ranks (every rank runs the
    # same number of forwards, so EP's exchanges pair up even when ranks hold different token counts; under
    # sequence parallelism each rank runs its shard of its data-parallel group's rows).
    val_loss = None
    if args.eval_data is not None:
        batches = EvalBatches(
            rows_of(args.eval_data), global_batch=args.global_batch, world_size=dp_size, micro_batch=args.micro_batch
        )
        rank_batches = batches.rank_batches(dp_rank)
        val_loss = evaluate(model, rank_batches, device=device, sp_rank=sp_rank, sp_size=args.sp_size).loss
        print0(f"eval: loss {val_loss:.6f}")

    # 6. A checkpoint with experts in their global shape (it loads into any EP size / world size), published
    # atomically as <checkpoint>/step_N once every rank wrote its part (moeshard.checkpoint.find_resume finds it).
    # `python -m moeshard.train export-hf --checkpoint <checkpoint>/step_N --out DIR` makes it a Hub folder.
    if args.checkpoint is not None:
        # extra (JSON, rank 0's): the step, and what makes the checkpoint a Hub folder with `moeshard-train export-hf`:
        # the model's config, the folder it started from (its tokenizer and generation config go along), and for LoRA
        # its options (export-hf then writes the adapter in PEFT's format, or with --merge-lora the merged model).
        extra = {"step": args.steps, "model_config": config.to_dict(), "model_path": str(args.model.resolve())}
        state = model_state(model, optimizer)
        if adapters is not None:
            extra["lora"] = dataclasses.asdict(lora)
            # A frozen base is what --model holds already: like the app's LoRA checkpoints, this one holds what trains
            # (the adapters, and their optimizer state: the optimizer holds nothing else) and the buffers.
            trained = set(adapters.names())
            assert trained <= state["model"].keys(), "the state dict names the adapters as the model does"
            frozen = {n for n, _ in model.named_parameters()} - trained
            state["model"] = {k: v for k, v in state["model"].items() if k not in frozen}
        saved = save_checkpoint(args.checkpoint, args.steps, state, extra, {}, keep_last=1)
        print0(f"checkpoint {saved.path}: {saved.write_s:.2f} s, {saved.rate_text} per rank")
    # 7. The adapter in PEFT's format: each adapter gathered whole (experts over EP, shards over FSDP), rank 0 writes.
    if adapters is not None and args.adapter is not None:
        entries = model_state(model, optimizer)["model"]  # layout independent: experts in their global shape
        full = {
            n: entries[n].full_tensor() if hasattr(entries[n], "full_tensor") else entries[n] for n in adapters.names()
        }
        if rank == 0:
            save_adapter(args.adapter, adapters, full, base_model=str(args.model.resolve()))
            print0(f"adapter {args.adapter}")
    if rank == 0 and args.losses is not None:
        record = {"loss": losses, "grad_norm": grad_norms, "expert_load_max_over_mean": imbalance, "val_loss": val_loss}
        args.losses.write_text(json.dumps(record))
    # Free the sharded model and optimizer (they hold process groups, some in reference cycles) while the groups
    # exist, not at interpreter exit after them; and a barrier: gloo aborts at exit without it (torch 2.13).
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
