"""Graph passes, one module each. Every pass is ``fn(gm, ctx: PassContext) -> None``, mutates in
place and states its invariant in its docstring; ``compiler/pipeline.py`` declares their order
(``PIPELINE``), stage by stage:

pre-dynamo (dynamo graph):    lift_region_gathers, bind_markers
dynamo (dynamo graph):        refuse_param_writes, hoist_shard_reads, dedupe_gathers,
                              rewrite_to_local (torch 2.11)
joint (joint graph):          recompute_region_saves, dedupe_gathers, tag_recompute
memory budget (joint graph):  plan_memory_budget
partition (joint graph):      min_cut_partition, order_saved_values, save_waited,
                              check_no_gathered_saved, keep_secondary_shards
forward / backward graphs:    assign_buckets, lower_gathers, prefetch_gathers,
                              prefetch_reloads, lower_reductions (backward only),
                              handoff_gathers (with cross_graph_prefetch),
                              serialize_collectives, insert_guard
post-codegen (generated code): check_generated_order
"""

from .bind import bind_markers
from .bucketing import assign_buckets
from .dedupe import dedupe_gathers
from .generated_order import check_generated_order
from .handoff import handoff_gathers
from .hoist_reads import hoist_shard_reads
from .insert_guard import insert_guard
from .local_reads import rewrite_to_local
from .lower_gathers import lower_gathers
from .lower_reductions import lower_reductions
from .param_writes import refuse_param_writes
from .partition import (
    check_no_gathered_saved,
    keep_secondary_shards,
    min_cut_partition,
    order_saved_values,
    plan_memory_budget,
    save_waited,
)
from .prefetch import prefetch_gathers, prefetch_reloads
from .recompute import tag_recompute
from .regions import lift_region_gathers, recompute_region_saves
from .serialize import serialize_collectives
from .verify import verify

__all__ = [
    "assign_buckets",
    "bind_markers",
    "check_generated_order",
    "check_no_gathered_saved",
    "dedupe_gathers",
    "handoff_gathers",
    "hoist_shard_reads",
    "insert_guard",
    "keep_secondary_shards",
    "lift_region_gathers",
    "lower_gathers",
    "lower_reductions",
    "min_cut_partition",
    "order_saved_values",
    "plan_memory_budget",
    "prefetch_gathers",
    "prefetch_reloads",
    "recompute_region_saves",
    "refuse_param_writes",
    "rewrite_to_local",
    "save_waited",
    "serialize_collectives",
    "tag_recompute",
    "verify",
]
