"""The ordered passes for each kind of graph; runs each under an observer and verifies after it."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch.distributed as dist
import torch.fx as fx

from .._torch.tracing import trace_structured
from .context import PassContext
from .passes import (
    assign_buckets,
    dedupe_gathers,
    handoff_gathers,
    hoist_shard_reads,
    insert_guard,
    lower_gathers,
    lower_reductions,
    prefetch_gathers,
    prefetch_reloads,
    recompute_region_saves,
    refuse_param_writes,
    serialize_collectives,
    tag_recompute,
    verify,
)

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], None]

DYNAMO_PASSES: tuple[Pass, ...] = (refuse_param_writes, hoist_shard_reads, dedupe_gathers)
JOINT_PASSES: tuple[Pass, ...] = (recompute_region_saves, dedupe_gathers, tag_recompute)
FORWARD_PASSES: tuple[Pass, ...] = (
    assign_buckets,
    lower_gathers,
    prefetch_gathers,
    prefetch_reloads,
    handoff_gathers,
    serialize_collectives,
    insert_guard,
)
BACKWARD_PASSES: tuple[Pass, ...] = (
    assign_buckets,
    lower_gathers,
    prefetch_gathers,
    prefetch_reloads,
    lower_reductions,
    handoff_gathers,
    serialize_collectives,
    insert_guard,
)

_PASSES_BY_KIND = {
    "dynamo": DYNAMO_PASSES,
    "joint": JOINT_PASSES,
    "forward": FORWARD_PASSES,
    "inference": FORWARD_PASSES,
    "backward": BACKWARD_PASSES,
}
_SCHEDULED = ("forward", "inference", "backward")


def passes_for(graph_kind: str) -> tuple[Pass, ...]:
    return _PASSES_BY_KIND[graph_kind]


def run_pipeline(
    gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] | None = None
) -> None:
    """Run ``passes`` (default: those of ``ctx.graph_kind``) on ``gm`` in place."""
    passes = passes_for(ctx.graph_kind) if passes is None else passes
    rank = dist.get_rank() if dist.is_initialized() else 0
    dump = Dumper(ctx, rank)
    dump.write("00_input", gm)
    for step, graph_pass in enumerate(passes, start=1):
        before = _op_counts(gm.graph)
        start = time.perf_counter()
        graph_pass(gm, ctx)
        elapsed = time.perf_counter() - start
        if ctx.options.verify and ctx.graph_kind in _SCHEDULED:
            verify(gm, ctx)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "[rank %d] zero3: %s graph %s: %s took %.1f ms, ops %s",
                rank,
                ctx.graph_kind,
                ctx.graph_id,
                graph_pass.__name__,
                elapsed * 1e3,
                _diff(before, _op_counts(gm.graph)),
            )
        dump.write(f"{step:02d}_{graph_pass.__name__}", gm)
    if ctx.options.verify and ctx.graph_kind in _SCHEDULED:
        verify(gm, ctx, lowered=True, guarded=insert_guard in passes)
    gm.recompile()  # once: no pass reads the generated code, and the dumps print the graph


def _op_counts(graph: fx.Graph) -> Counter:
    return Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def _diff(before: Counter, after: Counter) -> str:
    changes = []
    for op in sorted(set(before) | set(after)):
        delta = after[op] - before[op]
        if delta:
            changes.append(f"{op.split('.')[-2] if '.' in op else op}{delta:+d}")
    return ", ".join(changes) or "unchanged"


class Dumper:
    """Every graph before and after every pass: ``trace_structured`` artifacts (tlparse), and
    readable files under ``dump_dir`` (or ``$ZERO3_DUMP_DIR``) when set."""

    def __init__(self, ctx: PassContext, rank: int):
        root = ctx.options.dump_dir or os.environ.get("ZERO3_DUMP_DIR")
        name = f"graph{ctx.graph_id}_{ctx.graph_kind}"
        self.label = f"zero3_{name}"
        self.folder = os.path.join(root, f"rank{rank}", name) if root else None

    def write(self, name: str, gm: fx.GraphModule) -> None:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"{self.label}_{name}", "encoding": "string"},
            payload_fn=lambda: gm.print_readable(print_output=False),
        )
        if self.folder is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{name}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))

    def write_text(self, name: str, text: Callable[[], str]) -> None:
        """Like ``write`` for text made by ``text()``, called only if something will be written."""
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"{self.label}_{name}", "encoding": "string"},
            payload_fn=text,
        )
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, name), "w") as f:
                f.write(text())
