"""Replace ``reduce_grad`` markers by bucketed reduce-scatters issued as soon as a bucket is ready."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.fx as fx

from ..compat import REDUCE_SCATTER, WAIT
from ..graph_utils import NodeFactory, move_users_after, node_order, output_node
from ..layout import ShardLayout
from ..meta import (
    BUCKET,
    PARAMS,
    ROLE,
    ROLE_REDUCE_COPY_IN,
    ROLE_REDUCE_COPY_OUT,
    ROLE_REDUCE_SCATTER,
    ROLE_REDUCE_WAIT,
)
from ..ops import REDUCE_GRAD, ReduceGradCall
from ..plan import Plan

aten = torch.ops.aten
prims = torch.ops.prims


def lower_reductions(gm: fx.GraphModule, plan: Plan) -> None:
    """Lower each reduce bucket to copy-in, one sum reduce-scatter, its wait and copy-outs.

    **Invariant** before: ``reduce_grad`` markers carry ``meta[BUCKET]`` in readiness order
    (``assign_buckets``). After: no marker is left; bucket ``j``'s copy-in and reduce-scatter sit
    right after the last of its gradients is computed; its wait and copy-out (slice this rank's
    rows, divide by the world size, cast to the shard dtype) sit right before bucket
    ``j + reduce_scatter_depth`` is issued, or before the output for the last buckets, so at most
    ``reduce_scatter_depth`` full-size gradient buckets are in flight.

    ```
    before:                         after (reduce_scatter_depth=1):
      g2 = ...                        g2 = ...
      r2 = reduce_grad(g2)            rs0 = reduce_scatter(cat([pad(g2)...]), "sum")
      g1 = ...                        g1 = ...
      r1 = reduce_grad(g1)            w0 = wait(rs0); r2 = slice(w0) / N
                                      rs1 = reduce_scatter(cat([pad(g1)...]), "sum")
      return (r1, r2)                 w1 = wait(rs1); r1 = slice(w1) / N
                                      return (r1, r2)
    ```
    """
    graph = gm.graph
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is REDUCE_GRAD:
            if BUCKET not in node.meta:
                raise AssertionError("zero3: lower_reductions needs assign_buckets first")
            buckets[node.meta[BUCKET]].append(node)
    if not buckets:
        return
    issued: list[tuple[list[fx.Node], fx.Node, fx.Node]] = []
    for index in sorted(buckets):
        order = node_order(graph)
        members = sorted(buckets[index], key=order.__getitem__)
        if ReduceGradCall.of(members[0]).world_size == 1:
            for marker in members:  # in place: no collective to wait for
                with graph.inserting_before(marker):
                    shards = _emit_single_rank(graph, index, [marker])
                _replace([marker], shards, graph)
            continue
        last_grad = max((ReduceGradCall.of(m).grad for m in members), key=order.__getitem__)
        with graph.inserting_before(last_grad.next):
            first_issue, scattered = _emit_issue(graph, index, members)
        issued.append((members, first_issue, scattered))

    depth = plan.options.reduce_scatter_depth
    out = output_node(graph)
    for j, (members, _, scattered) in enumerate(issued):
        anchor = issued[j + depth][1] if j + depth < len(issued) else out
        with graph.inserting_before(anchor):
            shards = _emit_finish(graph, members, scattered)
        _replace(members, shards, graph)
    graph.lint()


def _replace(members: list[fx.Node], shards: list[fx.Node], graph: fx.Graph) -> None:
    order = node_order(graph)
    for marker, shard in zip(members, shards):
        marker.replace_all_uses_with(shard)
        graph.erase_node(marker)
        move_users_after(shard, shard, order)


def _factory(graph: fx.Graph, role: str, index: int, members: list[fx.Node]) -> NodeFactory:
    names = tuple(ReduceGradCall.of(m).name for m in members)
    return NodeFactory(graph, source=members[0], **{ROLE: role, BUCKET: index, PARAMS: names})


def _emit_issue(graph: fx.Graph, index: int, members: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """Copy-in and reduce-scatter; returns (first node emitted, the reduce-scatter)."""
    calls = [ReduceGradCall.of(m) for m in members]
    world = calls[0].world_size
    copy_in = _factory(graph, ROLE_REDUCE_COPY_IN, index, members)
    pieces = []
    for call in calls:
        grad_val = call.grad.meta["val"]
        layout = ShardLayout(tuple(grad_val.shape), world)
        x = call.grad
        if call.reduce_dtype is not None and call.reduce_dtype != grad_val.dtype:
            x = copy_in(prims.convert_element_type.default, x, call.reduce_dtype)
        if not x.meta["val"].is_contiguous():
            x = copy_in(aten.clone.default, x, memory_format=torch.contiguous_format)
        x = copy_in(aten.view.default, x, [-1])
        pad = layout.padded_numel * world - layout.full_numel
        if pad:
            x = copy_in(aten.constant_pad_nd.default, x, [0, pad], 0.0)
        if len(calls) > 1:
            x = copy_in(aten.view.default, x, [world, layout.padded_numel])
        pieces.append(x)
    if len(pieces) > 1:
        flat = copy_in(aten.cat.default, pieces, 1)  # (world, bucket_numel)
        flat = copy_in(aten.view.default, flat, [-1])
    else:
        flat = pieces[0]
    scattered = _factory(graph, ROLE_REDUCE_SCATTER, index, members)(
        REDUCE_SCATTER, flat, "sum", world, calls[0].group_name
    )
    first = copy_in.created[0] if copy_in.created else scattered
    return first, scattered


def _emit_single_rank(graph: fx.Graph, index: int, members: list[fx.Node]) -> list[fx.Node]:
    """One rank: the gradient already is the mean; only dtype and shape change."""
    copy_out = _factory(graph, ROLE_REDUCE_COPY_OUT, index, members)
    shards = []
    for call in (ReduceGradCall.of(m) for m in members):
        x = call.grad
        if call.reduce_dtype is not None and call.reduce_dtype != x.meta["val"].dtype:
            x = copy_out(prims.convert_element_type.default, x, call.reduce_dtype)
        x = copy_out(aten.view.default, x, list(call.shard_shape))
        if x.meta["val"].dtype != call.shard_dtype:
            x = copy_out(prims.convert_element_type.default, x, call.shard_dtype)
        shards.append(x)
    return shards


def _emit_finish(graph: fx.Graph, members: list[fx.Node], scattered: fx.Node) -> list[fx.Node]:
    """Wait, then per member: this rank's slice of the sum, divided by the world size."""
    calls = [ReduceGradCall.of(m) for m in members]
    world = calls[0].world_size
    index = scattered.meta[BUCKET]
    waited = _factory(graph, ROLE_REDUCE_WAIT, index, members)(WAIT, scattered)  # (bucket_numel,)
    copy_out = _factory(graph, ROLE_REDUCE_COPY_OUT, index, members)
    shards, offset = [], 0
    for call in calls:
        layout = ShardLayout(tuple(call.grad.meta["val"].shape), world)
        local_numel = math.prod(call.shard_shape)
        x = copy_out(aten.slice.Tensor, waited, 0, offset, offset + local_numel)
        x = copy_out(aten.view.default, x, list(call.shard_shape))
        x = copy_out(aten.div.Tensor, x, world)
        if x.meta["val"].dtype != call.shard_dtype:
            x = copy_out(prims.convert_element_type.default, x, call.shard_dtype)
        shards.append(x)
        offset += layout.padded_numel
    return shards
