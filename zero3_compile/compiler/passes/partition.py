"""The partition stage: the joint graph becomes a forward and a backward graph.

Each step is a pass of the one signature, ``fn(joint, ctx) -> None``: it reads the joint graph
and ``ctx.partition`` (``context.Partition``: what AOTAutograd called the partitioner with),
and the steps after ``min_cut_partition`` edit ``ctx.partition.forward`` / ``.backward`` in
place. In order (``pipeline.PIPELINE``): the memory budget's plan, torch's min-cut partitioner,
the saved values' order, waited foreign collectives, the check that nothing gathered is saved,
hpZ's secondary shards.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ..._torch import aot_autograd
from ..._torch.c10d import COLLECTIVES, WAIT
from ...collectives.ops import UNSHARD
from .. import secondary
from ..context import Partition, PassContext
from ..graph_facts import param_derived, region_calls, region_param_outputs
from ..graph_utils import output_node
from ..markers import UnshardCall
from ..node_keys import NUM_USER_OUTPUTS
from .verify import ScheduleError


def _partition(ctx: PassContext) -> Partition:
    if ctx.partition is None:
        raise AssertionError("zero3: a partition step ran without ctx.partition (a bug)")
    return ctx.partition


def plan_memory_budget(joint: fx.GraphModule, ctx: PassContext) -> None:
    """Choose the parameters to keep gathered from forward to backward (``planner.plan_budget``)
    and tag their markers ``MUST_SAVE``; the plan goes to ``ctx.partition.plan``.

    **Invariant** after: the joint graph is unchanged but for the ``recompute`` tags of the
    markers the plan keeps; the plan's estimate fits the budget (else ``BudgetError``). A no-op
    without ``memory_budget_mb`` or with ``reshard_after_forward=False``.
    """
    options = ctx.options
    if options.memory_budget_bytes is None or not options.reshard_after_forward:
        return
    from ..planner import plan_budget  # the planner runs this stage's other steps itself

    partition = _partition(ctx)
    partition.plan = plan_budget(joint, partition.joint_inputs, partition.kwargs, ctx)


def min_cut_partition(joint: fx.GraphModule, ctx: PassContext) -> None:
    """Partition the joint graph with torch's min-cut partitioner
    (``_torch.aot_autograd.min_cut_partition``) into ``ctx.partition.forward`` and ``.backward``.

    **Invariant** after: the forward's outputs are the ``num_fwd_outputs`` user outputs (their
    count in its ``meta``, ``NUM_USER_OUTPUTS``), then the values saved for backward; gathers
    tagged ``MUST_RECOMPUTE`` (``tag_recompute``) are gathered again in backward, not saved.
    """
    partition = _partition(ctx)
    forward, backward = aot_autograd.min_cut_partition(
        joint, partition.joint_inputs, **partition.kwargs
    )
    forward.meta[NUM_USER_OUTPUTS] = partition.num_fwd_outputs
    partition.forward, partition.backward = forward, backward


def order_saved_values(joint: fx.GraphModule, ctx: PassContext) -> None:
    """Put the saved values in the order AOTAutograd slices them
    (``_torch.aot_autograd.order_saved_values``: torch 2.13's partitioner can emit an opaque
    value before tensors).

    **Invariant** after: the forward's saved values are grouped as AOTAutograd expects (tensors
    checked for version changes, others, opaque objects, symbolic ints) and the backward's
    placeholders take them in that order. A no-op on a partition already in order.
    """
    partition = _partition(ctx)
    aot_autograd.order_saved_values(
        partition.forward, partition.backward, partition.num_fwd_outputs
    )


def save_waited(joint: fx.GraphModule, ctx: PassContext) -> None:
    """Save a foreign collective's waited value for backward instead of its raw output.

    The partitioner may save the raw output of a collective it found in the joint graph (tensor
    parallelism's sequence-parallel all-gather): the backward then reads a tensor whose wait sits
    in another graph. ``wait_tensor`` returns its input, so saving the wait is the same value.

    **Invariant** after: every collective keeps its wait as the one reader of its raw output
    across the partition (no raw collective output is saved). A no-op without such outputs.
    """
    partition = _partition(ctx)
    fw_module = partition.forward
    graph = fw_module.graph
    output = output_node(graph)
    outputs = list(output.args[0])
    changed = False
    for i in range(partition.num_fwd_outputs, len(outputs)):
        node = outputs[i]
        if isinstance(node, fx.Node) and node.target in COLLECTIVES:
            waits = [u for u in node.users if u.target is WAIT]
            if waits:
                outputs[i] = waits[0]
                changed = True
    if changed:
        output.args = (tuple(outputs), *output.args[1:])
        graph.lint()
        fw_module.recompile()


def check_no_gathered_saved(joint: fx.GraphModule, ctx: PassContext) -> None:
    """Fail if the partitioner saved a gathered parameter (or a function of gathered parameters
    alone) for backward: with ``reshard_after_forward`` backward must gather again, except for
    the parameters the memory budget keeps gathered (``ctx.partition.kept``).

    **Invariant** checked: no saved value of the forward is a gathered parameter or computed
    from gathered parameters alone (a region's such output included), but the planned ones;
    else ``ScheduleError``. A no-op with ``reshard_after_forward=False``.
    """
    if not ctx.options.reshard_after_forward:
        return
    partition = _partition(ctx)
    graph = partition.forward.graph
    derived = param_derived(graph)
    outputs = output_node(graph).args[0]
    saved = [n for n in outputs[partition.num_fwd_outputs :] if isinstance(n, fx.Node)]
    kept = partition.kept

    def planned(node: fx.Node) -> bool:
        return node.target is UNSHARD and UnshardCall.of(node).spec.fqn in kept

    gathered = [n.name for n in saved if n in derived and not planned(n)]
    # a region's output computed from gathered parameters alone (``regions.py``)
    from_regions = {call: region_param_outputs(call, derived) for call in region_calls(graph)}
    gathered += [
        n.name
        for n in saved
        if n.op == "call_function"
        and n.target is operator.getitem
        and n.args[0] in from_regions
        and n.args[1] in from_regions[n.args[0]]
    ]
    if gathered:
        raise ScheduleError(
            f"zero3: the partitioner saved gathered parameters for backward: {gathered}"
        )


def keep_secondary_shards(joint: fx.GraphModule, ctx: PassContext) -> None:
    """hpZ: the forward saves a node-local secondary shard of each parameter its backward
    gathers again, and the backward gathers that within the node (``secondary.py``,
    [Note: secondary shards]).

    **Invariant** after: each backward marker of a parameter the forward also gathers reads a
    saved secondary shard with the node group's spec; the forward saves it among the tensors
    checked for version changes, the backward takes it at the matching placeholder. A no-op
    without ``secondary_shard`` or with ``reshard_after_forward=False``.
    """
    if not ctx.options.reshard_after_forward:
        return
    partition = _partition(ctx)
    secondary.keep_secondary_shards(
        partition.forward, partition.backward, partition.num_fwd_outputs, ctx.options
    )


__all__ = [
    "check_no_gathered_saved",
    "keep_secondary_shards",
    "min_cut_partition",
    "order_saved_values",
    "plan_memory_budget",
    "save_waited",
]
