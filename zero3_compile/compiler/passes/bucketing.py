"""Decide which parameters share one all-gather and which gradients share one reduce-scatter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ...collectives.arithmetic import gather_bytes, reduce_bytes
from ...collectives.ops import REDUCE_GRAD, UNSHARD
from ...collectives.schemes import gather_scheme, reduce_scheme
from ..context import PassContext
from ..graph_utils import node_order
from ..markers import ReduceGradCall, UnshardCall
from ..node_keys import BUCKET


@dataclass
class Bucket:
    key: tuple  # the collective scheme's key: only equal keys share a collective
    block: str | None = None  # the first non-root block of its members
    nbytes: int = 0
    members: list[fx.Node] = field(default_factory=list)


def assign_buckets(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Number the gather markers and the reduce markers into buckets, ``meta[BUCKET]``.

    **Invariant** after: every ``unshard`` marker with users and every ``reduce_grad`` marker has
    a bucket index; indices follow the order the collectives will be issued in (gathers: first
    use; reductions: when the gradient is complete). A bucket holds consecutive markers with the
    same collective scheme (group, dtypes; ``schemes.py``), from at most one block (see ``ctx.block_of``), whose communicated bytes
    stay within ``bucket_mb``; a single larger parameter gets a bucket of its own.

    ```
    before:
      inputs: arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1
      unshard = unshard(arg1_1, 'h.0.fc.weight')
      unshard_1 = unshard(arg2_1, 'h.0.fc.bias')
      t = t(unshard)
      addmm = addmm(unshard_1, arg0_1, t)
      relu = relu(addmm)
      unshard_2 = unshard(arg3_1, 'h.1.fc.weight')
      unshard_3 = unshard(arg4_1, 'h.1.fc.bias')
      t_1 = t(unshard_2)
      addmm_1 = addmm(unshard_3, relu, t_1)
      relu_1 = relu(addmm_1)
      unshard_4 = unshard(arg5_1, 'head.weight')
      t_2 = t(unshard_4)
      mm = mm(relu_1, t_2)
      return mm
    after:
      inputs: arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1
      unshard = unshard(arg1_1, 'h.0.fc.weight')  # bucket 0
      unshard_1 = unshard(arg2_1, 'h.0.fc.bias')  # bucket 0
      t = t(unshard)
      addmm = addmm(unshard_1, arg0_1, t)
      relu = relu(addmm)
      unshard_2 = unshard(arg3_1, 'h.1.fc.weight')  # bucket 1
      unshard_3 = unshard(arg4_1, 'h.1.fc.bias')  # bucket 1
      t_1 = t(unshard_2)
      addmm_1 = addmm(unshard_3, relu, t_1)
      relu_1 = relu(addmm_1)
      unshard_4 = unshard(arg5_1, 'head.weight')  # bucket 1
      t_2 = t(unshard_4)
      mm = mm(relu_1, t_2)
      return mm
    ```
    """
    graph = gm.graph
    order = node_order(graph)
    gathers = [
        n for n in graph.nodes if n.op == "call_function" and n.target is UNSHARD and n.users
    ]
    gathers.sort(key=lambda n: min(order[u] for u in n.users))
    _number(_group(gathers, ctx, _gather_traits))
    reductions = [n for n in graph.nodes if n.op == "call_function" and n.target is REDUCE_GRAD]
    reductions.sort(key=lambda n: order[ReduceGradCall.of(n).grad])
    _number(_group(reductions, ctx, _reduce_traits))


def _gather_traits(node: fx.Node, ctx: PassContext) -> tuple[tuple, int, str]:
    call = UnshardCall.of(node)
    fused = ctx.options.fused_copies
    scheme = gather_scheme(
        call.spec,
        call.shard.meta["val"].dtype,
        traced_copies=fused,
        quantization=ctx.gather_quantization(),
    )
    return scheme.key(), gather_bytes([call.spec], scheme.dtype), call.spec.fqn


def _reduce_traits(node: fx.Node, ctx: PassContext) -> tuple[tuple, int, str]:
    call = ReduceGradCall.of(node)
    scheme = reduce_scheme(
        call.spec,
        call.grad.meta["val"].dtype,
        call.shard_dtype,
        traced_copies=ctx.options.fused_copies,
        quantization=ctx.reduce_quantization(),
        node_size=ctx.reduce_node_size(call.spec.group),
    )
    return scheme.key(), reduce_bytes([call.spec], scheme.dtype), call.spec.fqn


def _group(nodes: list[fx.Node], ctx: PassContext, traits) -> list[Bucket]:
    cap = ctx.options.bucket_bytes
    buckets: list[Bucket] = []
    for node in nodes:
        key, nbytes, name = traits(node, ctx)
        block = ctx.block_of(name) or None
        current = buckets[-1] if buckets else None
        fits = (
            current is not None
            and current.key == key
            and current.nbytes + nbytes <= cap
            and (block is None or current.block is None or block == current.block)
        )
        if not fits:
            current = Bucket(key=key)
            buckets.append(current)
        current.members.append(node)
        current.nbytes += nbytes
        current.block = current.block or block
    return buckets


def _number(buckets: list[Bucket]) -> None:
    for index, bucket in enumerate(buckets):
        for node in bucket.members:
            node.meta[BUCKET] = index
