"""Facts about graph nodes, each defined once: what is a view, what is computed from gathered
parameters alone, which values a gather produced, which outputs an input flows into.

Structural on purpose: they read the ops and the data flow, never the tags the passes set, which
Inductor's own joint-graph passes may drop when they rewrite a node.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from .._torch.c10d import ALL_GATHER, COLLECTIVES, WAIT
from .._torch.dynamo import set_grad_enabled_target
from .._torch.fx import OpOverload, schema_of
from .._torch.higher_order import invoke_subgraph_op
from ..collectives.ops import GUARD, REDUCE_GRAD, UNSHARD
from .graph_utils import output_node
from .node_keys import ROLE, ROLE_ALL_GATHER, ROLE_REPLICA_ALL_REDUCE


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of (shares storage with) its first input.

    An ATen op whose schema marks its result as an alias of an input (``view``, ``t``, ``slice``,
    ``expand``, ``reshape``...), ``wait_tensor`` (returns its input), and ``getitem`` of such a
    multi-output view (``split``, ``unbind``).
    """
    if node.op != "call_function":
        return False
    target = node.target
    if target is WAIT:
        return True
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_view(source)
    if isinstance(target, OpOverload):
        schema = schema_of(target)
        if schema.is_mutable:
            return False
        return any(ret.alias_info is not None for ret in schema.returns)
    return False


