"""The two marker operations every sharded parameter goes through.

``zero3::unshard(shard) -> full`` is what reading ``module.weight`` calls. Its backward is
``zero3::reduce_grad(full_grad) -> shard_grad``: a reduce-scatter averaged over ranks
(data-parallel semantics, as DDP and FSDP2).

Both are real operations: run eagerly they issue the collective at once, so a model is correct
without the compiler (and between graph breaks). Under ``torch.compile`` they appear in the traced
graph as single nodes; the backend's passes then replace them by functional collectives placed
and bucketed by the scheduler. Their fake implementations give the full / shard shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .compat import all_gather, reduce_scatter_sum
from .layout import ShardLayout


@torch.library.custom_op("zero3::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    full_shape: list[int],
    group_name: str,
    world_size: int,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    name: str,
    grad_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather ``shard`` (this rank's dim-0 chunk) into the full parameter.

    The cast to ``param_dtype`` happens on the shard, before the collective, so mixed
    precision halves the bytes on the wire.

    Gradient accumulation without synchronisation (``set_requires_gradient_sync(model, False)``)
    passes ``grad_sink``: a full-shape leaf that receives the full, unreduced gradient instead of
    the shard, so backward issues no collective (see ``accumulation.py``).
    """
    layout = ShardLayout(tuple(full_shape), world_size)
    x = shard if param_dtype is None else shard.to(param_dtype)
    if world_size == 1:
        return x.clone() if x is shard else x
    flat = x.reshape(-1)
    if flat.numel() < layout.padded_numel:
        flat = F.pad(flat, (0, layout.padded_numel - flat.numel()))
    gathered = all_gather(flat.contiguous(), world_size, group_name)  # (world * padded_numel,)
    return gathered.view(layout.gathered_shape())[: layout.dim0]


@unshard.register_fake
def _unshard_fake(
    shard,
    full_shape,
    group_name,
    world_size,
    param_dtype,
    reduce_dtype,
    name,
    grad_sink=None,
):
    dtype = shard.dtype if param_dtype is None else param_dtype
    return shard.new_empty(tuple(full_shape), dtype=dtype)


@torch.library.custom_op("zero3::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor,
    shard_shape: list[int],
    group_name: str,
    world_size: int,
    reduce_dtype: torch.dtype | None,
    shard_dtype: torch.dtype,
    name: str,
) -> torch.Tensor:
    """Reduce-scatter the full gradient ``grad``; return this rank's shard of the mean."""
    layout = ShardLayout(tuple(grad.shape), world_size)
    x = grad if reduce_dtype is None else grad.to(reduce_dtype)
    local_numel = 1
    for size in shard_shape:
        local_numel *= size
    if world_size == 1:
        return x.reshape(shard_shape).to(shard_dtype, copy=True)
    flat = x.reshape(-1)
    total = layout.padded_numel * world_size
    if flat.numel() < total:
        flat = F.pad(flat, (0, total - flat.numel()))
    reduced = reduce_scatter_sum(flat.contiguous(), world_size, group_name)  # (padded_numel,)
    mine = reduced[:local_numel].view(shard_shape) / world_size
    return mine.to(shard_dtype)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, shard_shape, group_name, world_size, reduce_dtype, shard_dtype, name):
    return grad.new_empty(tuple(shard_shape), dtype=shard_dtype)


def _setup_context(ctx, inputs, output):
    shard, _full_shape, group_name, world_size, _param_dtype, reduce_dtype, name = inputs[:7]
    grad_sink = inputs[7]
    ctx.args = (list(shard.shape), group_name, world_size, reduce_dtype, shard.dtype, name)
    ctx.sink_dtype = None if grad_sink is None else grad_sink.dtype


def _backward(ctx, grad):
    shard_shape, group_name, world_size, reduce_dtype, shard_dtype, name = ctx.args
    if ctx.sink_dtype is not None:  # accumulating without synchronisation: no collective
        return None, None, None, None, None, None, None, grad.to(ctx.sink_dtype)
    shard_grad = torch.ops.zero3.reduce_grad(
        grad, shard_shape, group_name, world_size, reduce_dtype, shard_dtype, name
    )
    return shard_grad, None, None, None, None, None, None, None


unshard.register_autograd(_backward, setup_context=_setup_context)

UNSHARD = torch.ops.zero3.unshard.default
REDUCE_GRAD = torch.ops.zero3.reduce_grad.default


def is_unshard(node) -> bool:
    """An ``unshard`` marker: the overload (AOT graphs) or the packet (dynamo graphs)."""
    return node.op == "call_function" and node.target in (UNSHARD, torch.ops.zero3.unshard)


class UnshardCall(NamedTuple):
    """The arguments of an ``unshard`` marker node, by name."""

    shard: Any
    full_shape: list[int]
    group_name: str
    world_size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    name: str
    grad_sink: Any = None

    @classmethod
    def of(cls, node) -> UnshardCall:
        return cls(*node.args, **node.kwargs)


class ReduceGradCall(NamedTuple):
    """The arguments of a ``reduce_grad`` marker node, by name."""

    grad: Any
    shard_shape: list[int]
    group_name: str
    world_size: int
    reduce_dtype: torch.dtype | None
    shard_dtype: torch.dtype
    name: str

    @classmethod
    def of(cls, node) -> ReduceGradCall:
        return cls(*node.args, **node.kwargs)
