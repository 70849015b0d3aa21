"""HF checkpoints in and out through the shared loader and writer, on the toy family: both expert layouts, expert
ranges, dtype casts, atomic save, streamed save, and one clear error per kind of bad checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeshard.models.common import (
    CheckpointError,
    load_hf_config,
    load_hf_weights,
    save_hf_weights,
    stream_hf_weights,
)
from moeshard.models.common.testing import TOY_FAMILY, ToyForCausalLM

EXPERTS0 = "model.layers.0.mlp.experts"


def _rewrite(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors: dict)`` applied to its single shard."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_per_expert_and_fused_layouts_load_identically(toy_dir, tmp_path):
    per_expert = ToyForCausalLM.from_pretrained(toy_dir)
    assert f"{EXPERTS0}.3.up_proj.weight" in load_file(toy_dir / "model.safetensors")  # the Hub's layout, as saved
    per_expert.save_pretrained(tmp_path / "fused", expert_layout="fused")
    assert f"{EXPERTS0}.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    fused = ToyForCausalLM.from_pretrained(tmp_path / "fused")
    # Sharded per-expert (a layer's experts spread over several files, as on the Hub), read back by our loader
    per_expert.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len({index["weight_map"][f"{EXPERTS0}.{e}.down_proj.weight"] for e in range(8)}) > 1
    sharded = ToyForCausalLM.from_pretrained(tmp_path / "sharded")
    a, b, c = _params(per_expert), _params(fused), _params(sharded)
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name
    # and the fused tensor is gate rows then up rows of each expert
    raw = load_file(toy_dir / "model.safetensors")
    gate_up = a[f"{EXPERTS0}.gate_up_proj"]
    assert torch.equal(gate_up[5, :32], raw[f"{EXPERTS0}.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 32:], raw[f"{EXPERTS0}.5.up_proj.weight"])
    assert torch.equal(a[f"{EXPERTS0}.down_proj"][5], raw[f"{EXPERTS0}.5.down_proj.weight"])


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_range_reads_only_those_experts(toy_dir, tmp_path, layout):
    full = ToyForCausalLM.from_pretrained(toy_dir)
    src = toy_dir
    if layout == "fused":
        src = tmp_path / "fused"
        full.save_pretrained(src, expert_layout="fused")
    part = ToyForCausalLM.from_pretrained(src, expert_range=(2, 5))
    for name, p in part.named_parameters():
        ref = full.get_parameter(name)
        expected = ref[2:5] if name.endswith(("gate_up_proj", "down_proj")) and "experts" in name else ref
        assert torch.equal(p, expected), name

    report = load_hf_weights(part, src, expert_range=(2, 5))
    experts_read = {k.split(".")[5] for k in report.keys_read if ".mlp.experts." in k and layout == "per_expert"}
    assert experts_read <= {"2", "3", "4"}
    expert_bytes = 2 * 8 * (64 * 64 + 64 * 32) * 4  # two MoE layers, 8 experts, gate_up + down, float32
    total_bytes = sum(p.numel() * 4 for p in full.parameters())
    assert report.bytes_read == total_bytes - expert_bytes * 5 // 8  # 3 of 8 experts read

    with pytest.raises(ValueError, match="no EP group"):
        part(torch.zeros(1, 4, dtype=torch.long))


def test_float_checkpoint_is_cast_and_reported(toy_dir, tmp_path):
    bf16 = _rewrite(toy_dir, tmp_path / "bf16", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    model = ToyForCausalLM.from_pretrained(toy_dir)
    report = load_hf_weights(model, bf16)
    assert report.casts == {"bfloat16->float32": len(load_file(bf16 / "model.safetensors"))}
    with pytest.raises(CheckpointError, match="stored as torch.bfloat16.*allow_dtype_cast=True"):
        load_hf_weights(model, bf16, allow_dtype_cast=False)
    as_bf16 = ToyForCausalLM.from_pretrained(toy_dir, dtype=torch.bfloat16)
    assert as_bf16.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(as_bf16.lm_head.weight, model.lm_head.weight.bfloat16())


def _drop(key):
    return lambda t: t.pop(key)


def _add(key):
    return lambda t: t.update({key: torch.zeros(3)})


def _reshape(key):
    return lambda t: t.update({key: torch.zeros(7, 64)})


def _retype(key):
    return lambda t: t.update({key: torch.zeros_like(t[key], dtype=torch.int32)})


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop(f"{EXPERTS0}.6.down_proj.weight"), r"missing 1 tensor.*experts\.6\.down_proj\.weight"),
        (_drop("lm_head.weight"), r"missing 1 tensor.*lm_head\.weight"),
        (_add("model.layers.0.mlp.shared_expert.weight"), r"1 tensor\(s\) this model does not have.*shared_expert"),
        (_add(f"{EXPERTS0}.8.gate_proj.weight"), r"does not have.*experts\.8\.gate_proj"),  # a 9th expert
        (_add(f"{EXPERTS0}.gate_up_proj"), r"does not have.*experts\.\d\.(gate|up|down)_proj"),  # both layouts
        (
            _reshape("model.layers.2.self_attn.q_proj.weight"),
            r"q_proj\.weight in model\.safetensors has shape \[7, 64\]",
        ),
        (_retype("model.norm.weight"), r"model\.norm\.weight is stored as torch\.int32"),
    ],
    ids=["missing-expert", "missing-head", "unexpected", "extra-expert", "both-layouts", "shape", "dtype"],
)
def test_bad_checkpoint_content(toy_dir, tmp_path, edit, message):
    bad = _rewrite(toy_dir, tmp_path / "bad", edit)
    model = ToyForCausalLM.from_pretrained(toy_dir)
    before = _params(model)
    with pytest.raises(CheckpointError, match=message):
        load_hf_weights(model, bad)
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing written before the error


def test_truncated_and_corrupt_files(toy_dir, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(toy_dir, truncated)
    file = truncated / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable.*truncated or corrupt"):
        ToyForCausalLM.from_pretrained(truncated)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(toy_dir, corrupt)
    file = corrupt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"#" * 32  # inside the JSON header
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ToyForCausalLM.from_pretrained(corrupt)


def test_wrong_architecture_missing_dir_and_missing_shard(toy_dir, tmp_path):
    other = tmp_path / "llama"
    shutil.copytree(toy_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama', this model is 'toy_moe'"):
        ToyForCausalLM.from_pretrained(other)
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        load_hf_weights(ToyForCausalLM.from_pretrained(toy_dir), other)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        ToyForCausalLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_weights(ToyForCausalLM.from_pretrained(toy_dir), tmp_path / "nowhere")

    sharded = tmp_path / "sharded"
    ToyForCausalLM.from_pretrained(toy_dir).save_pretrained(sharded, max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"to {shard.name}, which is not in"):
        ToyForCausalLM.from_pretrained(sharded)


def test_config_mismatch_and_meta_model(toy_dir):
    with torch.device("meta"):
        model = ToyForCausalLM(load_hf_config(toy_dir, ToyForCausalLM.hf_format))
    with pytest.raises(ValueError, match="on the meta device.*to_empty"):
        load_hf_weights(model, toy_dir)
    other = ToyForCausalLM(TOY_FAMILY.preset_config("toy-4"))
    with pytest.raises(CheckpointError, match="num_hidden_layers=3, the model was built with num_hidden_layers=4"):
        load_hf_weights(other, toy_dir)


def test_save_replaces_atomically_and_keeps_other_files(toy_dir, tmp_path, monkeypatch):
    model = ToyForCausalLM.from_pretrained(toy_dir)
    out = tmp_path / "ckpt"
    model.save_pretrained(out, max_shard_size="100KB")
    (out / "tokenizer.json").write_text("{}")
    good = {p.name: p.read_bytes() for p in out.iterdir()}

    calls = []

    def failing_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr("moeshard.models.common._hf_save.save_file", failing_save_file)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(out, max_shard_size="100KB")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == good  # old checkpoint untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging leftovers

    monkeypatch.undo()
    model.save_pretrained(out)  # one shard now: stale shards and index must go, the tokenizer must stay
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    reloaded = ToyForCausalLM.from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_save_refuses_partial_model(toy_dir, tmp_path):
    part = ToyForCausalLM.from_pretrained(toy_dir, expert_range=(0, 4))
    with pytest.raises(ValueError, match="save_hf_weights"):
        part.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_streamed_save_reads_each_tensor_once_and_writes_what_save_writes(toy_dir, tmp_path):
    model = ToyForCausalLM.from_pretrained(toy_dir)
    state = {k: v.detach() for k, v in model.named_parameters()}
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    calls: list[list[str]] = []

    def read(keys):
        calls.append(keys)
        return {k: state[k] for k in keys}

    fmt = ToyForCausalLM.hf_format
    files = stream_hf_weights(
        specs, read, model.config, tmp_path / "s", fmt=fmt, max_shard_size="40KB", dtype=torch.bfloat16
    )
    assert len(files) > 3 and all(calls)
    read_keys = [k for c in calls for k in c]
    assert sorted(read_keys) == sorted(state)  # every tensor read once, fused experts spanning shards too
    save_hf_weights(state, model.config, tmp_path / "w", fmt=fmt, max_shard_size="40KB", dtype=torch.bfloat16)
    for f in files:
        streamed, saved = load_file(f), load_file(tmp_path / "w" / f.name)
        assert streamed.keys() == saved.keys() and all(torch.equal(streamed[k], saved[k]) for k in saved)
        assert all(t.dtype == torch.bfloat16 for t in streamed.values())
