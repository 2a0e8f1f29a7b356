"""Bind the markers a module's getter traced to the parameters their shards are read from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from ...collectives.ops import is_unshard
from ...sharding.spec import UNBOUND_ID
from ...sharding.state import state_of
from ..graph_facts import shard_source
from ..markers import UnshardCall


def bind_markers(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Give every unbound ``unshard`` marker of a dynamo graph its parameter's id and spec.

    The getters of identical blocks trace to identical graphs (``frontend/classes.py``): their
    markers hold ``UNBOUND_ID`` and the spec literal without the name, so dynamo compiles a
    block once and runs the compiled code for every block of its kind. This runs before any
    pass, in each call of the backend: the shard of each marker is read (through ``to_local``
    and views) from a graph input, whose example value is the sharded parameter, and the
    marker gets that parameter's ``param_id`` and full spec literal. The code compiled from the
    bound graph gathers whatever shards it is called with; the names serve the reports, the
    buckets' blocks and the cross-rank check's labels (those of the block compiled first).

    **Invariant** after: no unbound marker is left (a shard not read from a graph input is an
    error naming the parameter's shape, never a silent guess). The marker's spec agrees with the
    parameter's but for the name.
    """
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for node in gm.graph.nodes:
        if not is_unshard(node):
            continue
        call = UnshardCall.of(node)
        if call.param_id != UNBOUND_ID:
            continue
        source = shard_source(call.shard)
        index = placeholders.get(source)
        state = state_of(example_inputs[index]) if index is not None else None
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
