"""Structured logs and profiler events."""

from __future__ import annotations

import functools


def trace_structured(*args, **kwargs) -> None:
    """``torch._logging.trace_structured`` (private; what tlparse reads), 2.11-2.14."""
    from torch._logging import trace_structured as trace

    trace(*args, **kwargs)


@functools.cache
def profiler_allocation_tag():
    """The profiler's allocation event tag (private ``torch._C._profiler._EventType``)."""
    from torch._C._profiler import _EventType

    return _EventType.Allocation
