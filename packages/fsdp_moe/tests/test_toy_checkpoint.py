"""DCP checkpoints of the toy MoE LM move between layouts: saved with EP 2 x ep_fsdp 2 (with activation
checkpointing wrappers in the FQNs), loaded without them with EP 4 x 1, EP 1 x 4 (4 processes) and EP 2 x 1,
EP 1 x 2 (2 processes); parameters and optimizer state are identical. And between fused and unfused expert
updates (``build_optimizer(..., fuse_local_experts=...)``): saved with LocalExpertAdamW at EP 4 x 1, loaded by
torch's AdamW at EP 2 x 2, 1 x 4 and 4 x 1 and by LocalExpertAdamW at EP 2 x 1 (2 processes); saved unfused at
EP 2 x 2, loaded fused at EP 4 x 1; each continues with the saving run's numbers. With bf16 compute, where the
fused update holds its masters split, a checkpoint holds float32 masters and a load continues bit for bit."""

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader

from moeshard.fsdp_moe.testing import ToyMoELM
from moeshard.meshes.testing import run_distributed

B, S, VOCAB = 8, 6, 32


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    return ids, ids.clone()


def _build(ep_size, seed, lr, wrap=False, fuse=None, bf16=False):
    """``fuse`` None: torch's AdamW as is; True: ``build_optimizer``'s default (LocalExpertAdamW beside OnePassAdamW);
    False: ``build_optimizer(..., fuse_local_experts=False, fused=False)`` (torch's for-loop AdamW alone), so the
    checkpoints also move between OnePassAdamW and torch's AdamW."""
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=ep_size, allow_cross_node_ep=True)  # EP 4 spans the two 2-rank nodes
    torch.manual_seed(seed)
    model = ToyMoELM()
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    if wrap:  # activation checkpointing after EP inserts a segment into every FQN below the layers
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if bf16:  # bf16 compute: LocalExpertAdamW holds the experts' float32 masters split
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(model, meshes, ep_info=ep_info, mp_policy=mp)
    else:
        shard_model(model, meshes, ep_info=ep_info)
    if fuse is None:
        return meshes, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    from moeshard.fsdp_moe import build_optimizer

    torch_adamw = {} if fuse else {"fused": False}
    return meshes, model, build_optimizer(model, lr=lr, weight_decay=0.1, fuse_local_experts=fuse, **torch_adamw)


def _step(model, opt, meshes, seed):
    ids, labels = _batch(seed)
    ids, labels = ids.chunk(meshes.world_size)[meshes.rank], labels.chunk(meshes.world_size)[meshes.rank]
    model(ids, labels).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    from moeshard.fsdp_moe.testing import checkpoint_snapshot

    return checkpoint_snapshot(model, opt)


def _save_then_load(path):
    from moeshard.fsdp_moe import load_checkpoint, save_checkpoint

    meshes, model, opt = _build(2, seed=0, lr=1e-2, wrap=True)  # loaded below into unwrapped models
    assert "layers.0._checkpoint_wrapped_module.experts.gate_up_proj" in dict(model.named_parameters())
    _step(model, opt, meshes, seed=1)
    save_checkpoint(path, model, opt)
    saved = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    after = _snapshot(model, opt)
    loaded = {}
    for ep in (4, 1):
        meshes, model, opt = _build(ep, seed=7, lr=5e-3)  # other weights and lr: all must come from the file
        load_checkpoint(path, model, opt)
        loaded[ep] = _snapshot(model, opt)
        _step(model, opt, meshes, seed=2)  # the restored optimizer state must drive the next step the same way
        loaded[f"{ep}-next"] = _snapshot(model, opt)
    return saved, after, loaded


def _load(path):
    from moeshard.fsdp_moe import load_checkpoint

    out = {}
    for ep in (2, 1):
        _, model, opt = _build(ep, seed=7, lr=5e-3)
        load_checkpoint(path, model, opt)
        out[ep] = _snapshot(model, opt)
    return out


def _same(a, b, what, exact=True):
    assert a.keys() == b.keys(), what
    for k in a:
        if exact:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")
        else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=f"{what}: {k}")


