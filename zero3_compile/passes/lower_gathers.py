"""Replace ``unshard`` markers by bucketed functional all-gathers, right before first use."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from ..compat import ALL_GATHER, WAIT
from ..graph_utils import VIEW_OPS, NodeFactory, node_order
from ..layout import ShardLayout
from ..meta import (
    BUCKET,
    PARAMS,
    ROLE,
    ROLE_ALL_GATHER,
    ROLE_GATHER_COPY_IN,
    ROLE_GATHER_COPY_OUT,
    ROLE_GATHER_WAIT,
)
from ..ops import UNSHARD, UnshardCall
from ..plan import Plan

aten = torch.ops.aten
prims = torch.ops.prims


def lower_gathers(gm: fx.GraphModule, plan: Plan) -> None:
    """Lower each gather bucket to copy-in, one all-gather, its wait and copy-outs.

    **Invariant** before: markers carry ``meta[BUCKET]`` (``assign_buckets``). After: no
    ``unshard`` marker is left; each bucket is one ``all_gather_into_tensor`` whose single user is
    its ``wait_tensor``, all placed right before the bucket's first use (the prefetch pass moves
    the issue earlier). Shard views are hoisted to the top so issues can move freely.

    ```
    before:                          after (bucket of w, b; world N):
      w = unshard(s_w)                 flat = cat([pad(view(s_w, -1)), pad(view(s_b, -1))])
      b = unshard(s_b)                 ag = all_gather_into_tensor(flat, N, group)
      y = addmm(b, x, t(w))            g = wait_tensor(ag)            # (N * bucket_numel,)
                                       w = view(clone(slice(view(g, [N, -1]), 1, 0, n_w)), ...)
                                       b = ...
                                       y = addmm(b, x, t(w))
    ```
    A single-parameter bucket needs no copy-out: its first ``dim0`` gathered rows are the
    parameter (padding sits only at the tail, see ``layout.py``).
    """
    graph = gm.graph
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is UNSHARD:
            if not node.users:
                continue
            if BUCKET not in node.meta:
                raise AssertionError("zero3: lower_gathers needs assign_buckets first")
            buckets[node.meta[BUCKET]].append(node)
    for node in [n for n in graph.nodes if n.target is UNSHARD and not n.users]:
        graph.erase_node(node)
    if not buckets:
        return
    _hoist_shard_views(graph, [m for members in buckets.values() for m in members])
    for index in sorted(buckets):
        members = buckets[index]
        order = node_order(graph)
        first_use = min((u for m in members for u in m.users), key=order.__getitem__)
        with graph.inserting_before(first_use):
            fulls = _emit_bucket(graph, index, members)
        for marker, full in zip(members, fulls):
            marker.replace_all_uses_with(full)
            graph.erase_node(marker)
    graph.lint()


def _hoist_shard_views(graph: fx.Graph, markers: list[fx.Node]) -> None:
    """Move each marker's shard (a view chain of a placeholder) up to the placeholders."""
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    hoisted: set[fx.Node] = set()
    for marker in markers:
        chain = []
        node = UnshardCall.of(marker).shard
        while node.op == "call_function" and node.target in VIEW_OPS:
            chain.append(node)
            node = node.args[0]
        if node.op != "placeholder":
            continue  # computed shards (unusual) stay where they are
        for view in reversed(chain):
            if view in hoisted:
                continue
            hoisted.add(view)
            if view is anchor:
                anchor = view.next
            else:
                anchor.prepend(view)


def _emit_bucket(graph: fx.Graph, index: int, members: list[fx.Node]) -> list[fx.Node]:
    calls = [UnshardCall.of(m) for m in members]
    world = calls[0].world_size
    names = tuple(c.name for c in calls)

    def factory(role: str) -> NodeFactory:
        return NodeFactory(graph, source=members[0], **{ROLE: role, BUCKET: index, PARAMS: names})

    copy_in = factory(ROLE_GATHER_COPY_IN)
    if world == 1:
        return [_single_rank_full(copy_in, c) for c in calls]

    layouts = [ShardLayout(tuple(c.full_shape), world) for c in calls]
    flats = []
    for call, layout in zip(calls, layouts):
        x = call.shard
        if not x.meta["val"].is_contiguous():
            x = copy_in(aten.clone.default, x, memory_format=torch.contiguous_format)
        x = copy_in(aten.view.default, x, [-1])
        if call.param_dtype is not None and call.param_dtype != x.meta["val"].dtype:
            x = copy_in(prims.convert_element_type.default, x, call.param_dtype)
        pad = layout.padded_numel - x.meta["val"].numel()
        if pad:
            x = copy_in(aten.constant_pad_nd.default, x, [0, pad], 0.0)
        flats.append(x)
    flat = flats[0] if len(flats) == 1 else copy_in(aten.cat.default, flats)
    gathered = factory(ROLE_ALL_GATHER)(ALL_GATHER, flat, world, calls[0].group_name)
    waited = factory(ROLE_GATHER_WAIT)(WAIT, gathered)  # (world * bucket_numel,)

    copy_out = factory(ROLE_GATHER_COPY_OUT)
    if len(calls) == 1:
        return [
            _rows(
                copy_out,
                copy_out(aten.view.default, waited, list(layouts[0].gathered_shape())),
                layouts[0],
            )
        ]
    bucket_numel = sum(layout.padded_numel for layout in layouts)
    per_rank = copy_out(aten.view.default, waited, [world, bucket_numel])
    fulls, offset = [], 0
    for layout in layouts:
        part = copy_out(aten.slice.Tensor, per_rank, 1, offset, offset + layout.padded_numel)
        part = copy_out(aten.clone.default, part, memory_format=torch.contiguous_format)
        part = copy_out(aten.view.default, part, list(layout.gathered_shape()))
        fulls.append(_rows(copy_out, part, layout))
        offset += layout.padded_numel
    return fulls


def _rows(copy_out: NodeFactory, gathered_rows: fx.Node, layout: ShardLayout) -> fx.Node:
    """The first dim0 rows of the padded gathered buffer: the full parameter."""
    if layout.rows_per_rank * layout.world_size == layout.dim0:
        return gathered_rows
    return copy_out(aten.slice.Tensor, gathered_rows, 0, 0, layout.dim0)


def _single_rank_full(make: NodeFactory, call: UnshardCall) -> fx.Node:
    x = call.shard
    if call.param_dtype is not None and call.param_dtype != x.meta["val"].dtype:
        x = make(prims.convert_element_type.default, x, call.param_dtype)
    return x
