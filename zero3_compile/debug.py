"""Access to what the backend compiled: the scheduled graphs and Inductor's generated code."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
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


def measure_peak_bytes(fn: Callable[[], Any], device: str = "cpu") -> tuple[int, Any]:
    """Run ``fn()`` and return (peak bytes allocated above the start, fn's result).

    CUDA: ``torch.cuda.max_memory_allocated``. CPU has no allocator statistics, so every
    allocation and free the profiler records (allocator level, all threads) is replayed instead.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, result
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return peak, result
