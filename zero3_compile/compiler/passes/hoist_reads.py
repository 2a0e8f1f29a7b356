"""Read shards outside activation-checkpointing regions."""

from __future__ import annotations

import torch.fx as fx

from ..._torch.dynamo import is_dtensor_to_local, normalize_to_local
from ..._torch.higher_order import checkpoint_hops
from ..context import PassContext
from ..graph_utils import value_meta


def hoist_shard_reads(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Move ``DTensor.to_local()`` of parameters out of checkpointed regions (dynamo graph).

    **Invariant** after: the body of a ``torch.utils.checkpoint`` region (and of ``wrap``) takes
    plain shards, never a ``DTensor`` parameter, as input. A ``DTensor`` entering a region makes
    AOTAutograd save its ``DeviceMesh`` among the region's tensors (and fail) as soon as the region
    holds attention.

    ```
    before:                                   after:
      out = tag_activation_checkpoint(          s = p.to_local()
          body, p, x)                           out = tag_activation_checkpoint(body, s, x)
      body(p, x):                               body(s, x):
        s = p.to_local()                          w = unshard(s, ...)
        w = unshard(s, ...)
    ```
    """
    normalize_to_local(gm)  # torch 2.11's closure calls: as method calls (cacheable)
    _hoist(gm)


def _hoist(gm: fx.GraphModule) -> None:
    hops = checkpoint_hops()
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in hops:
            continue
        body_ref = node.args[0]
        if not (isinstance(body_ref, fx.Node) and body_ref.op == "get_attr"):
            continue
        body = getattr(gm, body_ref.target)
        if not isinstance(body, fx.GraphModule):
            continue
        _hoist(body)  # nested regions first
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        operands = list(node.args[1:])
        if len(placeholders) != len(operands):
            continue
        for i, (ph, operand) in enumerate(zip(placeholders, operands)):
            if not ph.users or not all(is_dtensor_to_local(u) for u in ph.users):
                continue
            if not isinstance(operand, fx.Node):
                continue
            reads = list(ph.users)
            with gm.graph.inserting_before(node):
                local = gm.graph.call_method("to_local", (operand,))
            local.meta.update(value_meta(reads[0]))
            for read in reads:
                read.replace_all_uses_with(ph)
                body.graph.erase_node(read)
            ph.meta.update(value_meta(reads[0]))
            operands[i] = local
        node.args = (body_ref, *operands)
        body.graph.lint()
        body.recompile()
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
