"""Test helpers shared by the model families' tests: packed documents, padded batches, the comparisons against
transformers (one process, packed per document, 2 x 2 gloo processes), and a toy family built from the shared pieces
alone (the shared machinery's own tests run on it, with no Hub family installed).

ids, labels, position_ids, document_ids, pieces = pack_documents(vocab=512)
worst, where = max_rel_grad_error(reference_model, our_model)
calls = reference_fa4(monkeypatch)   # FlashAttention 4's entry points computed on CPU, counted
path = save_toy_checkpoint(tmp_path)  # a random ToyForCausalLM saved as an HF checkpoint (per-expert keys)
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from moeshard.models.common._causal_lm import DecoderModel, MoECausalLM
from moeshard.models.common._family import ModelFamily
from moeshard.models.common._hf_load import HFFormat
from moeshard.models.common._layers import AttentionOptions, apply_rotary, attend, attention_output
from moeshard.models.common._moe import Experts, MoEBlock, TopKRouter
from moeshard.models.common._torch_internals import causal_attention_cpu, causal_attention_cpu_backward

__all__ = [
    "DOCUMENT_LENGTHS",
    "TOY_FAMILY",
    "ToyAttention",
    "ToyConfig",
    "ToyForCausalLM",
    "check_packed_documents",
    "check_two_nodes_of_two",
    "max_rel_grad_error",
    "pack_documents",
    "padded_batch",
    "reference_fa4",
    "save_toy_checkpoint",
]

DOCUMENT_LENGTHS = (5, 11, 3, 20, 7, 2, 16, 4)
"""Documents of :func:`pack_documents`: several per row, one across a row boundary, one longer than most rows."""


def pack_documents(vocab: int, seq_len: int = 24, lengths: tuple[int, ...] = DOCUMENT_LENGTHS, seed: int = 0):
    """Rows of ``seq_len`` tokens cut from random documents laid back to back, as ``moeshard.data`` packs them.

    Each run of one document inside a row is a *piece*: positions restart, ``document_ids`` count pieces in the row,
    the piece's first token is not a target (label -100).

    Returns:
        ``(input_ids, labels, position_ids, document_ids, pieces)``, each ``[rows, seq_len]`` but ``pieces``: a list
        of ``(row, start, end)``.
    """
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    stream = torch.cat(docs)
    owner = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    rows = stream.numel() // seq_len
    ids, owner = stream[: rows * seq_len].view(rows, seq_len), owner[: rows * seq_len].view(rows, seq_len)
    new_piece = torch.ones_like(owner, dtype=torch.bool)
    new_piece[:, 1:] = owner[:, 1:] != owner[:, :-1]
    document_ids = new_piece.long().cumsum(1) - 1
    position_ids = torch.zeros_like(ids)
    for r in range(rows):
        for t in range(1, seq_len):
            position_ids[r, t] = 0 if new_piece[r, t] else position_ids[r, t - 1] + 1
    labels = ids.masked_fill(new_piece, -100)
    pieces = [
        (r, int(a), int(a) + int((document_ids[r] == d).sum()))
        for r in range(rows)
        for d in document_ids[r].unique()
        for a in [(document_ids[r] == d).nonzero()[0, 0]]
    ]
    return ids, labels, position_ids, document_ids, pieces


def max_rel_grad_error(reference: nn.Module, ours: nn.Module, *, allow_unreached: bool = False) -> tuple[float, str]:
    """``(worst, name)``: the largest ``max|g - g_ref| / max|g_ref|`` over the parameters of ``ours``, matched by
    name. ``allow_unreached``: a reference gradient of None (an expert no token reached) needs ours to be None or
    zero, else both must exist."""
    ref_params = dict(reference.named_parameters())
    worst, where = 0.0, ""
    for name, p in ours.named_parameters():
        g_ref = ref_params[name].grad
        if g_ref is None and allow_unreached:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None and g_ref is not None, name
        err = ((p.grad - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def check_packed_documents(ours: nn.Module, reference: nn.Module, *, backward: bool = True) -> None:
    """Packed rows through ``ours`` (``document_ids``, restarting positions) against ``reference`` (a transformers
    causal LM) run on every document alone: each token's logits, the mean loss over the predicted tokens (1e-5) and,
    with ``backward``, every gradient (1e-4 relative). Raises ``AssertionError`` on a difference."""
    ids, labels, position_ids, document_ids, pieces = pack_documents(reference.config.vocab_size)
    assert len(pieces) > ids.shape[0]  # several documents per row
    with torch.set_grad_enabled(backward):
        out = ours(ids, labels=labels, position_ids=position_ids, document_ids=document_ids, output_router_logits=False)
    n_targets = int((labels[:, 1:] != -100).sum())
    ref_sum = torch.zeros(())
    for r, a, b in pieces:
        piece = ids[r : r + 1, a:b]
        lg = reference(input_ids=piece).logits
        torch.testing.assert_close(out.logits[r : r + 1, a:b], lg, rtol=0, atol=1e-5)
        ref_sum = ref_sum + F.cross_entropy(lg[0, :-1], piece[0, 1:], reduction="sum")
    ref_loss = ref_sum / n_targets
    torch.testing.assert_close(out.loss, ref_loss, rtol=0, atol=1e-5)
    if backward:
        out.loss.backward()
        ref_loss.backward()
        worst, where = max_rel_grad_error(reference, ours, allow_unreached=True)
        assert worst < 1e-4, f"gradient of {where} differs by {worst:.2e} (relative)"


def padded_batch(vocab: int = 512, seed: int = 7):
    """``(input_ids, attention_mask, labels)``: 2 sequences of 12, the second left-padded by 4 (id 0, label -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    ids[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _parallel_step(model_class, path, ids_RBS, options):
    """One rank: parallelize the meta model (EP 2), load the checkpoint, forward and backward this rank's rows; the
    expert counts of the selection its MoE layers handed on (checked here against the routers selecting again)."""
    import torch.distributed as dist

    from moeshard.meshes import build_meshes
    from moeshard.models.common import expert_counts, load_hf_config, load_hf_weights, parallelize, routers

    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = model_class(load_hf_config(path, model_class.hf_format))
    par = parallelize(model, meshes, options)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    # This rank's share of the global mean (FSDP averages over ranks): its summed loss / (N_global / world).
    n_global = ids_RBS.shape[0] * ids_RBS.shape[1] * (ids_RBS.shape[2] - 1)
    ids = ids_RBS[rank]
    out = model(ids, labels=ids, num_items_in_batch=n_global / world, output_router_logits=True)
    loss = out.lm_loss  # the LM loss alone: what the reference's is compared with
    loss.backward()
    k = model.config.num_experts_per_tok
    counts_LE = expert_counts(out.router_logits, k, router_ids=out.router_ids)
    assert torch.equal(counts_LE, expert_counts(out.router_logits, k, routers=routers(model))), rank
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    experts = {fqn: (m.expert_start, m.expert_end) for fqn, m in par.ep_info.params.items()}
    return loss.detach(), grads, experts, counts_LE


def check_two_nodes_of_two(
    model_class: type[nn.Module], path, reference: nn.Module, options, **reference_kwargs
) -> None:
    """4 gloo processes as 2 nodes x 2 ranks at EP 2 x ep_fsdp 2 (``parallelize(options)`` of ``model_class`` loaded
    from ``path``) against ``reference`` (a model of the same checkpoint, e.g. transformers') in one process on the
    global batch: the loss (1e-5) and every gradient (1e-4 relative), each rank's experts against their slice; and,
    where the reference returns router logits, the expert counts of the selections the ranks' layers handed on
    (``router_ids``), summed over the ranks, against the softmax top-k of the reference's logits. ``reference_kwargs``
    go to the reference's call (its LM loss alone is compared). Raises ``AssertionError`` on a difference."""
    from moeshard.meshes.testing import run_distributed

    ids_RBS = torch.randint(1, reference.config.vocab_size, (4, 2, 10), generator=torch.Generator().manual_seed(3))
    all_ids = ids_RBS.reshape(-1, ids_RBS.shape[-1])
    ref_loss = reference(input_ids=all_ids, labels=all_ids, **reference_kwargs).loss
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    results = run_distributed(_parallel_step, 4, model_class, path, ids_RBS, options, ranks_per_node=2)
    torch.testing.assert_close(sum(r[0] for r in results) / 4, ref_loss, rtol=0, atol=1e-5)
    with torch.no_grad():
        ref_router_logits = getattr(reference(input_ids=all_ids, output_router_logits=True), "router_logits", None)
    if ref_router_logits:
        from moeshard.models.common import expert_counts

        want_LE = expert_counts(ref_router_logits, reference.config.num_experts_per_tok)
        assert torch.equal(sum(r[3] for r in results), want_LE), "the handed-on selections differ from the reference's"
    for _, grads, experts, _ in results:
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            expected = ref_grads[name]
            if name in experts:
                start, end = experts[name]
                expected = expected[start:end]
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class _ReferenceFA4:
    """``flash_attn.cute.interface``'s two entry points as the model calls them, computed by the flash kernel for CPU
    on the ``[B, S, heads, D]`` tensors they are given (seen as ``[B, heads, S, D]``); ``calls`` counts them."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def _flash_attn_fwd(self, q, k, v, *, softmax_scale, causal, return_lse, out, lse):
        b, s, h, _ = q.shape
        assert causal and return_lse and out.shape == (b, s, h, v.shape[-1]) and lse.shape == (b, h, s)
        o, logsumexp = causal_attention_cpu(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale)
        out.copy_(o.transpose(1, 2))
        lse.copy_(logsumexp)
        self.calls["forward"] += 1
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, *, softmax_scale, causal, dq, dk, dv):
        assert causal
        bhsd = (t.transpose(1, 2) for t in (dout, q, k, v, out))
        grads = causal_attention_cpu_backward(*bhsd, lse, softmax_scale)
        for into, g in zip((dq, dk, dv), grads):
            into.copy_(g.transpose(1, 2))
        self.calls["backward"] += 1
        return dq, dk, dv


def reference_fa4(monkeypatch) -> collections.Counter[str]:
    """Make ``AttentionOptions(kernel="fa4")`` run on CPU: FlashAttention 4's entry points (``_fa4``) replaced by the flash
    kernel for CPU on the same ``[B, S, heads, D]`` tensors, and the device checks answering yes. The layouts, the
    keep and the autograd wiring are then ours and tested; the kernels are FlashAttention 4's only on a GPU.
    Returns the count of forward and backward calls."""
    import moeshard.models.common._causal_lm as causal_lm
    import moeshard.models.common._fa4 as fa4
    import moeshard.models.common._kept as kept

    reference = _ReferenceFA4()
    monkeypatch.setattr(fa4, "_interface", lambda: reference)
    for module in (causal_lm, kept):
        monkeypatch.setattr(module, "fa4_unavailable", lambda device: None)
    monkeypatch.setattr(kept, "fa4_applies", lambda q, k, v, dropout: dropout == 0 and q.shape[-1] == v.shape[-1])
    return reference.calls


# ---- a toy family -------------------------------------------------------------------------------------------------


class ToyConfig(PretrainedConfig):
    """The toy family's config. Its expert fields are named as no Hub family names them (``pool`` experts of width
    ``cell``, MoE everywhere but ``dense_layers``, ``kv_heads``), so the shared code can only reach them through the
    model it builds; it keeps the names the shared code reads (``num_experts_per_tok``, ``router_aux_loss_coef``,
    ``output_router_logits``, the decoder's sizes). Defaults: 3 layers, layer 1 dense, 8 experts of width 32, top-2,
    hidden 64, 4 query heads over 2 key/value heads of 16, vocabulary 512, padding token 0."""

    model_type = "toy_moe"

    def __init__(self, **kw) -> None:
        defaults = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            kv_heads=2,
            head_dim=16,
            pool=8,
            cell=32,
            num_experts_per_tok=2,
            dense_layers=[1],
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            router_aux_loss_coef=0.001,
            initializer_range=0.02,
            output_router_logits=True,
            pad_token_id=0,
        )
        super().__init__(**{**defaults, **kw})


class ToyAttention(nn.Module):
    """Grouped-query attention with RoPE through the shared attention function (:func:`attend`: padding and
    document masks, the kept kernels of activation checkpointing, FlashAttention 4) and output projection."""

    attention_call = staticmethod(attend)
    """The attention over q, k, v (``attend``); ``apply_sequence_parallel`` replaces it on an instance."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.kv_heads
        self.qk_head_dim = self.v_head_dim = self.head_dim = config.head_dim
        d, h, g = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, n, bias=False) for n in (h, g, g))
        self.o_proj = nn.Linear(h, d, bias=False)

    def forward(self, x_BSD, cos_BSDh, sin_BSDh, mask_B1SS, attention: AttentionOptions | None = None):
        """Attention output ``[B, S, D]`` under the layer's mask and the model's ``AttentionOptions`` (see
        :func:`attend`)."""
        b, s, _ = x_BSD.shape
        q, k, v = (
            p(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, cos_BSDh, sin_BSDh), apply_rotary(k, cos_BSDh, sin_BSDh)
        gqa = self.num_heads != self.num_kv_heads
        o = self.attention_call(q, k, v, mask_B1SS, scale=self.head_dim**-0.5, enable_gqa=gqa, options=attention)
        return attention_output(self.o_proj, o.transpose(1, 2).reshape(b, s, -1), mask_B1SS, attention)


class _ToyBlock(MoEBlock):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__(
            Experts(config.pool, config.hidden_size, config.cell),
            TopKRouter(config.pool, config.hidden_size, config.num_experts_per_tok, True),
        )


class _ToyModel(DecoderModel):
    attention_class = ToyAttention
    moe_block_class = _ToyBlock
    is_moe_layer = staticmethod(lambda config, i: i not in (config.dense_layers or ()))


def _check_toy_config(config: PretrainedConfig) -> None:
    if not 1 <= config.num_experts_per_tok <= config.pool:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be in [1, pool={config.pool}]")


def _toy_field(config: PretrainedConfig, name: str) -> object:
    return sorted(config.dense_layers or []) if name == "dense_layers" else getattr(config, name, None)


class ToyForCausalLM(MoECausalLM):
    """A causal LM of the shared pieces alone: :class:`ToyAttention`, a softmax top-k router over fused SwiGLU
    experts (``model.layers.{i}.mlp.experts.gate_up_proj [pool, 2·cell, D]``, ``down_proj [pool, D, cell]``), a
    dense MLP where ``dense_layers`` says; checkpoints of ``model_type`` ``"toy_moe"`` in both expert layouts."""

    base_model_class = _ToyModel
    hf_format = HFFormat(
        model_type="toy_moe",
        architecture="ToyForCausalLM",
        config_class=ToyConfig,
        check_config=_check_toy_config,
        structural_keys=(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_heads",
            "head_dim",
            "intermediate_size",
            "pool",
            "cell",
            "dense_layers",
        ),
        num_experts=lambda config: config.pool,
        field=_toy_field,
    )


_TOY_PRESETS = {"toy": {}, "toy-4": {"num_hidden_layers": 4}}


def _toy_preset_config(name: str, **overrides) -> ToyConfig:
    if name not in _TOY_PRESETS:
        raise ValueError(f"unknown toy preset {name!r}; choose one of {sorted(_TOY_PRESETS)}")
    return ToyConfig(**{**_TOY_PRESETS[name], **overrides})


TOY_FAMILY = ModelFamily(ToyForCausalLM, _TOY_PRESETS, _toy_preset_config)
"""The toy family's entry points (presets ``toy``: the :class:`ToyConfig` defaults; ``toy-4``: 4 layers)."""


def save_toy_checkpoint(path, seed: int = 1234, **overrides):
    """A random :class:`ToyForCausalLM` (``ToyConfig(**overrides)``, initialised from ``seed``) saved at ``path``
    with per-expert keys (the Hub's layout). Returns ``path``."""
    model = ToyForCausalLM(ToyConfig(**overrides))
    model.init_weights(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # spread the norms off 1 so that a swapped or missed norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(path)
    return path
