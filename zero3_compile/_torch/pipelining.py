"""``torch.distributed.pipelining`` internals."""

from __future__ import annotations


def split_backward_types() -> frozenset:
    """The action types of a pipeline schedule's input-only and weight-only backwards (private
    ``schedules._ComputationType``; no public alternative), 2.11-2.14."""
    from torch.distributed.pipelining.schedules import _ComputationType

    return frozenset({_ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT})
