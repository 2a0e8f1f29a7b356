"""Nested compile regions (``torch.compiler.nested_compile_region``): the region's body is
compute only; its parameters are gathered, prefetched, freed and reduced by the graph calling it.

Dynamo traces a region once and calls the same body (``invoke_subgraph``) for every block of its
kind, and AOTAutograd and Inductor compile that body once, whatever the depth. Our markers are
lifted out of the body (``lift_region_gathers``), so every pass sees them in the calling graph as if the blocks were
inlined: buckets and prefetch across block boundaries, one memory estimate, one cross-rank check.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from ..._torch.dynamo import is_dtensor_to_local, normalize_to_local
from ...collectives.ops import UNSHARD, is_unshard
from ..context import PassContext
from ..graph_facts import (
    calls_regions,
    param_derived,
    region_body,
    region_calls,
    region_param_outputs,
)
from ..graph_utils import value_meta


def lift_region_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Move each region body's parameter reads (``p.to_local()`` and its ``unshard`` marker)
    to the calling dynamo graph, before every call of the body; the body takes the full
    parameter instead of the ``DTensor``.

    **Invariant** after: no region body reads a ``DTensor`` parameter. A body that reads one in
    another way (a use besides the marker) is refused with the fix, not compiled with the
    parameter's ``DTensor`` inside (AOTAutograd cannot trace that).

    ```
    before:                                        after:
      out = invoke_subgraph(body, "b", p, x)         s = p.to_local()
      body(p, x):                                    w = unshard(s, -1, spec)
        s = p.to_local()                             out = invoke_subgraph(body, "b", w, x)
        w = unshard(s, -1, spec)                     body(w, x):
        y = linear(x, w)                               y = linear(x, w)
    ```
    """
    if not calls_regions(gm):
        return
    normalize_to_local(gm)
    _lift(gm, {}, set())


@dataclass(frozen=True)
class _Read:
    """A parameter read lifted out of a body: the placeholder it read, the marker's constant
    arguments, the placeholder of its gradient sink (or None), the nodes' value metadata."""

    index: int
    param_id: int
    spec: str
    sink_index: int | None
    local_meta: dict
    full_meta: dict


def _lift(gm: fx.GraphModule, reads_of: dict, visited: set) -> None:
    """Lift the reads of the regions ``gm`` calls, and first those of the regions its bodies
    (regions, checkpointed regions) call: a read lifted out of an inner body lands in the
    enclosing body and is lifted from there in turn. ``reads_of``: body -> its reads, so a body
    called from several graphs is rewritten once and every call site gets its reads;
    ``visited``: the graphs whose calls are lifted already."""
    if gm in visited:  # a body shared by several callers
        return
    visited.add(gm)
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            _lift(child, reads_of, visited)
    calls = region_calls(gm.graph)
    for call in calls:
        body = region_body(call)
        if body not in reads_of:
            reads_of[body] = _take_reads(body)
        reads = reads_of[body]
        operands = list(call.args[2:])
        for read in reads:
            sink = None if read.sink_index is None else operands[read.sink_index]
            with gm.graph.inserting_before(call):
                local = gm.graph.call_method("to_local", (operands[read.index],))
                full = gm.graph.call_function(UNSHARD, (local, read.param_id, read.spec, sink))
            local.meta.update(read.local_meta)
            full.meta.update(read.full_meta)
            operands[read.index] = full
        call.args = (*call.args[:2], *operands)
    if calls:
        gm.graph.lint()
        gm.recompile()


def _take_reads(body: fx.GraphModule) -> list[_Read]:
    """Remove the parameter reads from ``body`` (its placeholders then hold the full
    parameters); returns them."""
    places = [n for n in body.graph.nodes if n.op == "placeholder"]
    reads = []
    for index, pairs in _parameter_reads(body, places):
        read, marker = pairs[0]
        sink = marker.args[3] if len(marker.args) > 3 else None
        reads.append(
            _Read(
                index=index,
                param_id=marker.args[1],
                spec=marker.args[2],
                sink_index=places.index(sink) if isinstance(sink, fx.Node) else None,
                local_meta=value_meta(read),
                full_meta=value_meta(marker),
            )
        )
        places[index].meta.update(value_meta(marker))
        for read, marker in pairs:  # one gather serves every read of the parameter
            marker.replace_all_uses_with(places[index])
            body.graph.erase_node(marker)
            body.graph.erase_node(read)
    if reads:
        body.graph.lint()
        body.recompile()
    return reads


