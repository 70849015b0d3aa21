"""``check_layout`` (training, ``plan`` and ``launch-local`` alike) refuses an sp that cannot shard the job, one line
each naming the key and the fix, and counts rows per data-parallel group (world / sp)."""

import pytest

from moeshard.train.config import ConfigError, check_layout, load_config


def _cfg(*extra):
    return load_config(None, ["--model.preset=tiny", "--parallel.ep_size=2", "--data.seq_len=64", *extra])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--parallel.sp_size=3"], "parallel.sp_size: sp_size 3 does not divide the 8 ranks per node"),
        (["--parallel.sp_size=8"], "num_attention_heads=4 is not divisible by parallel.sp_size=8"),
        (["--parallel.sp_size=4", "--data.seq_len=66"], "set data.seq_len to a multiple of 4 (e.g. 68)"),
    ],
)
def test_sp_refusals_are_one_line_naming_the_key(extra, needle):
    with pytest.raises(ConfigError) as info:
        check_layout(_cfg(*extra), world_size=8, ranks_per_node=8)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_global_batch_counts_rows_per_data_parallel_group():
    # 8 ranks at sp 4: 2 data-parallel groups, so 2 rows make a step of one micro-batch each
    checked = check_layout(
        _cfg("--parallel.sp_size=4", "--train.global_batch_size=2", "--train.micro_batch_size=1"),
        world_size=8,
        ranks_per_node=8,
    )
    assert (checked.mesh.dp_size, checked.micro_batches) == (2, 1)
    with pytest.raises(ConfigError, match="smaller than the 8 data-parallel ranks"):
        check_layout(_cfg("--train.global_batch_size=2", "--train.micro_batch_size=1"), world_size=8, ranks_per_node=8)


def test_comm_estimate_adds_the_attentions_all_to_all_inside_the_node():
    from moeshard.models.qwen3moe import get_preset_config
    from moeshard.train.observe.comm import estimate_comm_bytes

    cfg = get_preset_config("qwen3-30b-a3b")
    common = dict(world_size=16, ranks_per_node=8, ep_size=8, tokens_per_rank=4096, micro_batches=1)
    base = estimate_comm_bytes(cfg, **common, compute_bytes=2, reshard_after_forward=True)
    sp8 = estimate_comm_bytes(cfg, **common, compute_bytes=2, reshard_after_forward=True, sp_size=8)
    ckpt = estimate_comm_bytes(
        cfg, **common, compute_bytes=2, reshard_after_forward=True, sp_size=8, activation_checkpointing=True
    )
    assert not any(kind == "sp_all_to_all" for kind, _ in base)
    assert {k: v for k, v in sp8.items() if k[0] != "sp_all_to_all"} == base  # nothing else changes
    # 48 layers x (q: 32 heads + out: 32 heads + k, v: 4 heads replicated to 8) x 128 wide, bf16, 7/8 to peers,
    # forward and backward
    want = 4096 * 48 * (32 + 32 + 8 + 8) * 128 * 2 * 7 / 8 * 2
    assert sp8[("sp_all_to_all", "intra-node")] == pytest.approx(want)
    assert ("sp_all_to_all", "inter-node") not in sp8
    assert ckpt[("sp_all_to_all", "intra-node")] == pytest.approx(want * 3 / 2)  # the recompute exchanges again
