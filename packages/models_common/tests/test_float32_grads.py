"""The embedding's and the LM head's weight gradients handed to FSDP2 in float32 (``parallelize`` gives their
``options.grad_target`` as ``moeshard.fsdp_moe.reduced_grad_target``), 4 gloo processes as 2 nodes x 2 (EP 2 x ep_fsdp 2),
the toy family, bfloat16 compute with float32 reduction, two micro-batches, FSDP2 reducing every micro-batch or only the last:

- the two gradients are handed over in every backward (autograd never writes them in bfloat16);
- they equal those of autograd's path (the same run with the targets removed) to one bfloat16 rounding, and every
  other gradient and the losses are bit for bit the same;
- where FSDP2 holds the head's gradient from the first micro-batch (reducing only the last), the second one's is
  added into it by one product in backward (``ReducedGrad.add_product_``), not handed over as a tensor;
- with float32 compute (the CPU default) the targets answer None: nothing is handed over;
- the loss's float32 divisor (``num_items_in_batch`` as a tensor, as the trainer passes it) reaches the model
  unrounded: FSDP2's forward-input cast, which would round it to bfloat16, is off.
"""

import dataclasses

import pytest
import torch

from moeshard.meshes.testing import run_distributed

HANDED = ("model.embed_tokens.weight", "lm_head.weight")


def _variant(path, ids_BS, param_dtype: str, handed: bool, sync_every: bool):
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, load_hf_config, load_hf_weights, parallelize
    from moeshard.models.common.testing import ToyForCausalLM

    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = ToyForCausalLM(load_hf_config(path, ToyForCausalLM.hf_format))
    par = parallelize(model, meshes, ParallelOptions(param_dtype=param_dtype))
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    answers = {name: 0 for name in HANDED}
    products = {name: 0 for name in HANDED}
    for name, module in zip(HANDED, (model.model.embed_tokens, model.lm_head)):
        target = module.options.grad_target
        assert target is not None, name

        def counted(weight, target=target, name=name):
            answer = target(weight)
            answers[name] += answer is not None
            if answer is not None:
                add_product = answer.add_product_

                def add_product_(*args, name=name, add_product=add_product, **kwargs):
                    products[name] += 1
                    return add_product(*args, **kwargs)

                answer.add_product_ = add_product_
            return answer

        module.options = dataclasses.replace(module.options, grad_target=counted if handed else None)
    share = ids_BS.numel()  # this rank's share of the global mean: N_global / 4 (FSDP averages over the 4 ranks)
    losses = []
    micro = ids_BS.chunk(2)
    for m, ids in enumerate(micro):
        model.set_requires_gradient_sync(sync_every or m == len(micro) - 1)
        loss = model(ids, labels=ids, num_items_in_batch=share, return_logits=False).lm_loss
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    asked = dict(answers)  # the training passes' answers (the head asks in its forward, which the checks below run)
    asked["products"] = dict(products)
    with torch.no_grad():  # a divisor bfloat16 cannot hold: 48 * (1 + 2**-8) = 48.1875 rounds to 48.25
        divisor = torch.tensor(share * (1 + 2**-8), dtype=torch.float32)
        by_int, by_tensor = (
            model(ids_BS, labels=ids_BS, num_items_in_batch=n, return_logits=False).lm_loss.float()
            for n in (share, divisor)
        )
    divisor_ratio = float(by_int / by_tensor)  # (1 + 2**-8) when the divisor arrives unrounded
    return torch.stack(losses), grads, asked, divisor_ratio


def _rank(path, ids_RBS):
    import torch.distributed as dist

    ids = ids_RBS[dist.get_rank()]
    runs = {
        (handed, every): _variant(path, ids, "bfloat16", handed, every)
        for handed in (True, False)
        for every in (True, False)
    }
    runs["float32"] = _variant(path, ids, "float32", True, False)
    return runs


@pytest.fixture(scope="module")
def runs(toy_dir):
    ids_RBS = torch.randint(1, 512, (4, 4, 12), generator=torch.Generator().manual_seed(5))
    ids_RBS[:, 0, :3] = 0  # the padding token: its embedding row gets no gradient
    return run_distributed(_rank, 4, toy_dir, ids_RBS, ranks_per_node=2)[0]


def _fsdp2_holds_a_reduce_dtype_grad() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return "unsharded_accumulated_grad" in FSDPParam.__annotations__


@pytest.mark.parametrize("every", [True, False], ids=["sync_every_micro_batch", "sync_last_micro_batch"])
def test_handed_over_in_float32(runs, every):
    losses, grads, answers, _ = runs[(True, every)]
    plain_losses, plain_grads, plain_answers, _ = runs[(False, every)]
    products = answers.pop("products")
    if _fsdp2_holds_a_reduce_dtype_grad():
        assert answers == {name: 2 for name in HANDED}  # both weights, both micro-batches
        # the head's second micro-batch, where FSDP2 holds the first one's gradient: one product added in backward
        assert products == {"model.embed_tokens.weight": 0, "lm_head.weight": 0 if every else 1}
    else:  # torch 2.15: autograd accumulates in the reduce dtype itself; nothing is handed over, the sums the same
        assert answers == {name: 0 for name in HANDED} and products == {name: 0 for name in HANDED}
    assert plain_answers.pop("products") == {name: 0 for name in HANDED}
    assert plain_answers == {name: 0 for name in HANDED}
    assert torch.equal(losses, plain_losses)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        if name not in HANDED:
            assert torch.equal(grad, plain_grads[name]), name
            continue
        assert grad.dtype == torch.float32
        rel = float((grad - plain_grads[name]).abs().max() / plain_grads[name].abs().max())
        assert rel < 2**-7, (name, rel)  # one bfloat16 rounding of each micro-batch's gradient, on autograd's path
    assert torch.equal(grads["model.embed_tokens.weight"][0], torch.zeros_like(grads["model.embed_tokens.weight"][0]))


def test_nothing_handed_over_in_float32_compute(runs):
    _, _, answers, _ = runs["float32"]
    assert answers.pop("products") == {name: 0 for name in HANDED}
    assert answers == {name: 0 for name in HANDED}


def test_loss_divisor_reaches_the_model_in_float32(runs):
    for key in [(h, e) for h in (True, False) for e in (True, False)] + ["float32"]:  # every run measured it
        ratio = runs[key][3]
        assert abs(ratio - (1 + 2**-8)) < 1e-6, (key, ratio)  # rounded to bfloat16 (48.25) it is 0.13% off
