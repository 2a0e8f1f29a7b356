"""Invariants of a scheduled graph, checked after every pass."""

from __future__ import annotations

import torch.fx as fx

from ..compat import ALL_GATHER, REDUCE_SCATTER, WAIT
from ..graph_utils import node_order, output_node
from ..meta import PARAM_DERIVED, ROLE, ROLE_GATHER_COPY_OUT, ROLE_GATHER_WAIT
from ..ops import REDUCE_GRAD, UNSHARD
from ..plan import Plan


class ScheduleError(AssertionError):
    """A pass broke an invariant of the schedule (a bug in zero3_compile, please report it)."""


def verify(gm: fx.GraphModule, plan: Plan, *, lowered: bool = False) -> None:
    """Check the invariants every pass must keep.

    **Invariant** checked:
    - the graph is well formed (``graph.lint``: every use after its definition);
    - every collective has exactly one user, its ``wait_tensor``, and every wait reads a collective;
    - once lowered (``lowered=True``), no marker is left;
    - every gathered buffer of the backward graph dies in it: no gathered parameter, nor anything
      computed from gathered parameters alone, is an output. Codegen (FX and Inductor alike) frees
      a value right after its last use, so this is what "released after last use" requires. (The
      forward graph's saved outputs are checked where they are known, in the partitioner.)
    """
    graph = gm.graph
    graph.lint()
    order = node_order(graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (ALL_GATHER, REDUCE_SCATTER):
            users = list(node.users)
            if len(users) != 1 or users[0].target is not WAIT:
                raise ScheduleError(
                    f"zero3: collective {node.name} must have exactly one user, its wait; has {users}"
                )
            if order[users[0]] <= order[node]:
                raise ScheduleError(
                    f"zero3: wait {users[0].name} precedes its collective {node.name}"
                )
        elif node.target is WAIT:
            source = node.args[0]
            if not (isinstance(source, fx.Node) and source.target in (ALL_GATHER, REDUCE_SCATTER)):
                raise ScheduleError(f"zero3: wait {node.name} does not read a collective")
        elif lowered and node.target in (UNSHARD, REDUCE_GRAD):
            raise ScheduleError(f"zero3: marker {node.name} survived lowering")
    if plan.graph_kind == "backward":
        for out in output_node(graph).all_input_nodes:
            if _is_gathered(out):
                raise ScheduleError(
                    f"zero3: gathered parameter {out.name} is an output of the {plan.graph_kind} "
                    "graph, so it would stay alive after its last use"
                )


def _is_gathered(node: fx.Node) -> bool:
    if node.meta.get(ROLE) in (ROLE_GATHER_WAIT, ROLE_GATHER_COPY_OUT):
        return True
    if node.target is UNSHARD or node.meta.get(PARAM_DERIVED):
        return True
    return False
