"""Liveness of a graph's tensors: bytes alive after each node, as FX codegen frees them.

Storages, not tensors, are what the allocator sees: a view (``view``, ``t``, ``slice``,
``wait_tensor`` returning its input) shares its input's storage. A storage lives from the node
that creates it to the last node that reads any tensor on it (for a collective's input: to the
collective's wait, as the collective holds it until it completes), or to the end when it is a
graph output. Storages of placeholders existed before the graph runs: they are not counted, but when
``inputs_die`` is set (a backward graph consumes its saved activations) they are subtracted once
their last reader has run. ``gloo_temporaries`` adds the temporaries gloo's collectives allocate
(measured: an all-gather's output size, a reduce-scatter's input size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch.c10d import ALL_GATHER, ALL_REDUCE_INPLACE, COLLECTIVES, WAIT
from .._torch.tensors import storage_key
from ..collectives.ops import SPOOL_GRAD


@dataclass
class MemoryTimeline:
    live_bytes: list[int]  # bytes alive above the start, after each node (graph order)
    peak_bytes: int
    peak_node: str
    end_bytes: int  # created by the graph and still alive at its end (its outputs)


def _tensors(val):
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for t in val if isinstance(t, torch.Tensor)]
    return []


def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _held_until(reader: fx.Node, position: dict[fx.Node, int]) -> int:
    """A collective holds its input until it completes: until its wait, not its issue."""
    if reader.target in COLLECTIVES:
        return max(
            (position[w] for w in reader.users if w.target is WAIT), default=position[reader]
        )
    return position[reader]


def memory_timeline(
    gm: fx.GraphModule, *, inputs_die: bool = False, gloo_temporaries: bool = False
) -> MemoryTimeline:
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    end = len(nodes)
    first: dict[object, int] = {}
    last: dict[object, int] = {}
    size: dict[object, int] = {}
    is_input: set[object] = set()
    outputs = {n for n in nodes if n.op == "output" for n in n.all_input_nodes}
    for node in nodes:
        if node.op == "output":
            continue
        for tensor in _tensors(node.meta.get("val")):
            try:
                storage = tensor.untyped_storage()
                key = storage_key(tensor)
            except (NotImplementedError, RuntimeError):  # sparse or symbolic-size storages
                continue
            if key not in first:
                first[key] = position[node]
                size[key] = storage.nbytes() if isinstance(storage.nbytes(), int) else 0
                if node.target is SPOOL_GRAD:  # a spooled gradient holds no memory once written
                    size[key] = 0
                if node.op == "placeholder":
                    is_input.add(key)
            readers = [_held_until(u, position) for u in node.users if u.op != "output"]
            dies = end if node in outputs else max(readers, default=position[node])
            last[key] = max(last.get(key, 0), dies)
    delta = [0] * (end + 1)
    if gloo_temporaries:
        # gloo all-gathers into a temporary of the output's size and reduce-scatters through an
        # all-reduce of a copy of the input; both live until the collective completes (an
        # in-place all-reduce has none)
        for node in nodes:
            if node.target in COLLECTIVES and node.target is not ALL_REDUCE_INPLACE:
                source = node if node.target is ALL_GATHER else node.args[0]
                temporary = _nbytes(source.meta.get("val"))
                delta[position[node]] += temporary
                wait = max(
                    (position[w] for w in node.users if w.target is WAIT), default=position[node]
                )
                delta[wait + 1] -= temporary
    for key, start in first.items():
        if key in is_input:
            if inputs_die and last[key] < end:
                delta[last[key] + 1] -= size[key]
            continue
        delta[start] += size[key]
        if last[key] < end:
            delta[last[key] + 1] -= size[key]
    live, current = [], 0
    for i in range(end):
        current += delta[i]
        live.append(current)
    peak_index = max(range(end), key=live.__getitem__) if live else 0
    created_at_end = sum(size[k] for k in first if k not in is_input and last[k] >= end)
    return MemoryTimeline(
        live_bytes=live,
        peak_bytes=max(live, default=0),
        peak_node=nodes[peak_index].name if nodes else "",
        end_bytes=created_at_end,
    )