def _parameter_reads(body: fx.GraphModule, places: list[fx.Node]):
    """(placeholder index, [(its ``to_local``, the marker), ...]) for each parameter the body
    reads (a parameter read twice traces to two reads of the same shard and spec)."""
    reads = []
    for index, place in enumerate(places):
        users = list(place.users)
        if not any(is_dtensor_to_local(u) for u in users):
            continue
        pairs = [(u, next(iter(u.users), None)) for u in users]
        if not all(
            is_dtensor_to_local(read)
            and len(read.users) == 1
            and is_unshard(marker)
            and marker.args[1:] == pairs[0][1].args[1:]
            for read, marker in pairs
        ):
            raise NotImplementedError(
                f"zero3: a nested compile region ({body.__class__.__name__}) uses a sharded "
                f"parameter ({place.name}) other than by reading it; read the parameter as a "
                "module attribute in the region, or do not pass its block to compile_once"
            )
        reads.append((index, pairs))
    return reads


def recompute_region_saves(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Give a region's backward the gathered parameters from the calling graph, not saved from
    its forward (joint graph).

    AOTAutograd partitions a region's body on its own: its forward returns, for its backward,
    the parameters it was called with and functions of them (``t(w)``), which would keep every
    block's gathered parameters alive from forward to backward. Each such operand of a region's
    backward call is computed again in the calling graph from the forward call's operands (the
    gathered parameters), so the partition that follows (``tag_recompute``) gathers them again
    in backward and saves only shards and activations.

    **Invariant** after: no region call reads an output of another region call that its body
    computes from gathered parameters and constants alone.

    ```
    before:                                          after:
      w = unshard(s)                                   w = unshard(s)
      fw = invoke_subgraph(fw_body, "f", w, x)         fw = invoke_subgraph(fw_body, "f", w, x)
      t_w = fw[1]          # body: t(w)                t_w = t(w)
      bw = invoke_subgraph(bw_body, "b", t_w, g)       bw = invoke_subgraph(bw_body, "b", t_w, g)
    ```
    """
    calls = region_calls(gm.graph)
    if not calls:
        return
    derived = param_derived(gm.graph)
    param_outputs = {call: region_param_outputs(call, derived) for call in calls}
    changed = False
    for call in calls:
        operands = list(call.args[2:])
        for k, operand in enumerate(operands):
            source = _region_output(operand, param_outputs)
            if source is None:
                continue
            forward, node = source
            with gm.graph.inserting_before(call):
                operands[k] = _copy_into(gm.graph, node, forward)
            changed = True
        call.args = (*call.args[:2], *operands)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()


def _region_output(operand, param_outputs) -> tuple[fx.Node, fx.Node] | None:
    """(the forward region call, the body node) when ``operand`` is ``call[j]`` of a region call
    whose body computes output ``j`` from gathered parameters alone."""
    if not (isinstance(operand, fx.Node) and operand.op == "call_function"):
        return None
    if operand.target is not operator.getitem or operand.args[0] not in param_outputs:
        return None
    forward, index = operand.args
    node = param_outputs[forward].get(index)
    return None if node is None else (forward, node)


def _copy_into(graph: fx.Graph, node: fx.Node, call: fx.Node) -> fx.Node:
    """Copy ``node`` and its ancestors from the body of ``call`` into ``graph`` (at its insert
    point), the body's placeholders standing for the call's operands."""
    body = region_body(call).graph
    places = [n for n in body.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = dict(zip(places, call.args[2:]))

    def copy(n: fx.Node) -> fx.Node:
        if n not in env:
            for inp in n.all_input_nodes:
                copy(inp)
            env[n] = graph.node_copy(n, lambda a: env[a])
        return env[n]

    return copy(node)


__all__ = ["lift_region_gathers", "recompute_region_saves"]