def test_checkpoint_moves_between_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    out = run_distributed(_save_then_load, 4, path, ranks_per_node=2)
    saved, after, loaded = out[0]
    # The file holds experts in their global shape [E, 2F, D], whatever layout wrote it.
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    assert tuple(meta["model.layers.0.experts.gate_up_proj"].size) == (8, 16, 16)
    assert tuple(meta["optimizer.state.layers.1.experts.down_proj.exp_avg"].size) == (8, 16, 8)
    assert any(k.endswith("exp_avg") for k in saved) and float(saved["lr.embed.weight"]) == 1e-2
    for ep in (4, 1):
        _same(loaded[ep], saved, f"EP {ep} x {4 // ep} load")
        _same(loaded[f"{ep}-next"], after, f"EP {ep} x {4 // ep} step after load", exact=False)
    for ep, snap in run_distributed(_load, 2, path)[0].items():
        _same(snap, saved, f"world 2, EP {ep} x {2 // ep} load")


# ---- fused <-> unfused expert updates -------------------------------------------------------------------------------


def _kinds(opt):
    return [type(o).__name__ for o in opt.optimizers]


def _fused_then_unfused(path):
    from moeshard.fsdp_moe import load_checkpoint, save_checkpoint

    out = {}
    meshes, model, opt = _build(4, seed=0, lr=1e-2, fuse=True)  # EP 4 x 1: experts outside FSDP, fused
    out["saving"] = _kinds(opt)
    _step(model, opt, meshes, seed=1)
    save_checkpoint(f"{path}/fused", model, opt)
    out["saved"] = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    out["after"] = _snapshot(model, opt)
    for ep, fuse in ((2, False), (1, False), (4, False), (4, True)):
        meshes, model, opt = _build(ep, seed=7, lr=5e-3, fuse=fuse)  # other weights and lr
        out[f"kinds {ep} {fuse}"] = _kinds(opt)
        load_checkpoint(f"{path}/fused", model, opt)
        out[f"loaded {ep} {fuse}"] = _snapshot(model, opt)
        _step(model, opt, meshes, seed=2)
        out[f"next {ep} {fuse}"] = _snapshot(model, opt)

    meshes, model, opt = _build(2, seed=0, lr=1e-2, fuse=False)  # EP 2 x 2 (expert FSDP units), unfused
    _step(model, opt, meshes, seed=1)
    save_checkpoint(f"{path}/unfused", model, opt)
    out["saved unfused"] = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    out["after unfused"] = _snapshot(model, opt)
    meshes, model, opt = _build(4, seed=7, lr=5e-3, fuse=True)
    load_checkpoint(f"{path}/unfused", model, opt)
    out["loaded fused"] = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    out["next fused"] = _snapshot(model, opt)
    return out


def _load_fused_on_two(path):
    from moeshard.fsdp_moe import load_checkpoint

    _, model, opt = _build(2, seed=7, lr=5e-3, fuse=True)  # EP 2 x 1 on 2 processes: fused
    load_checkpoint(path, model, opt)
    return _kinds(opt), _snapshot(model, opt)


def test_checkpoints_move_between_fused_and_unfused_expert_updates(tmp_path):
    out = run_distributed(_fused_then_unfused, 4, str(tmp_path), ranks_per_node=2)[0]
    assert out["saving"] == ["LocalExpertAdamW", "OnePassAdamW"]
    # The file holds what torch's AdamW over float32 experts holds: the masters under the parameters' names.
    meta = FileSystemReader(str(tmp_path / "fused")).read_metadata().state_dict_metadata
    assert tuple(meta["model.layers.0.experts.gate_up_proj"].size) == (8, 16, 16)
    assert meta["model.layers.0.experts.gate_up_proj"].properties.dtype == torch.float32
    assert not [k for k in meta if "master" in k]
    expert_keys = sorted(k.rsplit(".", 1)[1] for k in meta if k.startswith("optimizer.state.layers.1.experts.down"))
    assert expert_keys == ["exp_avg", "exp_avg_sq", "step"]
    for ep, fuse in ((2, False), (1, False), (4, False), (4, True)):
        what = f"EP {ep} x {4 // ep} {'fused' if fuse else 'unfused'}"
        assert out[f"kinds {ep} {fuse}"] == (["LocalExpertAdamW", "OnePassAdamW"] if fuse else ["AdamW"]), what
        _same(out[f"loaded {ep} {fuse}"], out["saved"], f"{what} loading the fused checkpoint")
        _same(out[f"next {ep} {fuse}"], out["after"], f"{what}: step after load", exact=False)
    _same(out["loaded fused"], out["saved unfused"], "EP 4 x 1 fused loading EP 2 x 2 unfused")
    _same(out["next fused"], out["after unfused"], "EP 4 x 1 fused: step after load", exact=False)
    kinds, snap = run_distributed(_load_fused_on_two, 2, str(tmp_path / "fused"))[0]
    assert kinds == ["LocalExpertAdamW", "OnePassAdamW"]
    _same(snap, out["saved"], "world 2, EP 2 x 1 fused")


