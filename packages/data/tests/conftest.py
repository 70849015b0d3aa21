"""Shared fixtures: a tiny byte-level BPE tokenizer with Qwen-style (ChatML) chat templates, built locally."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-style ChatML (a default system prompt when none is given).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same text, with transformers' {% generation %} markers around the assistant's content and end of turn.
CHATML_GENERATION = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's behaviour: earlier turns lose their <think> block; the last turn after the last user query keeps one.
QWEN3 = (
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "mixture of experts models route tokens to experts",
    "packing documents into rows of exactly seq_len tokens",
    "you are a helpful assistant. what is two plus two? four.",
]


def _build_tokenizer(folder: Path, template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """A local tokenizer folder (ChatML template, EOS <|im_end|>)."""
    return _build_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


@pytest.fixture(scope="session")
def make_tok_dir(tmp_path_factory):
    """Build a tokenizer folder with another chat template."""

    def make(template: str) -> Path:
        return _build_tokenizer(tmp_path_factory.mktemp("tok"), template)

    return make


def write_jsonl(path: Path, records: list[dict], gz: bool = False) -> Path:
    """Write records as JSON lines (gzip-compressed with ``gz``)."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def write_parquet(path: Path, records: list[dict], row_group_size: int | None = None) -> Path:
    """Write records as a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def write():
    """``write.jsonl(path, records, gz=False)`` and ``write.parquet(path, records, row_group_size=None)``."""
    from types import SimpleNamespace

    return SimpleNamespace(jsonl=write_jsonl, parquet=write_parquet)


@pytest.fixture(scope="session")
def templates() -> dict[str, str]:
    """Chat templates: ``chatml`` (Qwen2.5-style), ``chatml_generation`` (same text, generation markers), ``qwen3``."""
    return {"chatml": CHATML, "chatml_generation": CHATML_GENERATION, "qwen3": QWEN3}
