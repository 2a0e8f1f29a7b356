"""Graph passes, one module each. Every pass is ``fn(gm, ctx: PassContext) -> None`` and
mutates in place.

Dynamo graph (before AOTAutograd): (lift_region_gathers, before binding) refuse_param_writes, hoist_shard_reads, dedupe_gathers
Joint graph (before partitioning):  recompute_region_saves, dedupe_gathers, tag_recompute
Forward / backward graphs:          assign_buckets, lower_gathers, prefetch_gathers,
                                    prefetch_reloads, lower_reductions (backward only),
                                    handoff_gathers (with cross_graph_prefetch),
                                    serialize_collectives, insert_guard
"""

from .bucketing import assign_buckets
from .dedupe import dedupe_gathers
from .handoff import handoff_gathers
from .hoist_reads import hoist_shard_reads
from .insert_guard import insert_guard
from .lower_gathers import lower_gathers
from .lower_reductions import lower_reductions
from .param_writes import refuse_param_writes
from .prefetch import prefetch_gathers, prefetch_reloads
from .recompute import tag_recompute
from .regions import lift_region_gathers, recompute_region_saves
from .serialize import serialize_collectives
from .verify import check_no_gathered_saved, verify

__all__ = [
    "assign_buckets",
    "check_no_gathered_saved",
    "dedupe_gathers",
    "handoff_gathers",
    "hoist_shard_reads",
    "insert_guard",
    "lower_gathers",
    "lift_region_gathers",
    "lower_reductions",
    "prefetch_gathers",
    "prefetch_reloads",
    "recompute_region_saves",
    "refuse_param_writes",
    "serialize_collectives",
    "tag_recompute",
    "verify",
]
