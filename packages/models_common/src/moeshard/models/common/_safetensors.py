"""A local directory of safetensors shards, read lazily: headers up front, tensor slices on demand.

Only headers are parsed when the directory is opened (so a truncated or corrupt file is reported before any
parameter is touched); :meth:`SafetensorsDir.read` opens one file at a time through ``safe_open``/``get_slice``,
which reads just the bytes of the requested slice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["INDEX_NAME", "CheckpointError", "SafetensorsDir", "TensorInfo", "torch_dtype"]

INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded checkpoint (key -> shard file)."""

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the key or file and the fix."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` → ``torch.bfloat16``)."""
    if name not in _DTYPES:
        raise CheckpointError(f"safetensors dtype {name!r} is not supported (known: {sorted(_DTYPES)})")
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _corrupt(file: Path, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt: "
        "copy or download it again, or re-save the checkpoint"
    )


class SafetensorsDir:
    """The tensors of one checkpoint directory, by key.

    Uses ``model.safetensors.index.json`` when present (every file it names must exist and hold the keys it lists),
    else every ``*.safetensors`` file in the directory (a key in two files is an error).

    Raises:
        FileNotFoundError: the directory, or a file named by the index, does not exist; no safetensors files.
        CheckpointError: unreadable index, truncated/corrupt file, duplicate key, key missing from its file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"checkpoint directory {self.path} does not exist or is not a directory; pass the local folder "
                "holding config.json and *.safetensors (download it first: no network access is attempted)"
            )
        self.tensors: dict[str, TensorInfo] = {}
        index_file = self.path / INDEX_NAME
        if index_file.exists():
            self._from_index(index_file)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors files in {self.path}; a HF checkpoint directory holds model.safetensors or "
                    f"model-0000X-of-0000N.safetensors shards (with {INDEX_NAME})"
                )
            for file in files:
                for info in self._headers(file):
                    if info.key in self.tensors:
                        raise CheckpointError(
                            f"key {info.key} is in both {self.tensors[info.key].file.name} and {file.name}; "
                            f"remove the stray file from {self.path} (or add a {INDEX_NAME})"
                        )
                    self.tensors[info.key] = info

    def _from_index(self, index_file: Path) -> None:
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index_file} is not a valid safetensors index ({err!r}); it needs a 'weight_map' object "
                "of key -> file name: fix it, or delete it to use every *.safetensors file"
            ) from None
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        for name, keys in by_file.items():
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(
                    f"{index_file.name} maps {len(keys)} key(s) (e.g. {keys[0]}) to {name}, which is not in "
                    f"{self.path}; copy the missing shard or fix the index"
                )
            found = {info.key: info for info in self._headers(file)}
            for key in keys:
                if key not in found:
                    raise CheckpointError(
                        f"{index_file.name} says {key} is in {name}, but that file does not contain it; the index "
                        "and the shards are from different checkpoints: re-copy the checkpoint"
                    )
                self.tensors[key] = found[key]

    @staticmethod
    def _headers(file: Path) -> Iterator[TensorInfo]:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                infos = []
                for key in f.keys():
                    sl = f.get_slice(key)
                    infos.append(TensorInfo(key, file, tuple(sl.get_shape()), torch_dtype(sl.get_dtype())))
        except (SafetensorError, OSError) as err:
            raise _corrupt(file, err) from None
        yield from infos

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> set[str]:
        """All tensor keys of the checkpoint."""
        return set(self.tensors)

    def info(self, key: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``key``."""
        return self.tensors[key]

    def read(self, requests: Iterable[tuple[str, tuple[slice, ...]]]) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield ``(request index, key, tensor slice)`` for each ``(key, slices)``, one file open at a time.

        Slices index the stored tensor (one slice per dim). Requests are served grouped by file; the caller
        copies each slice where it belongs, so host memory holds one slice at a time beyond the destination.
        """
        by_file: dict[Path, list[tuple[int, str, tuple[slice, ...]]]] = {}
        for i, (key, slices) in enumerate(requests):
            by_file.setdefault(self.tensors[key].file, []).append((i, key, slices))
        for file, reqs in by_file.items():
            try:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for i, key, slices in reqs:  # the stored name: a folder layout may file it under another
                        yield i, key, f.get_slice(self.tensors[key].key)[slices]
            except (SafetensorError, OSError) as err:
                raise _corrupt(file, err) from None
