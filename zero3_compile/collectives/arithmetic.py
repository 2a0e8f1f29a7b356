"""The arithmetic around every collective, written once as plain tensor functions.

The collective schemes (``schemes.py``) call these functions: on real tensors around a real
collective in the eager operations, and in the scheduled graphs, where copy-in and copy-out are
by default four fixed operations (``zero3::gather_copy_in`` and the others, ``copy_ops.py``) whose
bodies are these same functions: Inductor calls them as they are instead of generating a kernel
per bucket shape, which on CPU is a C++ compile each (half of the kernels of a sharded GPT's
graphs, compiled again for every bucket size). With ``options={"fused_copies": True}`` the
schemes trace these same functions into the graphs instead, for Inductor to fuse. So padding,
casting, flattening, the bucket layout and the division by N exist in one place. See
[Note: zero3 tensors] in ``sharding/spec.py`` for the vocabulary.

All-gather of a bucket of k parameters over N ranks (``size_i``: ``padded_numel``)::

    copy-in:   flat = [pad(flatten(cast(shard_i)), size_i) for each i]   # (bucket_numel,)
    collective: gathered = all_gather(flat)                               # (N * bucket_numel,)
    copy-out:  part_i = clone(gathered.view(N, -1)[:, o_i : o_i + size_i])   # (N, size_i)
               full_i = part_i.view(N * rows_per_rank, ...)[:dim0]       # a view

Reduce-scatter of a bucket of gradients::

    copy-in:   flat[r] = [pad(flatten(cast(grad_i)), N * size_i).view(N, -1)[r] for each i]
    collective: reduced = reduce_scatter(flat.view(-1), "sum")            # (bucket_numel,)
    copy-out:  shard_grad_i = cast(reduced[o_i : o_i + local_numel_i] / N).view(shape_i)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..sharding.spec import ShardSpec


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, as the primitive cast: what graphs after AOTAutograd must hold
    (Inductor refuses ``aten._to_copy`` there), and it runs eagerly just as well."""
    return x if x.dtype == dtype else torch.ops.prims.convert_element_type.default(x, dtype)


