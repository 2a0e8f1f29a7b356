"""Gather each parameter once per graph."""

from __future__ import annotations

import torch.fx as fx

from ..compat import is_dtensor_to_local
from ..graph_utils import VIEW_OPS
from ..ops import is_unshard
from ..plan import Plan

_VIEW_METHODS = {"view", "reshape"}


def dedupe_gathers(gm: fx.GraphModule, plan: Plan) -> None:
    """Merge ``unshard`` markers of the same shard into the first one.

    **Invariant** after: at most one marker per (shard, options) in the graph. A tied parameter
    (an embedding reused as the output head) or a module called twice is then gathered once,
    and autograd sums its gradient contributions before the single reduce-scatter, instead of
    paying one collective per use in both directions. Run on the dynamo graph, before
    AOTAutograd traces the backward (which would otherwise hold one reduce per use), and again
    on the joint graph.

    ```
    before:  s = view(primals_1)        after:  s = view(primals_1)
             a = unshard(s)                     a = unshard(s)
             ...embedding(a)...                 ...embedding(a)...
             s2 = view(primals_1)               ...linear(x, a)...
             b = unshard(s2)
             ...linear(x, b)...
    ```
    """
    graph = gm.graph
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if not is_unshard(node):
            continue
        shard, *rest = node.args
        rest += [node.kwargs[k] for k in sorted(node.kwargs)]
        key = (_source(shard), tuple(tuple(a) if isinstance(a, list) else a for a in rest))
        kept = first.get(key)
        if kept is None:
            first[key] = node
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        _erase_dead_views(graph, shard)
    graph.lint()


def _is_view(node: fx.Node) -> bool:
    if is_dtensor_to_local(node):  # how the dynamo graph reads a parameter's shard
        return True
    if node.op == "call_function":
        return node.target in VIEW_OPS
    return node.op == "call_method" and node.target in _VIEW_METHODS


def _source(node: fx.Node) -> fx.Node:
    """The placeholder ``node`` views (through views and ``DTensor.to_local``), or itself."""
    current = node
    while _is_view(current):
        current = current.args[0]
    return current if current.op == "placeholder" else node


def _erase_dead_views(graph: fx.Graph, node: fx.Node) -> None:
    while _is_view(node) and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source
