"""Records to documents: token ids plus a per-token loss mask, EOS appended.

A document is ``(ids, mask)``: ``uint32`` ids and, for sources with masks, a ``uint8`` loss mask where
``mask[t] = 1`` means token ``t`` is a target (predicted from token ``t - 1``). Plain text trains on every token.
Chat records (``messages``) train on assistant tokens only; ``input_ids`` records on the tokens their ``labels``
(anything but -100) or ``loss_mask`` (1) select. The EOS appended after each document is a target exactly when the
document's last token is one. Empty documents are dropped.

Assistant tokens of a conversation: with a chat template that marks them (``{% generation %}``), transformers'
``return_assistant_tokens_mask``; otherwise they are located by rendering: assistant message ``i`` starts where
``render(messages[:i], add_generation_prompt=True)`` ends (a prefix of the full rendering) and ends after the
template's end-of-turn text (what the template writes after an assistant message, e.g. ``<|im_end|>``). That works
for ChatML/Qwen2.5 and for Qwen3 templates (which drop earlier turns' ``<think>`` blocks); a template for which the
prefix does not hold is refused, naming the record.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeshard.data._errors import DataError
from moeshard.data._inputs import Schema, Where

Document = tuple[np.ndarray, "np.ndarray | None"]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template", "spiece")


def load_tokenizer(path: str):
    """A transformers tokenizer from a local folder (never downloads).

    Raises:
        DataError: the path is not a local folder, or the folder holds no loadable tokenizer.
    """
    p = Path(path)
    if not p.is_dir():
        raise DataError(
            f"tokenizer {path!r} is not a local folder; download it first (e.g. `hf download Qwen/Qwen3-30B-A3B "
            "--include 'tokenizer*' 'vocab.json' 'merges.txt' --local-dir DIR`) and pass DIR"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("tokenising needs transformers: pip install 'moeshard-data[tokenize]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many types here; one line for the user
        raise DataError(
            f"tokenizer folder {path}: cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "it needs the files save_pretrained writes (tokenizer.json, tokenizer_config.json)"
        ) from None


def tokenizer_fingerprint(path: str) -> str:
    """A hash of the tokenizer files in ``path`` (not the model weights beside them)."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and f.name.startswith(_TOKENIZER_FILES):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class EncodeOptions:
    """How records become documents: the source schema, tokenizer folder, EOS, vocabulary limit (picklable)."""

    schema: Schema
    tokenizer: str | None
    eos_id: int | None
    vocab_limit: int | None
    append_eos: bool = True


