"""Replace ``reduce_grad`` markers by bucketed reduce-scatters issued as soon as a bucket is ready."""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch.fx as fx

from .. import arithmetic
from ..compat import ALL_REDUCE, REDUCE_SCATTER, WAIT
from ..context import PassContext
from ..graph_utils import NodeFactory, move_users_after, node_order, output_node
from ..node_keys import (
    BUCKET,
    PARAMS,
    ROLE,
    ROLE_REDUCE_COPY_IN,
    ROLE_REDUCE_COPY_OUT,
    ROLE_REDUCE_SCATTER,
    ROLE_REDUCE_WAIT,
    ROLE_REPLICA_ALL_REDUCE,
    ROLE_REPLICA_WAIT,
)
from ..ops import REDUCE_COPY_IN, REDUCE_COPY_OUT, REDUCE_GRAD
from ..param import ReduceGradCall


def lower_reductions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Lower each reduce bucket to copy-in, one sum reduce-scatter, its wait and copy-outs.

    **Invariant** before: ``reduce_grad`` markers carry ``meta[BUCKET]`` in readiness order
    (``assign_buckets``). After: no marker is left; bucket ``j``'s copy-in and reduce-scatter sit
    right after the last of its gradients is computed; its wait and copy-out (slice this rank's
    rows, divide by the world size, cast to the shard dtype) sit right before bucket
    ``j + reduce_scatter_depth`` is issued, or before the output for the last buckets, so at most
    ``reduce_scatter_depth`` full-size gradient buckets are in flight. With hybrid sharding the
    reduced shard bucket is then all-reduced over the replicate group, issued right after the
    reduce-scatter's wait and waited one bucket later. Copy-in and copy-out are the fixed
    operations ``zero3::reduce_copy_in`` / ``reduce_copy_out`` (bodies in ``arithmetic.py``); a
    lone gradient that needs no cast and no padding goes to the collective as it is (a view).

    ```
    before:
      inputs: arg0_1, arg1_1
      mul = mul(arg1_1, 2)
      reduce_grad = reduce_grad(mul, 'h.1.w')
      mul_1 = mul(arg0_1, 2)
      reduce_grad_1 = reduce_grad(mul_1, 'h.0.w')
      return [reduce_grad, reduce_grad_1]
    after:
      inputs: arg0_1, arg1_1
      mul = mul(arg1_1, 2)
      view = view(mul, [-1])
      reduce_scatter_tensor_default = reduce_scatter_tensor(view, 'sum', 4, '0')
      mul_1 = mul(arg0_1, 2)
      wait_tensor_default = wait_tensor(reduce_scatter_tensor_default)
      reduce_copy_out = reduce_copy_out(wait_tensor_default, [4], [4], 4, float32)
      getitem = getitem(reduce_copy_out, 0)
      view_2 = view(getitem, [1, 4])
      view_1 = view(mul_1, [-1])
      reduce_scatter_tensor_default_1 = reduce_scatter_tensor(view_1, 'sum', 4, '0')
      wait_tensor_default_1 = wait_tensor(reduce_scatter_tensor_default_1)
      reduce_copy_out_1 = reduce_copy_out(wait_tensor_default_1, [4], [4], 4, float32)
      getitem_1 = getitem(reduce_copy_out_1, 0)
      view_3 = view(getitem_1, [1, 4])
      return [view_2, view_3]
    ```
    """
    graph = gm.graph
    fused = ctx.options.fused_copies
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
        first_args = ReduceGradCall.of(members[0]).args
        if first_args.world_size == 1 and first_args.replicate_size == 1:
            for marker in members:  # in place: no collective to wait for
                with graph.inserting_before(marker):
                    shards = _emit_single_rank(graph, index, [marker])
                _replace([marker], shards, graph)
            continue
        last_grad = max((ReduceGradCall.of(m).grad for m in members), key=order.__getitem__)
        with graph.inserting_before(last_grad.next):
            first_issue, scattered = _emit_issue(graph, index, members, fused)
        issued.append((members, first_issue, scattered))

    depth = ctx.options.reduce_scatter_depth
    out = output_node(graph)
    across_replicas = []  # hybrid sharding: (j, members, the all-reduce of the reduced shard)
    for j, (members, _, collective) in enumerate(issued):
        anchor = issued[j + depth][1] if j + depth < len(issued) else out
        args = ReduceGradCall.of(members[0]).args
        with graph.inserting_before(anchor):
            waited = _factory(graph, ROLE_REDUCE_WAIT, collective.meta[BUCKET], members)(
                WAIT, collective
            )
            if args.world_size > 1 and args.replicate_size > 1:
                # the reduced shard bucket's sum over the replicas, overlapped like a bucket
                summed = _factory(graph, ROLE_REPLICA_ALL_REDUCE, collective.meta[BUCKET], members)(
                    ALL_REDUCE, waited, "sum", args.replicate_group
                )
                across_replicas.append((j, members, summed))
                continue
            shards = _emit_copy_out(graph, members, waited, fused)
        _replace(members, shards, graph)
    for j, members, summed in across_replicas:
        later = j + depth + 1
        anchor = issued[later][1] if later < len(issued) else out
        with graph.inserting_before(anchor):
            waited = _factory(graph, ROLE_REPLICA_WAIT, summed.meta[BUCKET], members)(WAIT, summed)
            shards = _emit_copy_out(graph, members, waited, fused)
        _replace(members, shards, graph)
    graph.lint()


def _replace(members: list[fx.Node], shards: list[fx.Node], graph: fx.Graph) -> None:
    order = node_order(graph)
    for marker, shard in zip(members, shards):
        marker.replace_all_uses_with(shard)
        graph.erase_node(marker)
        move_users_after(shard, shard, order)


def _factory(graph: fx.Graph, role: str, index: int, members: list[fx.Node]) -> NodeFactory:
    names = tuple(ReduceGradCall.of(m).args.fqn for m in members)
    return NodeFactory(graph, source=members[0], **{ROLE: role, BUCKET: index, PARAMS: names})


def _dtype(call: ReduceGradCall):
    return call.args.reduce_dtype or call.grad.meta["val"].dtype


def _emit_issue(
    graph: fx.Graph, index: int, members: list[fx.Node], fused: bool
) -> tuple[fx.Node, fx.Node]:
    """Copy-in and reduce-scatter; returns (first node emitted, the reduce-scatter)."""
    calls = [ReduceGradCall.of(m) for m in members]
    layouts = [c.args.layout for c in calls]
    dtype = _dtype(calls[0])
    copy_in = _factory(graph, ROLE_REDUCE_COPY_IN, index, members)
    first = calls[0].args
    sizes = arithmetic.sizes(layouts)
    flat = copy_in.splice(
        lambda *grads: arithmetic.reduce_input(
            grads,
            first.world_size,
            sizes,
            dtype,
            copy_in=arithmetic.reduce_copy_in if fused else REDUCE_COPY_IN,
        ),
        [c.grad for c in calls],
    )
    if first.world_size == 1:  # replicated, not sharded (a mesh of N x 1): all-reduce
        collective = _factory(graph, ROLE_REPLICA_ALL_REDUCE, index, members)(
            ALL_REDUCE, flat, "sum", first.replicate_group
        )
    else:
        collective = _factory(graph, ROLE_REDUCE_SCATTER, index, members)(
            REDUCE_SCATTER, flat, "sum", first.world_size, first.group_name
        )
    return (copy_in.created[0] if copy_in.created else collective), collective


def _emit_single_rank(graph: fx.Graph, index: int, members: list[fx.Node]) -> list[fx.Node]:
    """One rank: the gradient already is the mean; only dtype and shape change."""
    copy_out = _factory(graph, ROLE_REDUCE_COPY_OUT, index, members)
    shards = []
    for call in (ReduceGradCall.of(m) for m in members):
        fn = functools.partial(
            arithmetic.single_rank_reduce,
            reduce_dtype=_dtype(call),
            shape=list(call.shard_shape),
            dtype=call.shard_dtype,
        )
        shards.append(copy_out.splice(fn, [call.grad]))
    return shards


def _emit_copy_out(
    graph: fx.Graph, members: list[fx.Node], reduced: fx.Node, fused: bool
) -> list[fx.Node]:
    """Per member: this rank's slice of the reduced bucket, divided by the ranks it summed."""
    calls = [ReduceGradCall.of(m) for m in members]
    sizes = arithmetic.sizes([c.args.layout for c in calls])
    shapes = [list(c.shard_shape) for c in calls]
    divisor = calls[0].args.world_size * calls[0].args.replicate_size
    dtype = calls[0].shard_dtype  # one per bucket (``bucketing._reduce_traits``)

    def copy_out(r):
        numels = [math.prod(s) for s in shapes]
        if fused:
            flats = arithmetic.reduce_copy_out(r, sizes, numels, divisor, [dtype] * len(sizes))
        else:
            flats = REDUCE_COPY_OUT(r, sizes, numels, divisor, dtype)
        return [x.view(shape) for x, shape in zip(flats, shapes)]

    return _factory(graph, ROLE_REDUCE_COPY_OUT, reduced.meta[BUCKET], members).splice(
        copy_out, [reduced]
    )
