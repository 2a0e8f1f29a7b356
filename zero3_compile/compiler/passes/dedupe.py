"""Gather each parameter once per graph."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..._torch.dynamo import set_grad_enabled_target
from ...collectives.ops import is_unshard
from ..context import PassContext
from ..graph_facts import shard_source
from ..markers import UnshardCall


def dedupe_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Merge ``unshard`` markers of the same parameter into the first one.

    The same parameter: the same ``param_id`` read from the same graph input (two instances of a
    model, a student and its teacher, share ids but not inputs).

    **Invariant** after: at most one marker per (parameter, sink) in the graph. A tied parameter
    (an embedding reused as the output head) or a module called twice is then gathered once,
    and autograd sums its gradient contributions before the single reduce-scatter, instead of
    paying one collective per use in both directions. Run on the dynamo graph, before
    AOTAutograd traces the backward (which would otherwise hold one reduce per use), and again
    on the joint graph.

    The kept marker must record autograd when any of the merged ones did: when the first read
    ran under ``torch.no_grad()`` and a later one with grad (a target computed by the same
    layer), the kept marker and its shard read are wrapped in ``_set_grad_enabled(True)``.

    ```
    before:
      inputs: idx_1, shard_1
      unshard = unshard(shard_1, 'wte.weight')
      index = index(unshard, [idx_1])
      unshard_1 = unshard(shard_1, 'wte.weight')
      t = t(unshard_1)
      mm = mm(index, t)
      return mm
    after:
      inputs: idx_1, shard_1
      unshard = unshard(shard_1, 'wte.weight')
      index = index(unshard, [idx_1])
      t = t(unshard)
      mm = mm(index, t)
      return mm
    ```
    """
    graph = gm.graph
    grad_mode = set_grad_enabled_target()
    grad_enabled = torch.is_grad_enabled()
    first: dict[tuple, list] = {}  # key -> [kept marker, whether it records autograd]
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is grad_mode:
            grad_enabled = bool(node.args[0])
            continue
        if not is_unshard(node):
            continue
        call = UnshardCall.of(node)
        key = (shard_source(call.shard), call.param_id, call.grad_sink is None)
        kept = first.get(key)
        if kept is None:
            first[key] = [node, grad_enabled]
            continue
        node.replace_all_uses_with(kept[0])
        graph.erase_node(node)
        _erase_dead_reads(graph, call.shard)
        if grad_enabled and not kept[1]:
            _record_autograd(graph, kept[0])
            kept[1] = True
    graph.lint()


def _erase_dead_reads(graph: fx.Graph, node) -> None:
    """The shard read of a merged marker (``to_local`` and views), now unused."""
    while isinstance(node, fx.Node) and node.op != "placeholder" and not node.users:
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None


def _record_autograd(graph: fx.Graph, marker: fx.Node) -> None:
    """Run ``marker`` and its shard read with grad enabled, whatever the mode around them."""
    grad_mode = set_grad_enabled_target()
    chain = []
    node = UnshardCall.of(marker).shard
    # the shard read (to_local and views of a placeholder) moves next to the marker
    while isinstance(node, fx.Node) and node.op != "placeholder" and len(node.users) == 1:
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            break
        chain.append(node)
        node = inputs[0]
    for read in reversed(chain):
        marker.prepend(read)
    start = chain[-1] if chain else marker
    with graph.inserting_before(start):
        graph.call_function(grad_mode, (True,))
    with graph.inserting_after(marker):
        graph.call_function(grad_mode, (False,))