class Encoder:
    """Turns record batches of one schema into documents (see the module docstring)."""

    def __init__(self, opts: EncodeOptions, tokenizer: Any = None):
        self.opts = opts
        self.tok = tokenizer
        if self.tok is None and opts.tokenizer is not None and opts.schema.kind != "tokens":
            self.tok = load_tokenizer(opts.tokenizer)
        self._turn_end: str | None = None

    @property
    def has_mask(self) -> bool:
        """Whether documents carry a loss mask (chat and ``input_ids`` + labels/loss_mask sources)."""
        return self.opts.schema.kind == "messages" or self.opts.schema.mask_field is not None

    def encode(self, records: Sequence[dict], where: Where) -> list[Document | None]:
        """One document per record (None for an empty one).

        Raises:
            DataError: a record without the source's field, a wrong type, a token id outside the vocabulary.
        """
        kind = self.opts.schema.kind
        field = self.opts.schema.columns[0]
        for i, r in enumerate(records):
            if r.get(field) is None:
                raise DataError(
                    f"{where(i)}: record has no '{field}' (keys: {sorted(r)}); every record of a source needs the "
                    "field its first record has: fix the record or move it to a source of its own"
                )
        if kind == "text":
            docs = self._text(records, where)
        elif kind == "messages":
            docs = [self._chat(r["messages"], lambda i=i: where(i)) for i, r in enumerate(records)]
        else:
            docs = [self._tokens(r, lambda i=i: where(i)) for i, r in enumerate(records)]
        return [self._finish(d, lambda i=i: where(i)) for i, d in enumerate(docs)]

    def _text(self, records: Sequence[dict], where: Where) -> list[Document]:
        texts = []
        for i, r in enumerate(records):
            if not isinstance(r["text"], str):
                raise DataError(f"{where(i)}: 'text' must be a string, got {type(r['text']).__name__}")
            texts.append(r["text"])
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [(np.asarray(x, dtype=np.int64), None) for x in ids]

    def _tokens(self, r: dict, where) -> Document:
        ids = r["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DataError(f"{where()}: input_ids must be a list of integers")
        ids_np = np.asarray(ids, dtype=np.int64)
        mf = self.opts.schema.mask_field
        if mf is None:
            return ids_np, None
        m = r.get(mf)
        if not isinstance(m, list) or len(m) != len(ids):
            raise DataError(f"{where()}: '{mf}' must be a list as long as input_ids ({len(ids)}); fix the record")
        m_np = np.asarray(m, dtype=np.int64)
        if mf == "labels":
            if not np.all((m_np == -100) | (m_np == ids_np)):
                raise DataError(
                    f"{where()}: labels must equal input_ids or be -100 (unshifted, the transformers convention); "
                    "write a loss_mask instead"
                )
            return ids_np, (m_np != -100).astype(np.uint8)
        if not np.all((m_np == 0) | (m_np == 1)):
            raise DataError(f"{where()}: loss_mask must hold only 0 and 1")
        return ids_np, m_np.astype(np.uint8)

    def _finish(self, doc: Document, where) -> Document | None:
        ids, mask = doc
        if ids.size == 0:
            return None
        if self.has_mask and mask is None:
            mask = np.ones(ids.size, dtype=np.uint8)
        lo, hi = int(ids.min()), int(ids.max())
        limit = self.opts.vocab_limit
        if lo < 0 or (limit is not None and hi >= limit):
            bad = lo if lo < 0 else hi
            raise DataError(
                f"{where()}: token id {bad} is outside the vocabulary [0, {limit}); the data was tokenised for "
                "another model (re-tokenise it, or check the vocab size)"
            )
        if self.opts.append_eos and self.opts.eos_id is not None:
            ids = np.append(ids, self.opts.eos_id)
            if mask is not None:
                mask = np.append(mask, mask[-1])
        return ids.astype(np.uint32), mask

    # ---- chat ---------------------------------------------------------------------------------------------------

    def _chat(self, messages: Any, where) -> Document:
        tok = self.tok
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise DataError(f"{where()}: 'messages' must be a non-empty list of {{role, content}} objects")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where()}: every message needs a string 'role' and 'content', got {sorted(m)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where()}: the conversation has no assistant message, so nothing to train on; drop it")
        template = tok.chat_template
        if not template:
            raise DataError(f"{where()}: the tokenizer has no chat template; use a tokenizer folder that has one")
        if not getattr(tok, "is_fast", False):
            raise DataError("chat records need a fast tokenizer (tokenizer.json) for token offsets")
        if _GENERATION_TAG.search(template if isinstance(template, str) else str(template)):
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return np.asarray(out["input_ids"], np.int64), np.asarray(out["assistant_masks"], np.uint8)
        text = tok.apply_chat_template(messages, tokenize=False)
        spans = self._assistant_spans(messages, text, where)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = np.zeros(len(enc["input_ids"]), dtype=np.uint8)
        k = 0
        for t, (a, b) in enumerate(enc["offset_mapping"]):  # a token overlapping a span is a target (as HF)
            while k < len(spans) and a >= spans[k][1]:
                k += 1
            if k == len(spans):
                break
            if b > spans[k][0]:
                mask[t] = 1
        return np.asarray(enc["input_ids"], np.int64), mask

    def _assistant_spans(self, messages: list[dict], text: str, where) -> list[tuple[int, int]]:
        tok = self.tok
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise DataError(f"{where()}: the conversation starts with an assistant message; start with a user one")
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if not text.startswith(prompt):
                raise DataError(
                    f"{where()}: the chat template does not render message {i}'s prefix stably, so its assistant "
                    "tokens cannot be located; add {% generation %} markers around assistant content to the template"
                )
            start = len(prompt)
            end = text.find(self.turn_end, start)
            if end < 0:
                raise DataError(
                    f"{where()}: assistant message {i} has no end-of-turn {self.turn_end!r} in the template"
                )
            spans.append((start, end + len(self.turn_end)))
        return spans

    @property
    def turn_end(self) -> str:
        """What the chat template writes right after an assistant message's content (e.g. ``<|im_end|>``)."""
        if self._turn_end is None:
            probe = "\x00moeshard-probe\x00"
            msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}]
            text = self.tok.apply_chat_template(msgs, tokenize=False)
            self._turn_end = text[text.rindex(probe) + len(probe) :].rstrip()
            if not self._turn_end:
                raise DataError(
                    "the chat template writes nothing after an assistant message, so assistant turns cannot be "
                    "delimited; add {% generation %} markers to the template"
                )
        return self._turn_end
