"""The ``parallel:`` section of the job: ``moeshard.models.common.ParallelOptions`` itself (``parallel.ep`` is its
``moeshard.ep.EPOptions``) plus the job's mesh keys, ``ep_size`` and ``allow_cross_node_ep``.

Each key is the field of that name: the packages' fields name, limit and explain theirs (``help`` metadata; their
``ValueError`` is reported in the job's key names by :func:`moeshard.train.config.parse.section_from_dict`), and
:class:`ParallelConfig` adds the job's own. ``config --show`` and the README's table are read from the same fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moeshard.models.common import ParallelOptions

__all__ = ["ParallelConfig", "parallel_options"]


@dataclass(frozen=True)
class ParallelConfig(ParallelOptions):
    """``parallel``: every field of ``moeshard.models.common.ParallelOptions`` (``ep``: ``moeshard.ep.EPOptions``)
    and the mesh of ``moeshard.meshes.build_meshes``; :func:`parallel_options` gives the packages their part."""

    ep_size: int = field(
        default=2, metadata={"help": "expert-parallel ranks (divides the ranks per node and the experts)"}
    )
    allow_cross_node_ep: bool = field(
        default=False, metadata={"help": "let an EP group span nodes (its all-to-all then crosses the slow links)"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        size = self.ep_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"ParallelConfig.ep_size={size!r} is not allowed: an int >= 1 (1: no expert parallelism)")
        if not isinstance(self.allow_cross_node_ep, bool):
            raise ValueError(
                f"ParallelConfig.allow_cross_node_ep={self.allow_cross_node_ep!r} is not allowed: true or false"
            )


def parallel_options(cfg: Any) -> ParallelOptions:
    """The job's ``parallel`` section as the ``ParallelOptions`` that training, ``plan`` and ``bench`` pass to
    ``parallelize`` (the section less the mesh keys; it was checked when it was made)."""
    p = cfg.parallel
    return ParallelOptions(**{f.name: getattr(p, f.name) for f in dataclasses.fields(ParallelOptions)})
