"""The data section of a job: one frozen dataclass per source, one for the section, built from YAML-like dicts.

Exactly one of ``synthetic``, ``path`` (one source) or ``sources`` (a weighted mixture) says where rows come from.
A path is a file (``.jsonl``, ``.jsonl.gz``, ``.parquet``, ``.arrow``), a directory of such files, an HF
``datasets`` ``save_to_disk`` folder, a folder written by :func:`moeshard.data.prepare`, a glob, or a list of those.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from moeshard.data._errors import DataError


def _paths(value: Any, key: str) -> str | tuple[str, ...]:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise DataError(f"{key} must be a path or a non-empty list of paths, got {value!r}")


def _default_name(path: str | tuple[str, ...]) -> str:
    first = path if isinstance(path, str) else path[0]
    name = PurePath(first.rstrip("/")).name or first
    for suffix in (".gz", ".jsonl", ".json", ".parquet", ".arrow"):
        name = name.removesuffix(suffix)
    return name


@dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture.

    ``path``: as ``DataConfig.path``; ``weight``: its share of the rows (> 0; normalised over the sources);
    ``name``: what logs call it (default: the file or folder name of its first path).
    """

    path: str | tuple[str, ...]
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _paths(self.path, "data.sources[].path"))
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise DataError(f"source {self.path!r}: weight must be a number > 0, got {w!r}; drop the source instead")
        object.__setattr__(self, "weight", float(w))
        if not self.name:
            object.__setattr__(self, "name", _default_name(self.path))


@dataclass(frozen=True)
class DataConfig:
    """Where training rows come from and how they are cut.

    ``path`` (one source) or ``sources`` (a mixture) or ``synthetic`` (generated arithmetic sequences, the CPU
    smoke test); ``tokenizer``: a local tokenizer folder, needed for raw ``text``/``messages`` records (prepared
    folders are already tokenised); ``seq_len``: tokens per row; ``packing``: document-masked packing (rows are
    windows of the token stream) or one padded document piece per row; ``shuffle``/``seed``: a seeded permutation
    of each source's rows per epoch; ``synthetic_samples``: rows of synthetic data.
    """

    path: str | tuple[str, ...] | None = None
    sources: tuple[SourceConfig, ...] = ()
    tokenizer: str | None = None
    seq_len: int = 64
    packing: bool = True
    shuffle: bool = False
    seed: int = 0
    synthetic: bool = False
    synthetic_samples: int = 4096

    def __post_init__(self) -> None:
        if self.path is not None:
            object.__setattr__(self, "path", _paths(self.path, "data.path"))
        srcs = tuple(s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.sources)
        object.__setattr__(self, "sources", srcs)
        given = [k for k, on in (("synthetic", self.synthetic), ("path", self.path), ("sources", srcs)) if on]
        if len(given) != 1:
            raise DataError(
                f"data: set exactly one of data.synthetic, data.path or data.sources (got {given or 'none'})"
            )
        names = [s.name for s in srcs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise DataError(f"data.sources: two sources are named {dup!r}; give each a distinct name")
        for key in ("seq_len", "seed", "synthetic_samples"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise DataError(f"data.{key} must be an integer, got {v!r}")
        for key in ("packing", "shuffle", "synthetic"):
            if not isinstance(getattr(self, key), bool):
                raise DataError(f"data.{key} must be true or false, got {getattr(self, key)!r}")
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and self.tokenizer):
            raise DataError(f"data.tokenizer must be a local tokenizer folder, got {self.tokenizer!r}")
        if self.seq_len < 2:
            raise DataError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.synthetic and self.synthetic_samples < 1:
            raise DataError(f"data.synthetic_samples must be >= 1, got {self.synthetic_samples}")

    def source_list(self) -> tuple[SourceConfig, ...]:
        """The sources: ``sources``, or ``path`` as one source of weight 1 (empty for synthetic data)."""
        if self.path is not None:
            return (SourceConfig(self.path),)
        return self.sources

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], section: str = "data") -> DataConfig:
        """Build from a YAML mapping; an unknown key is an error naming it (``data.sources[1].wieght``).

        Raises:
            DataError: an unknown key, a wrong type, or an inconsistent value.
        """
        if not isinstance(raw, Mapping):
            raise DataError(f"section {section!r} must be a mapping, got {raw!r}")
        _check_keys(raw, cls, section)
        kwargs = dict(raw)
        if "sources" in kwargs:
            srcs = kwargs["sources"]
            if not isinstance(srcs, (list, tuple)):
                raise DataError(f"{section}.sources must be a list of {{path, weight, name}} mappings, got {srcs!r}")
            built = []
            for i, s in enumerate(srcs):
                if not isinstance(s, Mapping):
                    raise DataError(f"{section}.sources[{i}] must be a mapping with path and weight, got {s!r}")
                _check_keys(s, SourceConfig, f"{section}.sources[{i}]")
                if "path" not in s:
                    raise DataError(f"{section}.sources[{i}] has no path")
                try:
                    built.append(SourceConfig(**s))
                except DataError as e:
                    raise DataError(f"{section}.sources[{i}]: {e}") from None
            kwargs["sources"] = tuple(built)
        return cls(**kwargs)


def _check_keys(raw: Mapping[str, Any], cls: type, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {where}.{near[0]}?" if near else f"; known keys: {', '.join(sorted(known))}"
            raise DataError(f"unknown config key {where}.{key}{hint}")
