"""One collective in flight at a time on gloo: each one is waited before the next is issued."""

from __future__ import annotations

import operator

import torch.fx as fx

from ..._torch.c10d import WAIT, backend_of
from ..._torch.fx import OpOverload
from ...collectives.ops import HANDOFF_GATHER, TAKE_GATHER
from ..context import PassContext
from ..graph_utils import move_before


def serialize_collectives(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Move waits earlier so that no two collectives on serialized groups are in flight together.

    torch's gloo corrupts the heap when several collectives are in flight in one process, on one
    process group or on several (``bench/repros/gloo_reduce_scatter_race.py``; one in flight
    while the main thread computes never failed). Option ``serial_collectives``: ``"auto"``
    serializes the collectives of gloo groups, ``True`` those of every group, ``False`` none.

    **Invariant** after: for collectives ``a`` issued before ``b`` on serialized groups, every
    wait of ``a`` precedes ``b``; a wait that was after ``b`` sits right before it. Nothing else
    moves, so compute between an issue and its (moved) wait still overlaps that collective, and
    copy-outs stay where they were. Collectives of any kind count (the user's functional
    collectives traced into the graph too); a graph with at most one collective is unchanged.

    ```
    before:
      inputs: arg0_1, arg1_1, arg2_1
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      view_2 = view(arg2_1, [-1])
      all_gather_into_tensor_default_1 = all_gather_into_tensor(view_2, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      view_1 = view(wait_tensor_default, [4, 4])
      t = t(view_1)
      mm = mm(arg0_1, t)
      wait_tensor_default_1 = wait_tensor(all_gather_into_tensor_default_1)
      view_3 = view(wait_tensor_default_1, [4, 4])
      t_1 = t(view_3)
      mm_1 = mm(mm, t_1)
      return mm_1
    after:
      inputs: arg0_1, arg1_1, arg2_1
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      view_2 = view(arg2_1, [-1])
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      all_gather_into_tensor_default_1 = all_gather_into_tensor(view_2, 4, '0')
      view_1 = view(wait_tensor_default, [4, 4])
      t = t(view_1)
      mm = mm(arg0_1, t)
      wait_tensor_default_1 = wait_tensor(all_gather_into_tensor_default_1)
      view_3 = view(wait_tensor_default_1, [4, 4])
      t_1 = t(view_3)
      mm_1 = mm(mm, t_1)
      return mm_1
    ```
    (``prefetch_depth=2``; at the default depth of 1 a forward graph has one all-gather in
    flight already. In a backward graph a bucket's reduce-scatter is issued while the next
    all-gather is in flight: that all-gather's wait moves before it.)
    """
    mode = ctx.options.serial_collectives
    if mode is False:
        return
    graph = gm.graph
    seen: set[fx.Node] = set()
    outstanding: list[fx.Node] = []  # waits of the last serialized collective not yet reached
    for node in list(graph.nodes):
        seen.add(node)
        if not is_collective(node) or not serialized(group_of(node), mode):
            continue
        for wait in outstanding:
            if wait not in seen:
                moving = _with_inputs_after(wait, seen)
                move_before(moving, node)
                seen.update(moving)
        outstanding = waits_of(node)
    graph.lint()


def is_collective(node: fx.Node) -> bool:
    """A functional collective (not its wait), or one of ours that issues one (the
    cross-graph prefetch's take and handoff)."""
    target = node.target
    return node.op == "call_function" and (
        (
            isinstance(target, OpOverload)
            and target.namespace == "_c10d_functional"
            and target is not WAIT
        )
        or target in (TAKE_GATHER, HANDOFF_GATHER)
    )


def group_of(node: fx.Node) -> str:
    """The process group a functional collective names: its last positional argument."""
    return str(node.args[-1])


def serialized(group_name: str, mode: bool | str) -> bool:
    return mode is True or backend_of(group_name) == "gloo"


def waits_of(collective: fx.Node) -> list[fx.Node]:
    """The waits of a collective's outputs (through ``getitem`` for those returning several)."""
    waits = []
    for user in collective.users:
        if user.target is WAIT:
            waits.append(user)
        elif user.target is operator.getitem:
            waits.extend(u for u in user.users if u.target is WAIT)
    return waits


def _with_inputs_after(wait: fx.Node, seen: set[fx.Node]) -> list[fx.Node]:
    """``wait`` and the ``getitem`` between it and its collective when that comes later too."""
    (source,) = wait.all_input_nodes
    return [source, wait] if source not in seen else [wait]
