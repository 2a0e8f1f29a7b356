"""One rank's values to every rank of a data-parallel mesh: ``broadcast_from``, ``agree_on``.

``shard()`` starts every rank from the first rank's initial values (as DDP and DeepSpeed do), and
``z3.gathered(model, modifier_rank=r)`` hands rank ``r``'s writes to every rank: both are
broadcasts over the model's mesh. Tensors travel in buckets of one dtype (one collective per
bucket, not per tensor); on a 2-D (hybrid) mesh the source's values cross the rows first (within
its column), then each row (from its member in the source's column).

Before a broadcast the ranks check that they hold the same list of tensors (``agree_on``): a
digest of the names, shapes and dtypes compared over the mesh (``cluster.same``), so a rank with
another model raises a clear error instead of corrupting memory or hanging in a collective of
another size.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..cluster import same
from ..runtime.guard import CollectiveMismatchError
from ..sharding.mesh import DataParallelMesh

BUCKET_BYTES = 64 << 20  # of a broadcast's flattened bucket (a larger tensor goes alone)


def mesh_device(dp: DataParallelMesh) -> torch.device:
    """Where the mesh's collectives take their tensors."""
    if dp.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(dp.mesh.device_type)


def all_reduce_mesh(tensor: torch.Tensor, dp: DataParallelMesh, op=dist.ReduceOp.SUM) -> None:
    """In place, over every rank of ``dp``'s mesh (SUM, MIN, MAX compose over its two groups)."""
    dist.all_reduce(tensor, op=op, group=dp.shard_group)
    if dp.replicate_group is not None:
        dist.all_reduce(tensor, op=op, group=dp.replicate_group)


def agree_on(dp: DataParallelMesh, entries: Sequence[str], what: str) -> None:
    """Raise ``CollectiveMismatchError`` on every rank, naming the ranks that differ, unless every
    rank of the mesh passed the same ``entries``: a digest of them compared over the mesh
    (``cluster.same``: one small object all-gather per mesh dimension)."""

    def mismatch(holders: list[list[int]]) -> CollectiveMismatchError:
        described = "; ".join(
            " and ".join(f"rank {r}" for r in ranks) + f" hold list {i + 1}"
            for i, ranks in enumerate(holders)
        )
        return CollectiveMismatchError(
            f"zero3: the ranks hold different {what} ({described}; this rank, rank "
            f"{dist.get_rank()}: {len(entries)} entries, first {list(entries[:3])}); every rank "
            "must build the same model and call this with the same arguments"
        )

    digest = zlib.crc32("\n".join(entries).encode())
    same(digest, over=(dp.shard_group, dp.replicate_group), error=mismatch)


def describe_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """What ``agree_on`` compares: each tensor's name, shape, dtype and whether it is meta."""
    return [
        f"{name}:{tuple(t.shape)}:{t.dtype}:{'meta' if t.device.type == 'meta' else ''}"
        for name, t in named
    ]


def source_rank(dp: DataParallelMesh, src: int | None) -> int:
    """The global rank whose values win (default: the mesh's first rank); checked."""
    ranks = dp.ranks
    if src is None:
        return ranks[0]
    if not isinstance(src, int) or isinstance(src, bool) or src not in ranks:
        raise ValueError(
            f"zero3: modifier rank {src!r} is not a rank of the model's mesh (ranks {ranks}); "
            "pass the global rank that made the changes"
        )
    return src


@torch.no_grad()
def broadcast_from(
    tensors: Sequence[torch.Tensor], dp: DataParallelMesh, src: int, coalesce: bool = True
) -> None:
    """Every rank of the mesh gets global rank ``src``'s values of ``tensors``, in place.
    ``coalesce=False``: one collective per tensor, no bucket copy (where memory is counted)."""
    if not tensors:
        return
    if dp.replicate_group is None:
        _broadcast(tensors, dp, src, dp.shard_group, coalesce)
        return
    grid = dp.mesh.mesh
    shard_dim = next(i for i, p in enumerate(dp.placements) if p.is_shard())
    where = (grid == src).nonzero()[0].tolist()
    mine = dp.mesh.get_coordinate()
    if mine[shard_dim] == where[shard_dim]:  # the source's column: across the rows first
        _broadcast(tensors, dp, src, dp.replicate_group, coalesce)
    row_source = list(mine)
    row_source[shard_dim] = where[shard_dim]
    _broadcast(tensors, dp, int(grid[tuple(row_source)]), dp.shard_group, coalesce)


def _broadcast(tensors, dp: DataParallelMesh, src: int, group, coalesce: bool) -> None:
    device = mesh_device(dp)
    buckets = _buckets(tensors) if coalesce else [[t] for t in tensors if t.numel()]
    for bucket in buckets:
        if len(bucket) == 1 and _in_place_ok(bucket[0], device):
            dist.broadcast(_wire(bucket[0]), src=src, group=group)
            continue
        flat = torch.cat([_wire(t).reshape(-1).to(device) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in bucket:
            wire = _wire(t)
            wire.copy_(flat[offset : offset + t.numel()].view(wire.shape))
            offset += t.numel()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective takes it (bool as bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _in_place_ok(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device


def _buckets(tensors) -> list[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        buckets = by_dtype.setdefault(t.dtype, [[]])
        size = t.numel() * t.element_size()
        if buckets[-1] and sizes[t.dtype] + size > BUCKET_BYTES:
            buckets.append([])
            sizes[t.dtype] = 0
        buckets[-1].append(t)
        sizes[t.dtype] = sizes.get(t.dtype, 0) + size
    return [bucket for buckets in by_dtype.values() for bucket in buckets if bucket]
