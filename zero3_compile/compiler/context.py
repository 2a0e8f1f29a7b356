"""What a pass may read (``PassContext``) and what one ``torch.compile`` backend call owns
(``CompileContext``: graph ids, the graphs it produced, the recorders listening)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..collectives.quantize import Quantization
from ..sharding.nodes import reduction_node_size
from .options import Options

GRAPH_KINDS = ("dynamo", "joint", "forward", "backward", "inference")


def block_of(name: str) -> str:
    """The repeated block a parameter belongs to: its name up to the first numeric component.

    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``; parameters outside any
    ``ModuleList``/``Sequential`` index (embeddings, final norm, head) belong to the root, "".
    Buckets never mix two different non-root blocks; root parameters join any bucket.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


@dataclass(frozen=True)
class PassContext:
    """The frozen record of everything a pass may read: the options, which graph it is, policies."""

    options: Options = field(default_factory=Options)
    graph_kind: str = "forward"
    block_of: Callable[[str], str] = block_of
    graph_id: str = ""

    def gather_quantization(self) -> Quantization | None:
        """How this graph's all-gathers are compressed: ``weight_quantization`` applies to the
        forward's (and inference's); backward re-gathers in full precision."""
        if self.graph_kind not in ("forward", "inference"):
            return None
        return Quantization.of(self.options.weight_quantization, self.options.quantization_block)

    def reduce_quantization(self) -> Quantization | None:
        """How this graph's gradient reductions are compressed (``gradient_quantization``)."""
        return Quantization.of(self.options.gradient_quantization, self.options.quantization_block)

    def reduce_node_size(self, shard_group: str) -> int | None:
        """Ranks per node where this graph's quantized gradient reductions over ``shard_group``
        sum within each node first (``schemes.QuantizedNodeReduce``); None: one exchange."""
        if self.options.gradient_quantization is None:
            return None
        return reduction_node_size(shard_group, self.options.secondary_shard)

    def for_graph(self, graph_kind: str, graph_id: str = "") -> PassContext:
        if graph_kind not in GRAPH_KINDS:
            raise ValueError(f"zero3: unknown graph kind {graph_kind!r}")
        return replace(self, graph_kind=graph_kind, graph_id=graph_id or self.graph_id)


_backend_calls = itertools.count()


@dataclass
class CompileContext:
    """One call of the backend (one dynamo graph): its options, the graphs it scheduled, and
    what the runtime needs to know about them."""

    options: Options
    recorders: list[Any] = field(default_factory=list)  # recording.GraphRecorder
    index: int = field(default_factory=lambda: next(_backend_calls))
    graphs: int = 0
    # user input index -> user outputs its gradient comes from (None: unknown), per joint graph
    gradient_dependencies: dict[int, frozenset[int] | None] = field(default_factory=dict)
    # user inputs to pass detached (graph_facts.detachable_inputs)
    detachable_inputs: frozenset[int] = frozenset()
    plans: list[Any] = field(default_factory=list)  # planner.BudgetPlan of each joint graph
    # names of the process groups the graph's parameters are sharded (and replicated) over: the
    # scheduled graphs name them, and a name is an ordinal of this process (part of cache keys)
    group_names: tuple[str, ...] = ()

    def next_graph_id(self, kind: str) -> str:
        graph_id = f"{self.index}.{self.graphs}"
        self.graphs += 1
        return graph_id

    def passes(self, graph_kind: str, graph_id: str = "") -> PassContext:
        return PassContext(options=self.options).for_graph(graph_kind, graph_id)
