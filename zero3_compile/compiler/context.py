"""What a pass may read (``PassContext``) and what one ``torch.compile`` backend call owns
(``CompileContext``: graph ids, the graphs it produced, the recorders listening).

A pass reads the graph it is handed and its context; the records a stage's passes share beyond
one graph hang on the context: the dynamo graph's example inputs (``GraphInputs``, read once per
backend call), the partition being built (``Partition``), the generated code (``Generated``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..collectives.quantize import Quantization
from ..sharding.nodes import reduction_node_size
from ..sharding.state import state_of
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
class GraphInputs:
    """What the dynamo graph reads, computed once per backend call: its example inputs, the
    parameters among them and the graph module's own, and the sharded states of those."""

    example_inputs: tuple[Any, ...] = ()
    parameters: tuple[nn.Parameter, ...] = ()  # every nn.Parameter the graph reads
    states: tuple[Any, ...] = ()  # sharding.state.ShardedParam of each sharded tensor it reads

    @classmethod
    def of(cls, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphInputs:
        read = list(example_inputs) + [p for _, p in gm.named_parameters()]
        return cls(
            example_inputs=tuple(example_inputs),
            parameters=tuple(t for t in read if isinstance(t, nn.Parameter)),
            states=tuple(s for s in (state_of(t) for t in read) if s is not None),
        )


@dataclass
class Partition:
    """The partition of one joint graph, as the partition stage's passes build it: what
    AOTAutograd called the partitioner with, then the forward and backward graphs."""

    joint_inputs: Sequence[object]
    kwargs: dict[str, Any]  # the partitioner's keyword arguments (num_fwd_outputs, ...)
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    plan: Any = None  # planner.BudgetPlan, when the memory budget planned this partition

    @property
    def num_fwd_outputs(self) -> int:
        return self.kwargs["num_fwd_outputs"]

    @property
    def kept(self) -> frozenset[str]:
        """Names of the parameters the memory budget keeps gathered from forward to backward."""
        return self.plan.kept_names if self.plan is not None else frozenset()


@dataclass(frozen=True)
class Generated:
    """A scheduled graph's generated code, for the post-codegen checks: the collective order
    scheduled (read before codegen, which rewrites the graph in place) and Inductor's code."""

    scheduled: Any  # signature.ScheduledOrder
    source_code: str | None


@dataclass(frozen=True)
class PassContext:
    """The frozen record of everything a pass may read: the options, which graph it is, policies,
    and the records of the stage it runs in (None/empty where another stage runs it)."""

    options: Options = field(default_factory=Options)
    graph_kind: str = "forward"
    block_of: Callable[[str], str] = block_of
    graph_id: str = ""
    inputs: GraphInputs = field(default_factory=GraphInputs, compare=False, repr=False)
    partition: Partition | None = field(default=None, compare=False, repr=False)
    generated: Generated | None = field(default=None, compare=False, repr=False)

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

    def passes(self, graph_kind: str, graph_id: str = "", **records: Any) -> PassContext:
        """The context of a pass on one of this call's graphs; ``records``: ``inputs=``,
        ``partition=``, ``generated=`` (``PassContext``'s fields). Not kept here: the compiled
        callable holds this object, and must not hold the example inputs or graphs alive."""
        context = PassContext(options=self.options, **records)
        return context.for_graph(graph_kind, graph_id)


# the whole package: any change of ours invalidates cached compiled code
_SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def source_hash() -> str:
    """A digest of the package's Python sources: part of every cache key of compiled code."""
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(_SOURCE_DIR)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:16]
