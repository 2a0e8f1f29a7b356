"""Invariants of a scheduled graph, checked after every pass (the partition's own check:
``partition.check_no_gathered_saved``)."""

from __future__ import annotations

import torch.fx as fx

from ..._torch.c10d import COLLECTIVES, WAIT
from ...collectives.ops import GUARD, HANDOFF_GATHER, REDUCE_GRAD, RELOAD, TAKE_GATHER, UNSHARD
from ..context import PassContext
from ..graph_facts import param_derived
from ..graph_utils import node_order, output_node
from ..node_keys import ROLE


class ScheduleError(AssertionError):
    """A pass broke an invariant of the schedule (a bug in zero3_compile, please report it)."""

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#scheduleerror)"


def verify(
    gm: fx.GraphModule, ctx: PassContext, *, lowered: bool = False, guarded: bool = False
) -> None:
    """Check the invariants every pass must keep.

    **Invariant** checked:
    - the graph is well formed (``graph.lint``: every use after its definition);
    - every collective of ours has exactly one user, its ``wait_tensor``, and every wait reads a
      collective; a foreign collective (tensor parallelism's) is waited for after it or handed to
      the other graph of the partition;
    - once lowered (``lowered=True``), no marker is left; once guarded (``guarded=True``), a graph
      with collectives of ours (tagged with a role) runs exactly one cross-rank guard, before the
      first of them;
    - every gathered buffer of the backward graph dies in it: no gathered parameter, nor anything
      computed from gathered parameters alone, is an output. Codegen (FX and Inductor alike) frees
      a value right after its last use, so this is what "released after last use" requires. (The
      forward graph's saved outputs: ``partition.check_no_gathered_saved``.)
    """
    graph = gm.graph
    graph.lint()
    order = node_order(graph)
    collectives = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in COLLECTIVES:
            collectives.append(node)
            if node.meta.get(ROLE) is None:
                _check_foreign(node, order)
                continue
            users = list(node.users)
            if len(users) != 1 or users[0].target is not WAIT:
                raise ScheduleError(
                    f"zero3: collective {node.name} must have exactly one user, its wait; has {users}"
                )
            if order[users[0]] <= order[node]:
                raise ScheduleError(
                    f"zero3: wait {users[0].name} precedes its collective {node.name}"
                )
        elif node.target in (TAKE_GATHER, HANDOFF_GATHER):
            collectives.append(node)  # issue (or take over) an all-gather: waited like one
        elif node.target is WAIT:
            source = node.args[0]
            if not (
                isinstance(source, fx.Node)
                and (
                    source.target in COLLECTIVES
                    or source.target in (TAKE_GATHER, HANDOFF_GATHER)
                    or source.target is RELOAD
                    # a foreign collective issued by the other graph of the partition
                    or source.op == "placeholder"
                )
            ):
                raise ScheduleError(f"zero3: wait {node.name} does not read a collective")
        elif node.target is RELOAD and lowered:
            users = list(node.users)
            if len(users) != 1 or users[0].target is not WAIT or order[users[0]] <= order[node]:
                raise ScheduleError(f"zero3: reload {node.name} must be read through its wait")
        elif lowered and node.target in (UNSHARD, REDUCE_GRAD):
            raise ScheduleError(f"zero3: marker {node.name} survived lowering")
    ours = [c for c in collectives if c.meta.get(ROLE) is not None]
    if guarded and ours:
        guards = [n for n in graph.nodes if n.target is GUARD]
        if len(guards) != 1 or order[guards[0]] > min(order[c] for c in ours):
            raise ScheduleError("zero3: the cross-rank guard must run before the first collective")
    if ctx.graph_kind == "backward":
        derived = param_derived(graph)
        for out in output_node(graph).all_input_nodes:
            if out in derived:
                raise ScheduleError(
                    f"zero3: gathered parameter {out.name} is an output of the {ctx.graph_kind} "
                    "graph, so it would stay alive after its last use"
                )


def _check_foreign(node: fx.Node, order: dict) -> None:
    """A collective we did not insert (tensor parallelism's, DTensor's): waited in this graph after
    it, or handed to the other graph of the partition; other readers are allowed (the value after
    the wait is the same tensor)."""
    waits = [u for u in node.users if u.target is WAIT]
    if any(order[w] <= order[node] for w in waits):
        raise ScheduleError(f"zero3: a wait precedes the collective {node.name}")
    if not waits and not any(u.op == "output" for u in node.users):
        raise ScheduleError(f"zero3: collective {node.name} is never waited for")
