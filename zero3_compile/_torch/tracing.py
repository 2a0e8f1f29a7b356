"""Structured logs and profiler events."""

from __future__ import annotations

import functools


def trace_structured(*args, **kwargs) -> None:
    """``torch._logging.trace_structured`` (private; what tlparse reads), 2.11-2.14."""
    from torch._logging import trace_structured as trace

    trace(*args, **kwargs)


def cpu_allocations(prof) -> list[tuple[int, int]]:
    """(start ns, bytes: negative for a free) of every CPU allocation and free a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, read from its event tree (private
    ``prof.profiler.kineto_results.experimental_event_tree()``, events with ``tag``,
    ``extra_fields.device`` and ``extra_fields.alloc_size``), 2.11-2.14."""
    allocation = profiler_allocation_tag()
    found: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == allocation and event.extra_fields.device.type == "cpu":
            found.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    return found


@functools.cache
def profiler_allocation_tag():
    """The profiler's allocation event tag (private ``torch._C._profiler._EventType``)."""
    from torch._C._profiler import _EventType

    return _EventType.Allocation
