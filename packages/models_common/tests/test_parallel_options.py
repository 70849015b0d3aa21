"""ParallelOptions' fields are the vocabulary of every front end: each names, limits and explains itself."""

import dataclasses
import typing

import pytest

from moeshard.ep import EPOptions
from moeshard.models.common import ParallelOptions


def test_every_field_explains_itself():
    hints = typing.get_type_hints(ParallelOptions)
    for f in dataclasses.fields(ParallelOptions):
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], f.name
        for choice in typing.get_args(hints[f.name]):  # the choices of a Literal field are explained in its help
            if isinstance(choice, str):
                assert f"`{choice}`" in f.metadata["help"] or f'`"{choice}"`' in f.metadata["help"], (f.name, choice)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefetch_depth": -1}, r"^ParallelOptions.prefetch_depth=-1 is not allowed: an int >= 0"),
        ({"param_dtype": "fp16"}, r"^ParallelOptions.param_dtype='fp16' is not one of"),
        ({"compile": 1}, r"^ParallelOptions.compile=1 is not allowed: True or False"),
        (
            {"ep": EPOptions(recompute="mlp")},
            r"^ParallelOptions.ep.recompute='mlp' is not allowed: set ParallelOptions.activation_checkpointing="
            r"'selective' and ParallelOptions.selective_recompute='mlp' instead",
        ),
    ],
)
def test_errors_name_the_field(kwargs, message):
    """A refusal names the field as ``ParallelOptions.<field>`` (a front end puts its own key name there)."""
    with pytest.raises(ValueError, match=message):
        ParallelOptions(**kwargs)
