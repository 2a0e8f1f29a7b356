"""The marker nodes of traced graphs, decoded by name (see [Note: the marker contract] in
``sharding/spec.py``): ``zero3::unshard(shard, param_id, spec, grad_sink)`` and
``zero3::reduce_grad(grad, param_id, spec, shard_shape, shard_dtype)``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx as fx

from ..sharding.spec import ShardSpec


def _arguments(node: fx.Node, names: tuple[str, ...]) -> list[Any]:
    values = list(node.args)
    for name in names[len(values) :]:
        values.append(node.kwargs.get(name))
    return values


class UnshardCall(NamedTuple):
    """A ``zero3::unshard`` node's arguments by name, its spec parsed."""

    shard: Any
    param_id: int
    spec: ShardSpec
    grad_sink: Any

    @classmethod
    def of(cls, node: fx.Node) -> UnshardCall:
        shard, param_id, spec, sink = _arguments(node, ("shard", "param_id", "spec", "grad_sink"))
        return cls(shard, param_id, ShardSpec.parse(spec), sink)


class ReduceGradCall(NamedTuple):
    """A ``zero3::reduce_grad`` node's arguments by name, its spec parsed."""

    grad: Any
    param_id: int
    spec: ShardSpec
    shard_shape: list[int]
    shard_dtype: torch.dtype

    @classmethod
    def of(cls, node: fx.Node) -> ReduceGradCall:
        names = ("grad", "param_id", "spec", "shard_shape", "shard_dtype")
        grad, param_id, spec, shape, dtype = _arguments(node, names)
        return cls(grad, param_id, ShardSpec.parse(spec), list(shape), dtype)
