"""Measuring a real run, to check the estimates against: the peak of allocated bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._torch.tracing import cpu_allocations


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

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    current = peak = 0
    for _, size in sorted(cpu_allocations(prof)):
        current += size
        peak = max(peak, current)
    return peak, result