def view_root(node: fx.Node) -> fx.Node:
    """The node ``node`` is a chain of views of (``node`` itself when it is no view)."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def is_gather_wait(node: fx.Node) -> bool:
    """The wait of one of our parameter all-gathers (not of a foreign one: tensor parallelism's
    sequence-parallel gathers carry activations; nor a reduction's: hybrid qgZ all-gathers the
    replicas' summed gradient chunks)."""
    if node.op != "call_function" or node.target is not WAIT:
        return False
    source = node.args[0]
    return isinstance(source, fx.Node) and is_parameter_gather(source)


def is_parameter_gather(node: fx.Node) -> bool:
    """One of our parameter all-gathers."""
    return node.target is ALL_GATHER and node.meta.get(ROLE) == ROLE_ALL_GATHER


def recomputable(node: fx.Node) -> bool:
    """Cheap to run again from its inputs with the same result: no collective, no randomness,
    no mutation."""
    target = node.target
    if target in (REDUCE_GRAD, GUARD) or target in COLLECTIVES or target is WAIT:
        return False
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if schema_of(target).is_mutable:
            return False
    return True


def param_derived(graph: fx.Graph, sources: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """Nodes whose value is a gathered parameter or a function of gathered parameters and
    constants alone (``t(w)``, ``w.to(bf16)``, ``embedding(w_pos, arange(n))``).

    Sources are ``unshard`` markers (unlowered graphs), all-gather waits (lowered graphs) and
    ``sources`` (a region body's placeholders that receive gathered parameters).
    Such a value can always be recomputed from the shards, so it must never be saved for
    backward (``reshard_after_forward``) nor outlive the graph.
    """
    derived: set[fx.Node] = set(sources)
    constant: set[fx.Node] = set()
    shards = shard_inputs(graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is UNSHARD or is_gather_wait(node):
            derived.add(node)
            continue
        if not recomputable(node):
            continue
        inputs = node.all_input_nodes
        if all(i in constant for i in inputs):
            constant.add(node)
        elif any(i in derived for i in inputs) and all(
            i in derived or i in constant or i in shards for i in inputs
        ):
            derived.add(node)
    return derived


def constants(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from nothing (``arange``, ``ones``, ``full``...) and their recomputable
    functions."""
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and recomputable(node):
            if all(i in constant for i in node.all_input_nodes):
                constant.add(node)
    return constant


def shard_source(node: fx.Node) -> fx.Node:
    """The graph input a shard is read from: through ``to_local`` and views (single-input
    nodes), up to a placeholder; the shard node itself when it is computed otherwise."""
    current = node
    while isinstance(current, fx.Node) and current.op in ("call_method", "call_function"):
        inputs = current.all_input_nodes
        if len(inputs) != 1:
            return node
        current = inputs[0]
    return current if isinstance(current, fx.Node) and current.op == "placeholder" else node


def shard_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Placeholders holding shards: read (through views) by a marker or an all-gather's input."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.target is UNSHARD:
            found.add(view_root(node.args[0]))
        elif node.target is ALL_GATHER and node.meta.get(ROLE) != ROLE_REPLICA_ALL_REDUCE:
            found.update(ancestor_placeholders(node))  # not a reduction's (hybrid qgZ)
    return {n for n in found if n.op == "placeholder"}


def ancestor_placeholders(node: fx.Node) -> set[fx.Node]:
    return {n for n in ancestors(node) if n.op == "placeholder"}


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen


def gathered_values(
    wait: fx.Node, stop: Iterable[fx.Node] = ()
) -> tuple[set[fx.Node], set[fx.Node]]:
    """The values computed from an all-gather's wait alone (views, copy-outs, transposes) and the
    nodes reading them. The gathered buffer dies after the last reader."""
    stop = set(stop)
    derived, frontier, readers = {wait}, [wait], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            alone = user.op == "call_function" and set(user.all_input_nodes) <= derived
            if alone and user not in stop and recomputable(user):
                if user not in derived:
                    derived.add(user)
                    frontier.append(user)
            else:
                readers.add(user)
    return derived, readers


def output_dependencies(gm: fx.GraphModule) -> dict[int, frozenset[int]]:
    """For each graph input (placeholder index): the outputs its gradient may come from.

    Read from the dynamo graph, before AOTAutograd: the outputs its value flows into through ops
    that record autograd (not through a ``detach`` or an op run with grad disabled), an in-place
    op flowing into every tensor that shares the written tensor's storage (``x.clone().add_(y)``
    returns the clone: ``y`` reaches it): a superset of the outputs whose gradients an input's
    gradient is computed from, available even when AOTAutograd's cache skips tracing the joint
    graph. An input with none gets no gradient.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in reversed(nodes) if n.op == "output")
    values = output.args[0]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    reaches: dict[fx.Node, set[int]] = {n: set() for n in nodes}
    for j, value in enumerate(values):
        if isinstance(value, fx.Node):
            reaches[value].add(j)
    cut = _gradient_cuts(graph)
    sharing = _storage_sharers(nodes)
    changed = True
    while changed:  # a write reaches nodes before it too: iterate to the fixed point
        changed = False
        for node in reversed(nodes):
            outs = reaches[node]
            size = len(outs)
            for user in node.users:
                if user not in cut:
                    outs |= reaches[user]
            if _writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node):
                for alias in sharing.get(node.args[0], (node.args[0],)):
                    outs |= reaches[alias]
            changed |= len(outs) != size
    return {i: frozenset(reaches[p]) for i, p in enumerate(placeholders)}


def _storage_sharers(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Each node whose value is a plain tensor: the nodes whose values share its storage
    (views of one another), from dynamo's example values."""
    from torch.multiprocessing.reductions import StorageWeakRef

    by_storage: dict[Any, list[fx.Node]] = {}
    for node in nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if type(value).__name__ != "FakeTensor":
            continue
        try:
            key = StorageWeakRef(value.untyped_storage())
        except (RuntimeError, NotImplementedError):
            continue
        by_storage.setdefault(key, []).append(node)
    return {node: group for group in by_storage.values() for node in group}


def detachable_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Inputs (placeholder indices) the graph gives no gradient and never writes to.

    AOTAutograd passes such inputs detached, so that backward does not run the graph that
    produced them with no gradient (it would materialise zeros: a parameter used there would get
    a zero ``.grad`` where eager leaves None); it does not for graphs with tensor-subclass inputs,
    which ours have (the DTensor shards), so the backend does it (``runtime/gate.py``). Written
    inputs are kept: the write reaches autograd through the input. An input whose storage is
    unknown counts as written.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    deps = output_dependencies(gm)
    sharing = _storage_sharers(nodes)
    written: set[fx.Node] = set()
    for node in nodes:
        if _writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node):
            written.update(sharing.get(node.args[0], (node.args[0],)))
    return frozenset(
        i for i, p in enumerate(placeholders) if not deps[i] and p in sharing and p not in written
    )


def _writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return False
    if node.target in _IN_PLACE_OPERATORS or name.startswith("__i"):
        return True
    return name.endswith("_") and not name.startswith("_")


_IN_PLACE_OPERATORS = {
    operator.setitem,
    *(getattr(operator, f"i{op}") for op in ("add", "sub", "mul", "truediv", "floordiv", "mod")),
    *(getattr(operator, f"i{op}") for op in ("pow", "matmul", "and", "or", "xor")),
    *(getattr(operator, f"i{op}") for op in ("lshift", "rshift")),
}


def _gradient_cuts(graph: fx.Graph) -> set[fx.Node]:
    """Nodes no gradient flows back through: detaches, and ops dynamo recorded between its
    ``_set_grad_enabled(False)`` and ``_set_grad_enabled(True)`` (a ``no_grad`` block). The
    graph is taken to start with grad enabled (a call under ``no_grad`` has no backward)."""
    cut: set[fx.Node] = set()
    enabled = True
    for node in graph.nodes:
        if node.op == "call_function" and node.target is set_grad_enabled_target():
            enabled = bool(node.args[0])
            continue
        detach = node.target in ("detach", torch.Tensor.detach, torch.detach)
        if node.op in ("call_function", "call_method") and (not enabled or detach):
            cut.add(node)
    return cut


def region_calls(graph: fx.Graph) -> list[fx.Node]:
    """The calls of nested compile regions (``invoke_subgraph(body, identifier, *operands)``,
    ``torch.compiler.nested_compile_region``)."""
    op = invoke_subgraph_op()
    if op is None:
        return []
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


def calls_regions(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` or a body it holds (a checkpointed region, a region) calls a region."""
    return any(region_calls(m.graph) for m in gm.modules() if isinstance(m, fx.GraphModule))


def region_body(call: fx.Node) -> fx.GraphModule:
    """The body of a region call: its ``get_attr`` on the graph module that owns the call."""
    owner = call.graph.owning_module
    return getattr(owner, str(call.args[0].target))


def region_param_outputs(call: fx.Node, derived: set[fx.Node]) -> dict[int, fx.Node]:
    """The outputs of a region call computed, inside its body, from operands that are gathered
    parameters (nodes of ``derived``, ``param_derived`` of the calling graph) and constants alone:
    output index -> the body's node. Saved for backward, such an output would keep a gathered
    parameter (or ``t(w)``) alive from forward to backward."""
    body = region_body(call).graph
    places = [n for n in body.nodes if n.op == "placeholder"]
    gathered = [p for p, o in zip(places, call.args[2:]) if isinstance(o, fx.Node) and o in derived]
    inside = param_derived(body, gathered)
    outputs = output_node(body).args[0]
    return {j: o for j, o in enumerate(outputs) if isinstance(o, fx.Node) and o in inside}
