"""GPT-OSS's facts: its sliding-window layers count the keys a query sees (``attention_window``), not S/2."""

from moeshard.models.gptoss import FAMILY, get_preset_config


def test_gpt_oss_sliding_layers_count_their_window():
    facts = FAMILY.facts(get_preset_config("gpt-oss-20b"))
    width = 64 * (64 + 64)
    assert facts.windowed_attention == ((128, width),) * 12 and facts.attention_width == 12 * width
    at_4k = 6 * facts.matmul_parameters + 6 * 2048 * 12 * width + 6 * (128 - 128 * 128 / 8192) * 12 * width
    assert facts.flops_per_token(4096) == at_4k
