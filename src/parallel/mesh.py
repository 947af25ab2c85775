"""The data-parallel × sequence-parallel layout of the ranks (`trainer.sp_size`), and how the ranks of a group
share out work.

Rank r sits at (dp, sp) = (r // sp_size, r % sp_size): the ranks of one sequence-parallel group are
consecutive, so they share a node (they exchange activations every layer), and the ranks with the same sp
index form a data-parallel group. The ranks of one sequence-parallel group load the same clips (the loader
runs with rank = dp rank, world = dp size) and each encodes its contiguous share of the frames.

Here a group of None is a single process (the groups of an unlaunched run's Mesh), never "all ranks" as it is
for torch.distributed's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def check_sp_size(sp_size: int, world_size: int) -> None:
    """Preflight's rule for `trainer.sp_size`, which `Mesh.build` also applies."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"trainer.sp_size={sp_size} does not divide the world size {world_size}: a clip's frames are split "
            f"over sp_size ranks, so set it to a divisor of {world_size}"
        )


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks of `group`; 1 for None (a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def share_sizes(count: int, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """How many of `count` items each rank of `group` takes, in rank order (earlier ranks get the remainder)."""
    base, extra = divmod(count, group_size(group))
    return tuple(base + (rank < extra) for rank in range(group_size(group)))


def share(count: int, group: dist.ProcessGroup | None) -> slice:
    """This rank's contiguous share of `count` items split over `group`; everything without a group."""
    sizes = share_sizes(count, group)
    rank = 0 if group is None else dist.get_rank(group)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


@dataclass(frozen=True)
class Mesh:
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    # None on a single process; otherwise real groups, also of size 1, so that a collective on them never
    # means "all ranks" the way group=None does.
    dp_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None

    @classmethod
    def build(cls, sp_size: int, world_size: int) -> Mesh:
        check_sp_size(sp_size, world_size)
        if not dist.is_initialized():
            return cls(0, 1, 0, 1, None, None)
        rank, dp_size = dist.get_rank(), world_size // sp_size
        # Every rank creates every group, in the same order (new_group is collective).
        sp_groups = [dist.new_group(list(range(d * sp_size, (d + 1) * sp_size))) for d in range(dp_size)]
        dp_groups = [dist.new_group(list(range(s, world_size, sp_size))) for s in range(sp_size)]
        dp_rank, sp_rank = divmod(rank, sp_size)
        return cls(dp_rank, dp_size, sp_rank, sp_size, dp_groups[sp_rank], sp_groups[dp_rank])

    def frames(self, total: int) -> slice:
        """This rank's contiguous share of a clip's `total` frames."""
        if total % self.sp_size:
            raise ValueError(f"data.frames={total} is not divisible by trainer.sp_size={self.sp_size}: each "
                             "sequence-parallel rank encodes an equal share of the frames; pick data.frames as a "
                             f"multiple of {self.sp_size}")
        per_rank = total // self.sp_size
        return slice(self.sp_rank * per_rank, (self.sp_rank + 1) * per_rank)
