"""Small FX helpers the passes share: creating nodes with correct fake values, moving nodes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg

VIEW_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.as_strided.default,
}


def fake_mode_of(graph: fx.Graph) -> FakeTensorMode | None:
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return None


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def root_placeholder(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is a chain of views of, or None."""
    while node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node if node.op == "placeholder" else None


class NodeFactory:
    """Creates call_function nodes at the graph's current insertion point.

    Each node gets ``meta["val"]`` (computed under the graph's fake mode), the ``stack_trace``
    of ``source`` and the extra meta given; existing meta of other nodes is never touched.
    """

    def __init__(self, graph: fx.Graph, source: fx.Node | None = None, **meta):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph) or FakeTensorMode(allow_non_fake_inputs=True)
        self.source = source
        self.meta = meta
        self.created: list[fx.Node] = []

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs)
        fake_args = map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = map_arg(kwargs, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        if self.source is not None and "stack_trace" in self.source.meta:
            node.meta["stack_trace"] = self.source.meta["stack_trace"]
        node.meta.update(self.meta)
        self.created.append(node)
        return node


def move_before(nodes: Iterable[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (in the given order) to just before ``anchor``."""
    for node in nodes:
        if node is not anchor:
            anchor.prepend(node)


def move_users_after(node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move every transitive user of ``node`` that precedes ``anchor`` to just after it.

    Used when a value is produced later than it used to be; the moved users keep their
    relative order. Users are expected to be cheap (views, the output).
    """
    anchor_pos = order[anchor]
    to_move: set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output" or user in to_move or order[user] > anchor_pos:
            continue
        to_move.add(user)
        stack.extend(user.users)
    cursor = anchor
    for user in sorted(to_move, key=order.__getitem__):
        cursor.append(user)
        cursor = user
