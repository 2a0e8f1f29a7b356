"""Access to what the backend compiled: the scheduled graphs and Inductor's generated code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.fx as fx

from .graph_utils import output_node
from .meta import NUM_USER_OUTPUTS


@dataclass
class GraphRecord:
    """One graph the backend compiled, as handed to codegen (after every pass)."""

    kind: str  # "forward", "backward" or "inference"
    graph_id: int
    gm: fx.GraphModule
    source_code: str | None = None  # Inductor's generated wrapper code (codegen="inductor")

    @property
    def saved(self) -> list[fx.Node]:
        """Forward graph outputs saved for backward (empty for other graphs)."""
        count = self.gm.meta.get(NUM_USER_OUTPUTS)
        if self.kind != "forward" or count is None:
            return []
        outputs = output_node(self.gm.graph).args[0]
        return [n for n in outputs[count:] if isinstance(n, fx.Node)]


_recorders: list[list[GraphRecord]] = []


@contextlib.contextmanager
def record_graphs() -> Iterator[list[GraphRecord]]:
    """Collect a ``GraphRecord`` for every graph compiled inside the ``with`` block."""
    records: list[GraphRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def _record(record: GraphRecord) -> None:
    for records in _recorders:
        records.append(record)
