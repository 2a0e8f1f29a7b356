"""Gather each parameter once per graph."""

from __future__ import annotations

import torch.fx as fx

from ..graph_utils import VIEW_OPS, root_placeholder
from ..ops import UNSHARD
from ..plan import Plan


def dedupe_gathers(gm: fx.GraphModule, plan: Plan) -> None:
    """Merge ``unshard`` markers of the same shard into the first one.

    **Invariant** after: at most one marker per (shard, options) in the graph. A tied parameter
    (an embedding reused as the output head) or a module called twice is then gathered once,
    and autograd sums its gradient contributions before the single reduce-scatter, instead of
    paying one collective per use in both directions.

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
        if node.op != "call_function" or node.target is not UNSHARD:
            continue
        shard, *rest = node.args
        source = root_placeholder(shard) or shard
        key = (source, tuple(tuple(a) if isinstance(a, list) else a for a in rest))
        kept = first.get(key)
        if kept is None:
            first[key] = node
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        _erase_dead_views(graph, shard)
    graph.lint()


def _erase_dead_views(graph: fx.Graph, node: fx.Node) -> None:
    while node.op == "call_function" and not node.users and node.target in VIEW_OPS:
        source = node.args[0]
        graph.erase_node(node)
        node = source
