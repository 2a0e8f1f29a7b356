"""Bind the markers a module's getter traced to the parameters their shards are read from."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from ...collectives.ops import is_unshard
from ...sharding.spec import UNBOUND_ID
from ...sharding.state import state_of
from ..context import PassContext
from ..graph_facts import shard_source
from ..markers import UnshardCall


def bind_markers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Give every unbound ``unshard`` marker of a dynamo graph its parameter's id and spec.

    The getters of identical blocks trace to identical graphs (``frontend/classes.py``): their
    markers hold ``UNBOUND_ID`` and the spec literal without the name, so dynamo compiles a
    block once and runs the compiled code for every block of its kind. This runs before any
    other pass but the lifting of region reads, in each call of the backend: the shard of each
    marker is read (through ``to_local`` and views) from a graph input, whose example value
    (``ctx.inputs``) is the sharded parameter, and the marker gets that parameter's
    ``param_id`` and full spec literal. The code compiled from the
    bound graph gathers whatever shards it is called with; the names serve the reports, the
    buckets' blocks and the cross-rank check's labels (those of the block compiled first).

    **Invariant** after: no unbound marker is left (a shard not read from a graph input is an
    error naming the parameter's shape, never a silent guess). The marker's spec agrees with the
    parameter's but for the name.
    """
    example_inputs = ctx.inputs.example_inputs
    inputs = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}

    def state_at(source: fx.Node):
        index = inputs.get(source)
        return state_of(example_inputs[index]) if index is not None else None

    _bind_graph(gm, state_at, set(), strict=True)


def _bind_graph(gm: fx.GraphModule, state_at, bound: set[int], strict: bool) -> None:
    """Bind ``gm``'s markers (``state_at``: a placeholder of ``gm`` -> the sharded state its
    value is, or None), then those in the bodies of its activation-checkpointed regions
    (``tag_activation_checkpoint(body, *operands)``: the body's placeholders are the operands,
    in order). A body two calls share is copied first, so each call's markers name its own
    parameters. In a body, a marker whose shard is not an operand read from a parameter stays
    unbound (the lowering reads shards, not names)."""
    for node in gm.graph.nodes:
        if is_unshard(node):
            _bind(node, state_at, strict)
            continue
        body = _body(gm, node.args[0]) if node.target is _CHECKPOINT else None
        if body is not None:
            if id(body) in bound:
                body = fx.GraphModule(body, copy.deepcopy(body.graph))
                name = f"{node.args[0].target}_zero3_{len(bound)}"
                gm.add_submodule(name, body)
                with gm.graph.inserting_before(node):
                    node.update_arg(0, gm.graph.get_attr(name))
            bound.add(id(body))
            places = [n for n in body.graph.nodes if n.op == "placeholder"]
            outer = dict(zip(places, node.args[1:]))

            def inner(source: fx.Node, outer=outer) -> object:
                operand = outer.get(source)
                return state_at(shard_source(operand)) if isinstance(operand, fx.Node) else None

            _bind_graph(body, inner, bound, strict=False)
            body.recompile()


_CHECKPOINT = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def _body(gm: fx.GraphModule, arg) -> fx.GraphModule | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = getattr(gm, str(arg.target), None)
        return value if isinstance(value, fx.GraphModule) else None
    return None


def _bind(node: fx.Node, state_at, strict: bool) -> None:
    call = UnshardCall.of(node)
    if call.param_id != UNBOUND_ID:
        return
    source = shard_source(call.shard)
    state = state_at(source) if source.op == "placeholder" else None
    if state is None and not strict:
        return
    if state is None:
        raise RuntimeError(
            f"zero3: could not tell which sharded parameter of shape {call.spec.shape} a "
            f"compiled graph reads (its shard comes from {source.format_node()}, not from a "
            "parameter of the graph's inputs); please report it"
        )
    if state.spec.unbound_literal() != call.spec.literal():
        raise AssertionError(
            f"zero3: the marker of {state.fqn!r} was traced with another spec than the "
            "parameter's (a bug in zero3_compile, please report it)"
        )
    node.args = (call.shard, state.param_id, state.spec.literal(), call.grad_sink)
    node.kwargs = {}
