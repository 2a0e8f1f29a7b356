"""Small FX helpers the passes share: creating nodes with correct fake values, splicing traced
functions into a graph, moving nodes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg

from .._torch.fx import TorchDispatchMode, fake_tensor_types, node_name

FakeTensor, FakeTensorMode = fake_tensor_types()


def fake_mode_of(graph: fx.Graph) -> FakeTensorMode | None:
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return None


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _stamp(node: fx.Node, source: fx.Node | None, meta: dict) -> None:
    if source is not None and "stack_trace" in source.meta:
        node.meta["stack_trace"] = source.meta["stack_trace"]
    node.meta.update(meta)


class NodeFactory:
    """Creates call_function nodes at the graph's current insertion point.

    Each node gets ``meta["val"]`` (computed under the graph's fake mode), the ``stack_trace``
    of ``source`` and the extra meta given; existing meta of other nodes is never touched.
    """

    def __init__(self, graph: fx.Graph, source: fx.Node | None = None, **meta):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph) or FakeTensorMode(allow_non_fake_inputs=True)
        self.source = source
        self.meta = meta
        self.created: list[fx.Node] = []

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs)
        fake_args = map_arg(args, lambda n: n.meta["val"])
        fake_kwargs = map_arg(kwargs, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        _stamp(node, self.source, self.meta)
        self.created.append(node)
        return node

    def splice(self, fn: Callable, inputs: Sequence[fx.Node]):
        """Trace ``fn(*input values)`` and insert its ops here; returns the nodes of its result
        (same structure: a node, or a list of nodes). The spliced nodes get this factory's meta.
        """
        outputs, created = splice(self.graph, fn, inputs, self.fake_mode)
        for node in created:
            _stamp(node, self.source, self.meta)
        self.created.extend(created)
        return outputs


def splice(
    graph: fx.Graph,
    fn: Callable,
    inputs: Sequence[fx.Node],
    fake_mode: FakeTensorMode | None = None,
) -> tuple[object, list[fx.Node]]:
    """Trace ``fn`` on the fake values of ``inputs`` (ATen level, as the graph is) and insert its
    ops into ``graph`` at the insertion point, as Inductor's bucketing passes do.

    Returns (the result's node structure, the nodes created). Every created node carries the
    ``val`` computed while tracing. The ops are recorded as they dispatch (``_Recorder``), not
    through ``make_fx``, whose fixed cost per call (a tracer, a GraphModule and its code) made
    lowering a large share of a deep model's compile; inputs with symbolic shapes still go
    through ``make_fx``.
    """
    fake_mode = fake_mode or fake_mode_of(graph) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [node.meta["val"] for node in inputs]
    if any(_symbolic(f) for f in fakes):
        return _splice_make_fx(graph, fn, inputs, fakes, fake_mode)
    recorder = _Recorder(graph, inputs, fakes)
    with fake_mode, recorder:
        out = fn(*fakes)
    return recorder.result(out), recorder.created


def _symbolic(value) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))


class _Recorder(TorchDispatchMode):
    """Appends a node for every ATen (or custom) op ``fn`` dispatches, with its fake output as
    ``val``; tensors are matched to nodes by identity."""

    def __init__(self, graph: fx.Graph, inputs: Sequence[fx.Node], fakes: Sequence[object]):
        super().__init__()
        self.graph = graph
        self.nodes: dict[int, fx.Node] = {id(f): n for f, n in zip(fakes, inputs)}
        self.keep: list[object] = list(fakes)  # ids stay valid while the trace runs
        self.created: list[fx.Node] = []

    def _arg(self, value):
        if isinstance(value, torch.Tensor):
            node = self.nodes.get(id(value))
            if node is None:
                raise RuntimeError(
                    "zero3: a spliced function read a tensor that is neither its input nor "
                    "computed from it (a bug in zero3_compile, please report it)"
                )
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(self._arg(v) for v in value)
        return value

    def _add(self, target, args, kwargs, val, name) -> fx.Node:
        node = self.graph.create_node(
            "call_function", target, args, kwargs, name=node_name(self.graph, name)
        )
        node.meta["val"] = val
        self.created.append(node)
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        parts = out if isinstance(out, (list, tuple)) else [out]
        if not any(isinstance(p, torch.Tensor) for p in parts):
            return out  # a device, a dtype, a size: a constant of the graph (as make_fx does)
        node = self._add(
            func,
            tuple(self._arg(a) for a in args),
            {k: self._arg(v) for k, v in kwargs.items()},
            out,
            func.overloadpacket.__name__,
        )
        self.keep.append(out)
        if isinstance(out, (list, tuple)):
            for index, part in enumerate(out):
                if isinstance(part, torch.Tensor):
                    self.nodes[id(part)] = self._add(
                        operator.getitem, (node, index), {}, part, "getitem"
                    )
        else:
            self.nodes[id(out)] = node
        return out

    def result(self, out):
        if isinstance(out, (list, tuple)):
            return [self.result(o) for o in out]
        if isinstance(out, torch.Tensor):
            return self._arg(out)
        return out


def _splice_make_fx(graph, fn, inputs, fakes, fake_mode) -> tuple[object, list[fx.Node]]:
    with fake_mode:
        traced = make_fx(fn)(*fakes)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    value_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
    created: list[fx.Node] = []
    result = None
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = map_arg(node.args[0], lambda n: value_map[n])
            break
        new = graph.node_copy(node, lambda n: value_map[n])
        new.meta = {"val": node.meta.get("val")}
        value_map[node] = new
        created.append(new)
    return result, created


def move_before(nodes: Iterable[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (in the given order) to just before ``anchor`` (or before the first node
    after it that is not being moved, when ``anchor`` is one of them)."""
    nodes = list(nodes)
    moving = set(nodes)
    while anchor in moving:
        anchor = anchor.next
    for node in nodes:
        anchor.prepend(node)


def move_users_after(node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move every transitive user of ``node`` that precedes ``anchor`` to just after it.

    Used when a value is produced later than it used to be; the moved users keep their
    relative order. Users are expected to be cheap (views, the output).
    """
    anchor_pos = order[anchor]
    to_move: set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output" or user in to_move or order[user] > anchor_pos:
            continue
        to_move.add(user)
        stack.extend(user.users)
    cursor = anchor
    for user in sorted(to_move, key=order.__getitem__):
        cursor.append(user)
        cursor = user


def copy_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` (same node names, its ``meta`` copied, the nodes' fake values shared,
    read-only); returns it and {new node: original node}."""
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    output_value, old_output = graph.graph_copy(gm.graph, value_map, return_output_node=True)
    new_output = graph.output(output_value)
    new_output.meta = dict(old_output.meta)  # the partitioner reads the outputs' descriptors
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy, {new: old for old, new in value_map.items()}


# the metadata of a node's value (dynamo's example value, the traced value, its tensor meta)
VALUE_META = ("example_value", "val", "tensor_meta")


def value_meta(node: fx.Node) -> dict:
    """The value metadata of ``node``, to give a node that computes the same value."""
    return {key: node.meta[key] for key in VALUE_META if key in node.meta}
