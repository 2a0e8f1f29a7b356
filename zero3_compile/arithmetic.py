"""The arithmetic around every collective, written once as plain tensor functions.

The eager operations (``ops.py``) call these functions on real tensors around a real collective;
the graph passes splice the very same functions into the scheduled graphs by tracing them
(``graph_utils.splice``). So padding, casting, flattening, the bucket layout and the division by
N exist in one place. See [Note: zero3 tensors] in ``param.py`` for the vocabulary.

All-gather of a bucket of k parameters over N ranks::

    copy-in:   flat = cat([pad(flatten(cast(shard_i)))])          # (bucket_numel,)
    collective: gathered = all_gather(flat)                        # (N * bucket_numel,)
    copy-out:  full_i = rows(view(clone(gathered.view(N, -1)[:, o_i : o_i + n_i])))

Reduce-scatter of a bucket of gradients::

    copy-in:   flat = cat([pad(flatten(cast(grad_i))).view(N, -1)], dim=1).view(-1)
    collective: reduced = reduce_scatter(flat, "sum")              # (bucket_numel,)
    copy-out:  shard_grad_i = cast(reduced[o_i : o_i + local_i].view(shape_i) / N)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .layout import ShardLayout


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, as the primitive cast: what graphs after AOTAutograd must hold
    (Inductor refuses ``aten._to_copy`` there), and it runs eagerly just as well."""
    return x if x.dtype == dtype else torch.ops.prims.convert_element_type.default(x, dtype)


def gather_dtype(shard_dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    return param_dtype or shard_dtype


def gather_bytes(layouts: Sequence[ShardLayout], dtype: torch.dtype) -> int:
    """Bytes of a gathered bucket (every rank's padded shards)."""
    return sum(layout.padded_numel * layout.world_size for layout in layouts) * dtype.itemsize


def reduce_bytes(layouts: Sequence[ShardLayout], dtype: torch.dtype) -> int:
    """Bytes of a reduce-scatter input bucket (full padded gradients)."""
    return gather_bytes(layouts, dtype)


def gather_copy_in(
    shards: Sequence[torch.Tensor], layouts: Sequence[ShardLayout], dtype: torch.dtype
) -> torch.Tensor:
    """The flat input of a bucket's all-gather: each shard cast, flattened, padded."""
    flats = []
    for shard, layout in zip(shards, layouts):
        x = cast(shard, dtype)
        x = x.reshape(-1)
        pad = layout.padded_numel - x.numel()
        if pad:
            x = F.pad(x, (0, pad))
        flats.append(x)
    return flats[0] if len(flats) == 1 else torch.cat(flats)  # (bucket_numel,)


def gather_copy_out(gathered: torch.Tensor, layouts: Sequence[ShardLayout]) -> list[torch.Tensor]:
    """The full parameters in a gathered bucket ``(N * bucket_numel,)``.

    A single parameter is a view of the buffer (its first ``dim0`` rows: padding sits only at
    the tail); in a bucket of several, each one's rows are strided across ranks and are copied.
    """
    if len(layouts) == 1:
        return [_rows(gathered.view(layouts[0].gathered_shape()), layouts[0])]
    world = layouts[0].world_size
    bucket_numel = sum(layout.padded_numel for layout in layouts)
    per_rank = gathered.view(world, bucket_numel)
    fulls, offset = [], 0
    for layout in layouts:
        part = per_rank.narrow(1, offset, layout.padded_numel)
        part = part.clone(memory_format=torch.contiguous_format)  # (N, padded_numel)
        fulls.append(_rows(part.view(layout.gathered_shape()), layout))
        offset += layout.padded_numel
    return fulls


def _rows(gathered_rows: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The first dim0 rows of the padded gathered rows: the full parameter."""
    if gathered_rows.shape[0] == layout.dim0:
        return gathered_rows
    return gathered_rows.narrow(0, 0, layout.dim0)


def reduce_copy_in(
    grads: Sequence[torch.Tensor], layouts: Sequence[ShardLayout], dtype: torch.dtype
) -> torch.Tensor:
    """The flat input of a bucket's reduce-scatter, rank-major: rank r's part of every gradient
    of the bucket comes before rank r + 1's."""
    world = layouts[0].world_size
    pieces = []
    for grad, layout in zip(grads, layouts):
        x = cast(grad, dtype)
        x = x.reshape(-1)
        pad = layout.padded_numel * world - x.numel()
        if pad:
            x = F.pad(x, (0, pad))
        pieces.append(x if len(grads) == 1 else x.view(world, layout.padded_numel))
    if len(pieces) == 1:
        return pieces[0]  # (N * padded_numel,)
    return torch.cat(pieces, 1).view(-1)  # (N, bucket_numel) -> (N * bucket_numel,)


def reduce_copy_out(
    reduced: torch.Tensor,
    layouts: Sequence[ShardLayout],
    shard_shapes: Sequence[Sequence[int]],
    shard_dtypes: Sequence[torch.dtype],
    replicas: int = 1,
) -> list[torch.Tensor]:
    """This rank's gradient shards in a reduced bucket ``(bucket_numel,)``: the mean over ranks
    (the shard group's, times ``replicas`` when the bucket was also summed over replicas)."""
    world = layouts[0].world_size * replicas
    shards, offset = [], 0
    for layout, shape, dtype in zip(layouts, shard_shapes, shard_dtypes):
        numel = _numel(shape)
        x = reduced.narrow(0, offset, numel).view(list(shape)) / world
        shards.append(cast(x, dtype))
        offset += layout.padded_numel
    return shards


def single_rank_gather(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """World size 1: the shard is the full parameter; only the dtype may change."""
    return cast(shard, dtype)


def single_rank_reduce(
    grad: torch.Tensor, reduce_dtype: torch.dtype, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """World size 1: the gradient already is the mean; only dtypes and the shape change."""
    x = cast(grad, reduce_dtype).reshape(list(shape))
    return cast(x, dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
