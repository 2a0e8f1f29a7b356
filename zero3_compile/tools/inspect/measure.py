"""Measuring a real run, to check the estimates against: the peak of allocated bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._torch.tracing import profiler_allocation_tag


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
    from torch.profiler import ProfilerActivity, profile

    allocation = profiler_allocation_tag()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return peak, result