def _split_entries_join_to_the_joined_dict(model, opt):
    """``get_state_dict(masters="split")``: a SplitMaster where (and only where) the joined dict has a new float32
    master, of the same global layout; its halves alias the live parameter and low halves; joined, the same bits."""
    from torch.distributed.tensor import DTensor

    from moeshard.fsdp_moe import SplitMaster, get_state_dict, joined_masters

    joined, split = get_state_dict(model, opt), get_state_dict(model, opt, masters="split")
    entries = {k: v for k, v in split["model"].items() if isinstance(v, SplitMaster)}
    assert entries and set(entries) == {k for k in joined["model"] if ".experts." in k}
    for fqn, entry in entries.items():
        want = joined["model"][fqn]
        assert isinstance(entry.hi, DTensor) and entry.shape == want.shape and entry.hi.placements == want.placements
        live = dict(model.named_parameters())[fqn].to_local()
        assert entry.hi.to_local().data_ptr() == live.data_ptr()
        assert torch.equal(entry.join().to_local().view(torch.int32), want.to_local().view(torch.int32))
    same = joined_masters(split)
    for fqn, want in joined["model"].items():
        assert torch.equal(same["model"][fqn].to_local(), want.to_local()), fqn
    assert split["optimizer"]["state"].keys() == joined["optimizer"]["state"].keys()
    try:
        get_state_dict(model, opt, masters="halves")
    except ValueError as e:
        assert "masters='halves' is not one of ('joined', 'split')" in str(e)
    else:
        raise AssertionError("masters='halves' was taken")
    return len(entries)


def _split_masters_round_trip(path):
    from moeshard.fsdp_moe import load_checkpoint, save_checkpoint
    from moeshard.fsdp_moe._local_adamw import LocalExpertAdamW

    meshes, model, opt = _build(2, seed=0, lr=1e-2, fuse=True, bf16=True)  # EP 2 x 1, bf16 compute
    local = next(o for o in opt.optimizers if isinstance(o, LocalExpertAdamW))
    split = all("master_low" in local.state[p] for g in local.param_groups for p in g["params"])
    _step(model, opt, meshes, seed=1)
    split = split and _split_entries_join_to_the_joined_dict(model, opt) == 4
    save_checkpoint(path, model, opt)
    saved = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    after = _snapshot(model, opt)
    meshes, model, opt = _build(2, seed=7, lr=5e-3, fuse=True, bf16=True)  # other weights and lr
    load_checkpoint(path, model, opt)
    loaded = _snapshot(model, opt)
    _step(model, opt, meshes, seed=2)
    return split, saved, after, loaded, _snapshot(model, opt)


def test_split_masters_are_saved_as_float32_and_continue_bit_for_bit(tmp_path):
    split, saved, after, loaded, next_ = run_distributed(_split_masters_round_trip, 2, str(tmp_path))[0]
    assert split
    meta = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert meta["model.layers.0.experts.gate_up_proj"].properties.dtype == torch.float32
    assert not [k for k in meta if "master" in k]
    _same(loaded, saved, "loading split masters")
    _same(next_, after, "the step after the load")