def gather_dtype(shard_dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    return param_dtype or shard_dtype


def gather_bytes(specs: Sequence[ShardSpec], dtype: torch.dtype) -> int:
    """Bytes of a gathered bucket (every rank's padded shards)."""
    return sum(spec.padded_numel * spec.world_size for spec in specs) * dtype.itemsize


def reduce_bytes(specs: Sequence[ShardSpec], dtype: torch.dtype) -> int:
    """Bytes of a reduce-scatter input bucket (full padded gradients)."""
    return gather_bytes(specs, dtype)


def sizes(specs: Sequence[ShardSpec]) -> list[int]:
    """Each member's part of a bucket, per rank (its ``padded_numel``)."""
    return [spec.padded_numel for spec in specs]


def gather_copy_in(
    shards: Sequence[torch.Tensor], sizes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The flat input of a bucket's all-gather: each shard cast, flattened and padded to its
    ``size`` (``ShardSpec.padded_numel``), concatenated."""
    flats = [_padded(cast(shard, dtype).reshape(-1), size) for shard, size in zip(shards, sizes)]
    if len(flats) == 1:  # no concatenation: a second full-size copy of a huge lone parameter
        return _owned(flats[0], shards[0], dtype, sizes[0])
    return torch.cat(flats)  # (bucket_numel,)


def gather_copy_in_direct(
    shards: Sequence[torch.Tensor], sizes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``gather_copy_in``'s values written straight into one new buffer: each shard cast as it
    is copied into its place, the padding zeroed. One pass and one allocation, where the cast,
    the padding and the concatenation each allocate and write a bucket-sized tensor: on CPU the
    page faults of fresh memory cost more than the copies: a bucket of a 3B Llama layer's nine
    gradients (bf16, reduced in fp32) copies in 2.1x faster with half the peak (a lone member,
    each large matrix at the default ``bucket_mb``, was copied once already). It mutates a
    buffer of its own, so graphs traced for Inductor keep the functional form; the fixed
    operations and the eager schemes run this one."""
    flat = torch.empty(sum(sizes), dtype=dtype, device=shards[0].device)
    offset = 0
    for shard, size in zip(shards, sizes):
        _fill(flat.narrow(0, offset, size), shard)
        offset += size
    return flat


def _fill(into: torch.Tensor, source: torch.Tensor) -> None:
    """``into`` (flat): ``source``'s elements, cast, then zeros."""
    numel = source.numel()
    into.narrow(0, 0, numel).view(source.shape).copy_(source)
    into.narrow(0, numel, into.numel() - numel).zero_()


def _padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    pad = numel - flat.numel()
    return F.pad(flat, (0, pad)) if pad else flat


def _owned(flat: torch.Tensor, source: torch.Tensor, dtype: torch.dtype, numel: int):
    """``flat``, made from ``source`` by a cast, a flattening and a padding, as memory of its own:
    it already is unless none of the three copied."""
    if source.dtype != dtype or source.numel() != numel or not source.is_contiguous():
        return flat
    return flat.clone()


def gather_input(
    shards: Sequence[torch.Tensor], sizes: Sequence[int], dtype: torch.dtype, copy_in=gather_copy_in
) -> torch.Tensor:
    """The all-gather's input: a lone shard that needs no cast and no padding is used as it is
    (a view); otherwise ``copy_in`` (in graphs, the ``zero3::gather_copy_in`` operation, whose
    body is ``gather_copy_in``)."""
    if len(shards) == 1 and _flat_as_is(shards[0], sizes[0], dtype):
        return shards[0].view(-1)
    return copy_in(list(shards), list(sizes), dtype)


def _flat_as_is(x: torch.Tensor, numel: int, dtype: torch.dtype) -> bool:
    return x.numel() == numel and x.dtype == dtype and x.is_contiguous()


def gather_copy_out_parts(
    gathered: torch.Tensor, world: int, sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Each parameter's part of a gathered bucket of several, copied out: ``(N, size)``, every
    rank's padded shard of it (``gathered_rows`` views it as the parameter)."""
    per_rank = gathered.view(world, sum(sizes))
    parts, offset = [], 0
    for size in sizes:
        parts.append(per_rank.narrow(1, offset, size).clone(memory_format=torch.contiguous_format))
        offset += size
    return parts


def gathered_rows(part: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full parameter in one parameter's gathered part (a single-parameter bucket's whole
    buffer, or one of ``gather_copy_out_parts``): its first ``dim0`` rows, a view."""
    rows = part.view(spec.gathered_shape())
    if rows.shape[0] == spec.dim0:
        return rows
    return rows.narrow(0, 0, spec.dim0)


def gather_copy_out(
    gathered: torch.Tensor, specs: Sequence[ShardSpec], copy_parts=gather_copy_out_parts
) -> list[torch.Tensor]:
    """The full parameters in a gathered bucket ``(N * bucket_numel,)``.

    A single parameter is a view of the buffer (padding sits only at the tail); in a bucket of
    several, each one's rows are strided across ranks and are copied out first (``copy_parts``:
    in graphs, the ``zero3::gather_copy_out`` operation, whose body is the default).
    """
    if len(specs) == 1:
        return [gathered_rows(gathered, specs[0])]
    parts = copy_parts(gathered, specs[0].world_size, sizes(specs))
    return [gathered_rows(part, spec) for part, spec in zip(parts, specs)]


def reduce_copy_in(
    grads: Sequence[torch.Tensor], world: int, sizes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The flat input of a bucket's reduce-scatter, rank-major: rank r's part of every gradient
    of the bucket comes before rank r + 1's; each gradient cast, and padded to ``world * size``."""
    pieces = [
        _padded(cast(grad, dtype).reshape(-1), world * size).view(world, size)
        for grad, size in zip(grads, sizes)
    ]
    if len(pieces) == 1:  # (N, size) is already rank-major
        return _owned(pieces[0].view(-1), grads[0], dtype, world * sizes[0])
    return torch.cat(pieces, 1).view(-1)  # (N, bucket_numel) -> (N * bucket_numel,)


def reduce_copy_in_direct(
    grads: Sequence[torch.Tensor], world: int, sizes: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``reduce_copy_in``'s values written straight into one new buffer (as
    ``gather_copy_in_direct``): gradient i's padded ``(N, size_i)`` rows go to columns
    ``[o_i, o_i + size_i)`` of the ``(N, bucket_numel)`` buffer, cast as they are copied."""
    flat = torch.empty(world, sum(sizes), dtype=dtype, device=grads[0].device)
    offset = 0
    for grad, size in zip(grads, sizes):
        if size == 0:  # an empty parameter
            continue
        rows = flat.narrow(1, offset, size)  # (N, size): this gradient's columns
        source = grad.reshape(-1)
        whole, rest = divmod(source.numel(), size)
        rows.narrow(0, 0, whole).copy_(source.narrow(0, 0, whole * size).view(whole, size))
        if whole < world:  # the row the gradient ends in, then rows of padding only
            _fill(rows[whole], source.narrow(0, whole * size, rest))
            rows.narrow(0, whole + 1, world - whole - 1).zero_()
        offset += size
    return flat.view(-1)


def reduce_input(
    grads: Sequence[torch.Tensor],
    world: int,
    sizes: Sequence[int],
    dtype: torch.dtype,
    copy_in=reduce_copy_in,
    owned: bool = False,
) -> torch.Tensor:
    """The reduce-scatter's input: a lone gradient that needs no cast and no padding is used as
    it is (a view), unless the result must be ``owned`` (a collective will write into it);
    otherwise ``copy_in`` (in graphs, ``zero3::reduce_copy_in``)."""
    if not owned and len(grads) == 1 and _flat_as_is(grads[0], world * sizes[0], dtype):
        return grads[0].view(-1)
    return copy_in(list(grads), world, list(sizes), dtype)


def reduce_copy_out(
    reduced: torch.Tensor,
    sizes: Sequence[int],
    numels: Sequence[int],
    divisor: int,
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """This rank's gradient shards in a reduced bucket ``(bucket_numel,)``, flat: the first
    ``numel`` of each member's ``size`` elements, the mean over the ``divisor`` ranks that summed
    them (the shard group's, times the replicas under hybrid sharding), cast to its dtype."""
    shards, offset = [], 0
    for size, numel, dtype in zip(sizes, numels, dtypes):
        shards.append(cast(reduced.narrow(0, offset, numel) / divisor, dtype))
        offset += size
    return shards


def reduce_copy_out_direct(
    reduced: torch.Tensor,
    sizes: Sequence[int],
    numels: Sequence[int],
    divisor: int,
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """``reduce_copy_out``'s values, each shard divided and cast in one pass into its own new
    tensor (the division computes in ``reduced``'s dtype and rounds once on the store, as the
    division then the cast do)."""
    if reduced.requires_grad and torch.is_grad_enabled():  # ``out=`` is not differentiable
        return reduce_copy_out(reduced, sizes, numels, divisor, dtypes)
    shards, offset = [], 0
    for size, numel, dtype in zip(sizes, numels, dtypes):
        shard = torch.empty(numel, dtype=dtype, device=reduced.device)
        torch.div(reduced.narrow(0, offset, numel), divisor, out=shard)
        shards.append(shard)
        offset += size
    return shards


def secondary_slice(full: torch.Tensor, numel: int, index: int) -> torch.Tensor:
    """Elements ``[index * numel, (index + 1) * numel)`` of a full parameter, flat and padded
    like a gathered buffer (zeros past its end), in memory of their own: a secondary shard
    (ZeRO++'s hpZ, ``compiler/secondary.py``), what an all-gather over a node's ranks takes in."""
    flat = full.reshape(-1)
    start = min(index * numel, flat.numel())
    taken = flat.narrow(0, start, min(flat.numel(), start + numel) - start)
    return _padded(taken, numel).clone(memory_format=torch.contiguous_format)


def single_rank_gather(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """World size 1: the shard is the full parameter; only the dtype may change."""
    return cast(shard, dtype)


def single_rank_reduce(
    grad: torch.Tensor, reduce_dtype: torch.dtype, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """World size 1: the gradient already is the mean; only dtypes and the shape change."""
    x = cast(grad, reduce_dtype).reshape(list(shape))
    return cast(x, dtype)
