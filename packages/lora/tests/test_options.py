"""LoraOptions: PEFT's scaling, validation in one line each, unknown keys named."""

import math

import pytest

from moeshard.lora import LoraOptions


def test_scaling_is_peft_s():
    assert LoraOptions(rank=8, alpha=16, target_modules=("q_proj",)).scaling == 2.0
    assert LoraOptions(rank=16, alpha=8, use_rslora=True, target_modules=("q_proj",)).scaling == 8 / math.sqrt(16)
    assert not LoraOptions().enabled
    with pytest.raises(ValueError, match="LoRA is off"):
        _ = LoraOptions().scaling


def test_lists_become_tuples_and_describe():
    o = LoraOptions(rank=4, alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    assert o.target_modules == ("q_proj",) and o.target_parameters == ("mlp.experts.down_proj",)
    assert o.describe() == "lora: rank 4, alpha/r = 2; modules: q_proj; parameters: mlp.experts.down_proj"
    assert LoraOptions().describe() == "lora: off"
    with_dropout = LoraOptions(rank=4, alpha=8, target_modules=["q_proj"], dropout=0.05)
    assert with_dropout.describe() == "lora: rank 4, alpha/r = 2, dropout 0.05; modules: q_proj; parameters: -"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": -1}, r"LoraOptions.rank=-1 must be an integer >= 0"),
        ({"rank": 2.5}, r"LoraOptions.rank=2.5"),
        ({"alpha": 0}, r"LoraOptions.alpha=0 must be a number > 0"),
        ({"use_rslora": "yes"}, r"LoraOptions.use_rslora='yes' must be true or false"),
        ({"target_modules": ["q_proj", 3]}, r"LoraOptions.target_modules=.* must be a list of module names"),
        ({"target_parameters": "mlp.experts.down_proj"}, r"LoraOptions.target_parameters=.* must be a list"),
        ({"rank": 8}, r"LoraOptions.rank=8 but nothing is targeted"),
        ({"init_from": ""}, r"LoraOptions.init_from='' must be the path"),
        ({"dropout": 1.0}, r"LoraOptions.dropout=1.0 must be a number in \[0, 1\)"),
        ({"dropout": True}, r"LoraOptions.dropout=True must be a number"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        LoraOptions(**kwargs)
    assert "\n" not in str(e.value)


def test_from_dict_names_an_unknown_key():
    assert LoraOptions.from_dict({"rank": 2, "target_modules": ["o_proj"]}).rank == 2
    with pytest.raises(ValueError, match=r"lora: unknown option 'lora_dropout'; the options are rank, alpha"):
        LoraOptions.from_dict({"rank": 2, "lora_dropout": 0.1})
