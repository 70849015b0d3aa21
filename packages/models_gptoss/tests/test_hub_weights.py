"""GPT-OSS's Hub folders through the shared loader and writer: MXFP4 experts (``*_blocks``/``*_scales``) dequantised
to each rank's own experts, bf16 folders, and the bf16 folders we write, each equal to transformers loading the same
folder (it dequantises MXFP4 on CPU with ``Mxfp4Config(dequantize=True)``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssForCausalLM as HFGptOss
from transformers import Mxfp4Config

from moeshard.ep import apply_ep
from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed
from moeshard.models.common import CheckpointError, load_hf_config, load_hf_weights
from moeshard.models.gptoss import GPT_OSS_FORMAT, GptOssForCausalLM, check_config, get_preset_config

_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _random_hf(seed: int) -> HFGptOss:
    """transformers' tiny GPT-OSS with every parameter random (sinks and biases non-zero)."""
    torch.manual_seed(seed)
    config = get_preset_config("tiny")
    config._attn_implementation = "eager"
    hf = HFGptOss(config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return hf


def _write_mxfp4(path, seed: int = 0) -> None:
    """A Hub-style MXFP4 folder: the experts' weights as random FP4 codes and block scales (the values they stand for
    are exact), everything else float32, ``quantization_config.quant_method: mxfp4``."""
    hf = _random_hf(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for key, value in hf.state_dict().items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            e, cols, rows = value.shape  # the Hub's [E, in, out]; blocks hold [E, out, in]
            tensors[f"{key}_blocks"] = torch.randint(
                0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=gen
            )
            tensors[f"{key}_scales"] = torch.randint(120, 126, (e, rows, cols // 32), dtype=torch.uint8, generator=gen)
        else:
            tensors[key] = value.contiguous()
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = hf.config.to_dict()
    config.pop("_attn_implementation", None)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": _NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config))


def _transformers(path) -> HFGptOss:
    hf = HFGptOss.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def _ids():
    return torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))  # 20 > window 8


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptoss") / "mxfp4"
    _write_mxfp4(path)
    return path


def test_mxfp4_folder_loads_equal_to_transformers(mxfp4_dir):
    want = _transformers(mxfp4_dir)(_ids()).logits
    ours = GptOssForCausalLM.from_pretrained(mxfp4_dir)
    report = load_hf_weights(ours, mxfp4_dir)
    assert report.casts == {"uint8->float32": 4}  # two layers' gate_up_proj and down_proj dequantised
    assert any(k.endswith("gate_up_proj_blocks") for k in report.keys_read)
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()).logits, want, rtol=1e-5, atol=1e-5)


def test_bf16_folder_loads_equal_to_transformers(tmp_path):
    hf = _random_hf(seed=3)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # the Hub's bf16 folders, experts in its layout
    want = _transformers(tmp_path / "bf16")(_ids()).logits
    ours = GptOssForCausalLM.from_pretrained(tmp_path / "bf16")
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()).logits, want, rtol=1e-5, atol=1e-5)


def test_exported_folder_loads_in_transformers_with_equal_logits(mxfp4_dir, tmp_path):
    ours = GptOssForCausalLM.from_pretrained(mxfp4_dir)
    with torch.no_grad():
        ours.model.layers[1].mlp.experts.gate_up_proj_bias.normal_()  # not symmetric in gate and up
        want = ours(_ids()).logits
    ours.save_pretrained(tmp_path / "out")
    keys = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in keys  # written dequantised
    theirs = HFGptOss.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, want, rtol=1e-5, atol=1e-5)
    again = GptOssForCausalLM.from_pretrained(tmp_path / "out")  # and back into ours
    for (name, a), b in zip(ours.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_blocks_without_scales_are_refused_by_name(mxfp4_dir, tmp_path):
    from safetensors.torch import load_file

    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(mxfp4_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts.down_proj_scales"):
        GptOssForCausalLM.from_pretrained(broken)


def test_other_quantisation_is_refused():
    config = get_preset_config("tiny")
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="quant_method='fp8'.*dequantise the checkpoint to bf16"):
        check_config(config)


def _ep2_logits(path, ids):
    """One rank of 2 at EP 2: meta model, EP, then each rank loads its own experts from the folder."""
    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = GptOssForCausalLM(load_hf_config(path, GPT_OSS_FORMAT))
    info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    model.to_empty(device="cpu")
    report = load_hf_weights(model, path, ep_info=info)
    blocks = {k for k in report.keys_read if k.endswith("_blocks")}
    with torch.no_grad():
        return model(ids).logits, {fqn: (m.expert_start, m.expert_end) for fqn, m in info.params.items()}, blocks


def test_mxfp4_folder_at_ep_2_on_gloo_equal_to_transformers(mxfp4_dir):
    ids = _ids()
    want = _transformers(mxfp4_dir)(ids).logits
    ranges = set()
    for logits, experts, blocks in run_distributed(_ep2_logits, 2, mxfp4_dir, ids):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert len(blocks) == 4
        ranges.add(experts["model.layers.0.mlp.experts.gate_up_proj_bias"])
    assert ranges == {(0, 4), (4, 8)}  # each rank its own half of the experts, biases with their weights


def test_parallelize_two_nodes_of_two_equal_one_process(tmp_path):
    """EP 2 x ep_fsdp 2 on 4 gloo ranks (``parallelize``): loss and every gradient, sinks and biases non-zero,
    rows longer than the window, equal to the model in one process."""
    from moeshard.models.common import ParallelOptions
    from moeshard.models.common.testing import check_two_nodes_of_two

    _random_hf(seed=4).save_pretrained(tmp_path / "f32")
    reference = GptOssForCausalLM.from_pretrained(tmp_path / "f32")
    assert reference.model.layers[0].self_attn.sinks.abs().min() > 0
    check_two_nodes_of_two(GptOssForCausalLM, tmp_path / "f32", reference, ParallelOptions())
