"""What the lowering passes built for each bucket: ``BucketRecord``, kept in ``gm.meta[BUCKETS]``.

Prefetch, the reports and the verifier read these records instead of re-deriving buckets from
node tags, and make no assumption on how many collectives or waits a bucket has (a quantized
gather moves a payload and its scales; a hybrid reduction has two stages). Records name nodes
(picklable, so compile caches can key on the graph module), and ``resolve`` maps the names back;
a node another pass removed is skipped.

``GraphEmit`` is the emitter the lowering passes hand to a collective scheme
(``collectives/schemes.py``): each step becomes graph nodes tagged with its role, the bucket
index and the bucket's parameters, and is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .._torch.c10d import WAIT
from ..collectives.schemes import Emit
from .graph_utils import NodeFactory
from .node_keys import BUCKET, BUCKETS, FULL_BYTES, GROUP_ROLE, PARAMS, ROLE


@dataclass
class BucketRecord:
    kind: str  # "gather" or "reduce"
    index: int
    params: tuple[str, ...]
    scheme: str  # the scheme's class name
    groups: tuple[str, str]  # (shard group, replicate group or ""): the mesh it runs on
    nodes: dict[str, list[str]] = field(default_factory=dict)  # role -> node names, in order
    collectives: list[str] = field(default_factory=list)  # every collective, in issue order
    waits: list[str] = field(default_factory=list)  # every wait, in order
    # bytes the bucket's collective would carry uncompressed (None: it is not compressed)
    full_bytes: int | None = None
    # a gather's members: their spec literals and shard nodes, and the shards' dtype
    specs: tuple[str, ...] = ()
    shards: list[str] = field(default_factory=list)
    shard_dtype: Any = None

    def resolve(self, nodes: dict[str, fx.Node], names: Sequence[str]) -> list[fx.Node]:
        """The nodes of ``names`` (``nodes``: ``name_map(graph)``), skipping removed ones."""
        return [nodes[n] for n in names if n in nodes]

    def role_nodes(self, nodes: dict[str, fx.Node], *roles: str) -> list[fx.Node]:
        """The record's nodes of these roles, in the order they were created."""
        return self.resolve(nodes, [n for role in roles for n in self.nodes.get(role, ())])


def name_map(graph: fx.Graph) -> dict[str, fx.Node]:
    return {node.name: node for node in graph.nodes}


def records(gm: fx.GraphModule, kind: str | None = None) -> list[BucketRecord]:
    found = gm.meta.get(BUCKETS, [])
    return [r for r in found if kind is None or r.kind == kind]


def add_record(gm: fx.GraphModule, record: BucketRecord) -> None:
    gm.meta.setdefault(BUCKETS, []).append(record)


class GraphEmit(Emit):
    """Creates the nodes of a scheme's steps at the graph's insertion point, and records them."""

    in_graph = True

    def __init__(self, graph: fx.Graph, record: BucketRecord, source: fx.Node | None):
        self.graph = graph
        self.record = record
        self.source = source
        self.created: list[fx.Node] = []

    def _factory(self, role: str, **meta) -> NodeFactory:
        meta = {ROLE: role, BUCKET: self.record.index, PARAMS: self.record.params, **meta}
        return NodeFactory(self.graph, source=self.source, **meta)

    def _note(self, role: str, nodes: list[fx.Node]) -> None:
        self.record.nodes.setdefault(role, []).extend(n.name for n in nodes)
        self.created.extend(nodes)

    def collective(
        self, role: str, group_role: str, target, *args, full_bytes: int | None = None
    ) -> fx.Node:
        meta = (
            {GROUP_ROLE: group_role}
            if full_bytes is None
            else {GROUP_ROLE: group_role, FULL_BYTES: full_bytes}
        )
        node = self._factory(role, **meta)(target, *args)
        self._note(role, [node])
        self.record.collectives.append(node.name)
        return node

    def wait(self, role: str, work: fx.Node) -> fx.Node:
        node = self._factory(role)(WAIT, work)
        self._note(role, [node])
        self.record.waits.append(node.name)
        return node

    def node(self, role: str, target, *args, **kwargs) -> fx.Node:
        """A node of this bucket outside the scheme's steps (an offloaded shard's reload)."""
        node = self._factory(role)(target, *args, **kwargs)
        self._note(role, [node])
        return node

    def traced(self, role: str, fn: Callable, inputs: Sequence[Any]) -> Any:
        factory = self._factory(role)
        result = factory.splice(fn, list(inputs))
        self._note(role, factory.created)
        return result
