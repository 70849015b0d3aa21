"""Hub checkpoints in and out: both expert layouts, the correction bias, multi-token-prediction layers skipped,
FP8 block-scaled weights dequantised (or refused without their scales), and the plan checked before any byte."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.models.common import CheckpointError, load_hf_weights
from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM

EXPERTS1 = "model.layers.1.mlp.experts"
BIAS1 = "model.layers.1.mlp.gate.e_score_correction_bias"


def _rewrite(src, dst, edit, config_edit=None):
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied to its shard (and ``config_edit(dict)``)."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _state(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("expert_layout", ["per_expert", "fused"])
def test_layouts_and_the_bias_round_trip_through_transformers(hf_dir, batch, load_reference, tmp_path, expert_layout):
    ids, mask, _ = batch
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    assert f"{EXPERTS1}.3.up_proj.weight" in load_file(hf_dir / "model.safetensors")  # transformers' own layout
    ours.save_pretrained(tmp_path / "out", max_shard_size="60KB", expert_layout=expert_layout)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert BIAS1 in weight_map and (f"{EXPERTS1}.gate_up_proj" in weight_map) == (expert_layout == "fused")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    again = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out")
    a, b = _state(ours), _state(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a[BIAS1].abs().min() > 0
    ref = load_reference(tmp_path / "out")
    torch.testing.assert_close(ref.model.layers[1].mlp.gate.e_score_correction_bias, a[BIAS1], rtol=0, atol=0)
    torch.testing.assert_close(
        ref(input_ids=ids, attention_mask=mask).logits[mask.bool()],
        ours(ids, attention_mask=mask).logits[mask.bool()],
        rtol=0,
        atol=1e-5,
    )


def test_mtp_layer_keys_are_skipped_with_one_line(hf_dir, tmp_path, caplog):
    def add_mtp(tensors):  # V3 stores its multi-token-prediction module as the layer after the last one
        for k in [k for k in tensors if k.startswith("model.layers.2.")]:
            tensors[k.replace("model.layers.2.", "model.layers.3.")] = tensors[k].clone()
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)

    path = _rewrite(hf_dir, tmp_path / "mtp", add_mtp, lambda c: c.update(num_nextn_predict_layers=1))
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    with caplog.at_level(logging.WARNING):
        report = load_hf_weights(model, path)
    lines = [r.getMessage() for r in caplog.records if "multi-token prediction" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.3" in lines[0], lines
    assert report.skipped and all(k.startswith("model.layers.3.") for k in report.skipped)
    # a key of a layer the format does not skip is still an error
    bad = _rewrite(hf_dir, tmp_path / "bad", lambda t: t.update({"model.layers.1.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="does not have"):
        load_hf_weights(model, bad)


def _quantize(w: torch.Tensor, block: int):
    """Block-scaled float8 (DeepSeek's format): ``w ≈ q * scale_inv`` per ``block x block`` tile."""
    rows, cols = w.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = w
    tiles = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view_as(pad)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_weights_are_dequantised_with_their_block_scales(hf_dir, tmp_path):
    block, names = 16, []

    def to_fp8(tensors):
        for k in list(tensors):
            if k.endswith(("proj.weight", "proj_with_mqa.weight")) and "layernorm" not in k:
                tensors[k], tensors[k + "_scale_inv"] = _quantize(tensors[k], block)
                names.append(k)

    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    path = _rewrite(hf_dir, tmp_path / "fp8", to_fp8, lambda c: c.update(quantization_config=quant))
    want = load_file(path / "model.safetensors")
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    report_casts = load_hf_weights(model, path).casts
    assert report_casts.get("float8_e4m3fn->bfloat16") == len(names)
    state = model.state_dict()
    for k in (f"{EXPERTS1}.5.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"):
        q, s = want[k], want[k + "_scale_inv"]
        deq = (
            q.float() * s.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
        ).bfloat16()
        got = state[k] if "experts" not in k else state[f"{EXPERTS1}.gate_up_proj"][5, 32:]
        assert torch.equal(got, deq), k
    original = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    w0 = original.state_dict()["model.layers.0.self_attn.kv_b_proj.weight"]
    assert (state["model.layers.0.self_attn.kv_b_proj.weight"].float() - w0).abs().max() < 0.1 * w0.abs().max()


def test_fp8_without_scales_is_refused_before_any_byte(hf_dir, tmp_path):
    key = "model.layers.0.self_attn.o_proj.weight"
    path = _rewrite(hf_dir, tmp_path / "noscale", lambda t: t.update({key: t[key].to(torch.float8_e4m3fn)}))
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    before = _state(model)
    with pytest.raises(CheckpointError, match=r"o_proj.weight is stored as torch.float8_e4m3fn without .*scale_inv"):
        load_hf_weights(model, path)
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())


def test_a_missing_bias_or_another_architecture_is_one_clear_error(hf_dir, tmp_path):
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    path = _rewrite(hf_dir, tmp_path / "nobias", lambda t: t.pop(BIAS1))
    with pytest.raises(CheckpointError, match="missing 1 tensor.*e_score_correction_bias"):
        load_hf_weights(model, path)
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointError, match="model_type 'qwen3_moe', this model is 'deepseek_v3'"):
        DeepseekV3ForCausalLM.from_pretrained(other)
    wider = _rewrite(hf_dir, tmp_path / "wider", lambda t: None, lambda c: c.update(kv_lora_rank=32))
    with pytest.raises(CheckpointError, match="kv_lora_rank=32"):
        load_hf_weights(model, wider)
