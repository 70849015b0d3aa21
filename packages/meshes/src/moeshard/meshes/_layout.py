"""Pure rank arithmetic for the two meshes: no process group, no torch.distributed.

Ranks are laid out row-major over the expert mesh ``(ep_fsdp, ep)``: rank = ep_fsdp_index * ep_size + ep_index.
EP groups are therefore runs of consecutive ranks, which stay inside one node when ``ranks_per_node`` is a
multiple of ``ep_size``; ep_fsdp groups take one rank from each EP group (rank ``j``, ``j + ep_size``, ...).

Sequence groups (Ulysses, ``sp_size`` ranks sharing each row) are runs of ``sp_size`` consecutive ranks too, inside
one node; they cut neither the expert mesh nor the FSDP mesh: data-parallel rank ``rank // sp_size`` of
``world_size / sp_size`` reads the rows, and every rank of its sequence group takes its shard of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MeshAxis(str, Enum):
    """Names of the mesh axes (the word *dim* is kept for tensor dimensions)."""

    FSDP = "fsdp"
    EP_FSDP = "ep_fsdp"
    EP = "ep"
    DP = "dp"
    SP = "sp"


@dataclass(frozen=True)
class MeshLayout:
    """The validated rank layout of one job: sizes, groups per axis and rank→node mapping.

    Build it with :func:`plan_layout`, which validates; the constructor does not.
    """

    world_size: int
    ranks_per_node: int
    ep_size: int
    sp_size: int = 1

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: the groups of ranks that read different rows (``world_size / sp_size``)."""
        return self.world_size // self.sp_size

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel index of ``rank``: which rows it reads (shared by its sequence group)."""
        self._check_rank(rank)
        return rank // self.sp_size

    def sp_rank_of(self, rank: int) -> int:
        """``rank``'s index in its sequence group: which shard of each row it holds."""
        self._check_rank(rank)
        return rank % self.sp_size

    def sp_groups(self) -> list[list[int]]:
        """All sequence groups (consecutive ranks sharing each row), in order."""
        sp = self.sp_size
        return [list(range(i * sp, (i + 1) * sp)) for i in range(self.dp_size)]

    def sp_group_of(self, rank: int) -> list[int]:
        """The sequence group that contains ``rank``."""
        return self.sp_groups()[self.dp_rank_of(rank)]

    @property
    def ep_fsdp_size(self) -> int:
        """Number of ranks holding the same experts (one per EP group)."""
        return self.world_size // self.ep_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the job."""
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Index of the node that holds ``rank``."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def ep_groups(self) -> list[list[int]]:
        """All EP groups (consecutive ranks), in order."""
        ep = self.ep_size
        return [list(range(i * ep, (i + 1) * ep)) for i in range(self.ep_fsdp_size)]

    def ep_fsdp_groups(self) -> list[list[int]]:
        """All ep_fsdp groups (ranks holding the same experts), in order."""
        ep = self.ep_size
        return [list(range(j, self.world_size, ep)) for j in range(ep)]

    def fsdp_group(self) -> list[int]:
        """The global FSDP group: every rank."""
        return list(range(self.world_size))

    def ep_group_of(self, rank: int) -> list[int]:
        """The EP group that contains ``rank``."""
        self._check_rank(rank)
        return self.ep_groups()[rank // self.ep_size]

    def ep_fsdp_group_of(self, rank: int) -> list[int]:
        """The ep_fsdp group that contains ``rank``."""
        self._check_rank(rank)
        return self.ep_fsdp_groups()[rank % self.ep_size]

    def ep_crosses_nodes(self) -> bool:
        """Whether some EP group spans two nodes (its all-to-all would leave NVLink)."""
        return any(self.node_of(g[0]) != self.node_of(g[-1]) for g in self.ep_groups())

    def describe(self) -> str:
        """A readable multi-line description of the layout and its groups per axis."""

        def fmt(groups: list[list[int]]) -> str:
            shown = ", ".join(_fmt_group(g) for g in groups[:8])
            return shown + (f", ... ({len(groups)} groups)" if len(groups) > 8 else "")

        lines = [
            f"world {self.world_size} = {self.num_nodes} node(s) x {self.ranks_per_node} ranks; "
            f"ep {self.ep_size} x ep_fsdp {self.ep_fsdp_size}"
            + (f"; sp {self.sp_size} x dp {self.dp_size}" if self.sp_size > 1 else ""),
            f"  {MeshAxis.FSDP.value:8s} (non-expert params, dim 0): {fmt([self.fsdp_group()])}",
            f"  {MeshAxis.EP.value:8s} (experts dim 0, all-to-all): {fmt(self.ep_groups())}",
            f"  {MeshAxis.EP_FSDP.value:8s} (experts dim 1):          {fmt(self.ep_fsdp_groups())}",
        ]
        if self.sp_size > 1:
            lines.append(f"  {MeshAxis.SP.value:8s} (row shards, attention all-to-all): {fmt(self.sp_groups())}")
        return "\n".join(lines)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")


def _fmt_group(g: list[int]) -> str:
    contiguous = len(g) > 3 and g == list(range(g[0], g[-1] + 1))
    return f"[{g[0]}..{g[-1]}]" if contiguous else "[" + ",".join(map(str, g)) + "]"


def plan_layout(
    world_size: int,
    ranks_per_node: int,
    ep_size: int,
    *,
    allow_cross_node_ep: bool = False,
    sp_size: int = 1,
) -> MeshLayout:
    """Validate sizes and return the layout.

    Args:
        world_size: total number of ranks.
        ranks_per_node: ranks (GPUs) per node, e.g. ``LOCAL_WORLD_SIZE``.
        ep_size: expert-parallel degree; EP groups are ``ep_size`` consecutive ranks.
        allow_cross_node_ep: accept EP groups that span nodes (slow all-to-all over the network).
        sp_size: sequence-parallel degree (Ulysses); sequence groups are ``sp_size`` consecutive ranks of one node.

    Raises:
        ValueError: one message per problem, naming the numbers and the fix.
    """
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(
            f"ep_size must be an integer >= 1, got {ep_size!r}; use ep_size=1 to disable expert parallelism"
        )
    if world_size % ranks_per_node != 0:
        raise ValueError(
            f"world size {world_size} is not a multiple of ranks per node {ranks_per_node}; "
            "launch the same number of processes on every node"
        )
    if world_size % ep_size != 0:
        raise ValueError(
            f"ep_size {ep_size} does not divide world size {world_size}; "
            f"choose an ep_size that divides {world_size} (ep_size x ep_fsdp_size must equal the world size)"
        )
    if not allow_cross_node_ep and (ep_size > ranks_per_node or ranks_per_node % ep_size != 0):
        raise ValueError(
            f"EP groups of ep_size {ep_size} would cross a node boundary with {ranks_per_node} ranks per node; "
            f"choose an ep_size that divides {ranks_per_node} so the all-to-all stays inside a node, "
            "or pass allow_cross_node_ep=True to accept inter-node all-to-all"
        )
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(
            f"sp_size must be an integer >= 1, got {sp_size!r}; use sp_size=1 to disable sequence parallelism"
        )
    if ranks_per_node % sp_size != 0:
        raise ValueError(
            f"sp_size {sp_size} does not divide the {ranks_per_node} ranks per node (world size {world_size}); "
            f"choose an sp_size that divides {ranks_per_node} so each sequence group's all-to-all stays inside a node"
        )
    return MeshLayout(world_size=world_size, ranks_per_node=ranks_per_node, ep_size=ep_size, sp_size=sp_size)
