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
