"""Tell the partitioner never to save a gathered parameter for backward."""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ...collectives.ops import UNSHARD
from ..context import PassContext
from ..graph_facts import constants, param_derived
from ..node_keys import PARAM_DERIVED

# Larger than any activation-checkpointing region id: the partitioner turns a recompute tag
# into MUST_SAVE when a tagged user has a larger id (region boundaries), which must never
# happen to a gathered parameter.
AC_GRAPH_ID = 1 << 30


def tag_recompute(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Tag every gather marker and everything computed from gathered parameters alone.

    **Invariant** after: each ``unshard`` marker carries ``recompute=MUST_RECOMPUTE`` (or
    ``MUST_SAVE`` with ``reshard_after_forward=False``), and each node computed from gathered
    parameters and constants alone (``graph_facts.param_derived``: ``t(w)``, ``w.to(bf16)``,
    views, ``embedding(w_pos, arange(n))``) carries ``MUST_RECOMPUTE``, as do the constants it
    reads. The min-cut partitioner then saves only the shards and activations; backward gathers
    again.

    ```
    before:
      inputs: arg0_1, arg1_1, arg2_1
      unshard = unshard(arg1_1, 'h.0.fc.weight')
      unshard_1 = unshard(arg2_1, 'h.0.fc.bias')
      t = t(unshard)
      addmm = addmm(unshard_1, arg0_1, t)
      relu = relu(addmm)
      return relu
    after:
      inputs: arg0_1, arg1_1, arg2_1
      unshard = unshard(arg1_1, 'h.0.fc.weight')  # recompute
      unshard_1 = unshard(arg2_1, 'h.0.fc.bias')  # recompute
      t = t(unshard)  # recompute
      addmm = addmm(unshard_1, arg0_1, t)
      relu = relu(addmm)
      return relu
    ```
    """
    gather_policy = (
        CheckpointPolicy.MUST_RECOMPUTE
        if ctx.options.reshard_after_forward
        else CheckpointPolicy.MUST_SAVE
    )
    derived = param_derived(gm.graph)
    constant = constants(gm.graph)
    for node in gm.graph.nodes:
        if node not in derived:
            continue
        _tag(node, gather_policy if node.target is UNSHARD else CheckpointPolicy.MUST_RECOMPUTE)
        node.meta[PARAM_DERIVED] = True
        for inp in node.all_input_nodes:
            if inp in constant:
                _tag_constant(inp)


def _tag_constant(node: fx.Node) -> None:
    """Constants feeding recomputed nodes are recomputed too (they cost nothing to rebuild)."""
    if node.meta.get("recompute") is None:
        _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
        for inp in node.all_input_nodes:
            _tag_constant(inp)


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = AC_GRAPH_ID
