"""Graph passes, one module each. Every pass is ``fn(gm, plan) -> None`` and mutates in place.

Joint graph (before partitioning):  dedupe_gathers, tag_recompute
Forward / backward graphs:          assign_buckets, lower_gathers, prefetch_gathers,
                                    lower_reductions (backward only)
"""

from .bucketing import assign_buckets
from .dedupe import dedupe_gathers
from .lower_gathers import lower_gathers
from .lower_reductions import lower_reductions
from .prefetch import prefetch_gathers
from .recompute import tag_recompute
from .verify import verify

__all__ = [
    "assign_buckets",
    "dedupe_gathers",
    "lower_gathers",
    "lower_reductions",
    "prefetch_gathers",
    "tag_recompute",
    "verify",
]
