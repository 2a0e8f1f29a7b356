"""Tell the partitioner never to save a gathered parameter for backward."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..compat import COLLECTIVES
from ..meta import PARAM_DERIVED
from ..ops import REDUCE_GRAD, UNSHARD
from ..plan import Plan

# Larger than any activation-checkpointing region id: the partitioner turns a recompute tag
# into MUST_SAVE when a tagged user has a larger id (region boundaries), which must never
# happen to a gathered parameter.
AC_GRAPH_ID = 1 << 30


def tag_recompute(gm: fx.GraphModule, plan: Plan) -> None:
    """Tag every gather marker and everything computed from gathered parameters alone.

    **Invariant** after: each ``unshard`` marker carries ``recompute=MUST_RECOMPUTE`` (or
    ``MUST_SAVE`` with ``reshard_after_forward=False``), and each node computed from such nodes
    and constants alone (``t(w)``, ``w.to(bf16)``, views, ``embedding(w_pos, arange(n))``) carries
    ``MUST_RECOMPUTE``, as do those constants. The min-cut partitioner then saves only the shards
    and activations; backward gathers again.

    ```
    joint graph:                       forward saves:    backward recomputes:
      w = unshard(s)   MUST_RECOMPUTE    s, x              w = unshard(s)
      wt = t(w)        MUST_RECOMPUTE                      wt = t(w)
      y = mm(x, wt)                                        dx = mm(dy, t(wt))
    ```
    """
    gather_policy = (
        CheckpointPolicy.MUST_RECOMPUTE
        if plan.options.reshard_after_forward
        else CheckpointPolicy.MUST_SAVE
    )
    derived: set[fx.Node] = set()
    constant: set[fx.Node] = set()  # computed from nothing (arange, ones, full, ...)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is UNSHARD:
            _tag(node, gather_policy)
            derived.add(node)
            continue
        if not _recomputable(node):
            continue
        inputs = node.all_input_nodes
        if all(inp in constant for inp in inputs):
            constant.add(node)
        elif all(inp in derived or inp in constant for inp in inputs):
            # e.g. t(w), w.to(bf16), embedding(w_pos, arange(seq)): a function of parameters
            _tag(node, CheckpointPolicy.MUST_RECOMPUTE)
            derived.add(node)
            for inp in inputs:
                if inp in constant:
                    _tag_constant(inp)


def _tag_constant(node: fx.Node) -> None:
    """Constants feeding recomputed nodes are recomputed too (they cost nothing to rebuild)."""
    if node.meta.get("recompute") is None:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID
        for inp in node.all_input_nodes:
            _tag_constant(inp)


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = AC_GRAPH_ID
    node.meta[PARAM_DERIVED] = True


def _recomputable(node: fx.Node) -> bool:
    target = node.target
    if target is REDUCE_GRAD or target in COLLECTIVES:
        return False
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if target._schema.is_mutable:
            return False
    return True
