"""Every compile stage, in order: each stage's passes, run under an observer, verified.

One declared list, ``PIPELINE``, read top to bottom; each pass has the one signature
``fn(gm, ctx: PassContext) -> None`` and states its invariant in its docstring:

```
dynamo graph       pre-dynamo     lift_region_gathers, bind_markers
                   dynamo         refuse_param_writes, hoist_shard_reads, dedupe_gathers,
                                  rewrite_to_local (torch 2.11)
  -> AOTAutograd
joint graph        joint          recompute_region_saves, dedupe_gathers, tag_recompute
                   memory budget  plan_memory_budget
                   partition      min_cut_partition, order_saved_values, save_waited,
                                  check_no_gathered_saved, keep_secondary_shards
forward graph      forward        assign_buckets, lower_gathers, prefetch_gathers,
 (and inference)                  prefetch_reloads, handoff_gathers, serialize_collectives,
                                  insert_guard
backward graph     backward       assign_buckets, lower_gathers, prefetch_gathers,
                                  prefetch_reloads, lower_reductions, handoff_gathers,
                                  serialize_collectives, insert_guard
  -> codegen
generated code     post-codegen   check_generated_order (Inductor)
```
The backend (``backend.py``) calls ``run_pipeline`` once per graph it is handed; the passes of
the partition stage read and build ``ctx.partition`` (the joint graph's forward and backward),
the post-codegen one reads ``ctx.generated``. The forward and backward stages are checked by
``verify`` after every pass; every stage's graphs are dumped after every pass (``Dumper``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist
import torch.fx as fx

from .._torch.tracing import trace_structured
from .context import PassContext
from .passes import (
    assign_buckets,
    bind_markers,
    check_generated_order,
    check_no_gathered_saved,
    dedupe_gathers,
    handoff_gathers,
    hoist_shard_reads,
    insert_guard,
    keep_secondary_shards,
    lift_region_gathers,
    lower_gathers,
    lower_reductions,
    min_cut_partition,
    order_saved_values,
    plan_memory_budget,
    prefetch_gathers,
    prefetch_reloads,
    recompute_region_saves,
    refuse_param_writes,
    rewrite_to_local,
    save_waited,
    serialize_collectives,
    tag_recompute,
    verify,
)
from .recording import timed

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], None]


@dataclass(frozen=True)
class Stage:
    """A named, ordered group of passes over one graph of the compile."""

    name: str
    # the graph its passes are handed: "dynamo", "joint", "forward" (forward and inference
    # graphs), "backward", or "generated" (a scheduled graph after codegen, ``ctx.generated``)
    graph: str
    passes: tuple[Pass, ...]
    phase: str | None = None  # the ``recording.compile_stats`` phase its time adds to
    verified: bool = False  # ``verify`` after each pass (option ``verify``), lowered at the end


PIPELINE: tuple[Stage, ...] = (
    Stage(
        "pre-dynamo",
        "dynamo",
        (lift_region_gathers, bind_markers),
        phase="dynamo graph passes",
    ),
    Stage(
        "dynamo",
        "dynamo",
        (refuse_param_writes, hoist_shard_reads, dedupe_gathers, rewrite_to_local),
        phase="dynamo graph passes",
    ),
    Stage(
        "joint",
        "joint",
        (recompute_region_saves, dedupe_gathers, tag_recompute),
        phase="joint graph passes",
    ),
    Stage("memory budget", "joint", (plan_memory_budget,), phase="memory budget planner"),
    Stage(
        "partition",
        "joint",
        (
            min_cut_partition,
            order_saved_values,
            save_waited,
            check_no_gathered_saved,
            keep_secondary_shards,
        ),
        phase="partitioner (min-cut)",
    ),
    Stage(
        "forward",
        "forward",
        (
            assign_buckets,
            lower_gathers,
            prefetch_gathers,
            prefetch_reloads,
            handoff_gathers,
            serialize_collectives,
            insert_guard,
        ),
        phase="forward/backward graph passes",
        verified=True,
    ),
    Stage(
        "backward",
        "backward",
        (
            assign_buckets,
            lower_gathers,
            prefetch_gathers,
            prefetch_reloads,
            lower_reductions,
            handoff_gathers,
            serialize_collectives,
            insert_guard,
        ),
        phase="forward/backward graph passes",
        verified=True,
    ),
    Stage("post-codegen", "generated", (check_generated_order,)),
)

_SCHEDULED = ("forward", "inference", "backward")


def stages_for(graph: str) -> tuple[Stage, ...]:
    """The stages of ``PIPELINE`` run on ``graph`` (a graph kind, or "generated"), in order."""
    graph = "forward" if graph == "inference" else graph
    return tuple(stage for stage in PIPELINE if stage.graph == graph)


def stage_named(name: str) -> Stage:
    """The stage of ``PIPELINE`` called ``name``."""
    return next(s for s in PIPELINE if s.name == name)


def passes_for(graph: str) -> tuple[Pass, ...]:
    """Every pass run on ``graph``, in order, over its stages."""
    return tuple(p for s in stages_for(graph) for p in s.passes)


def describe_pipeline() -> str:
    """The declared pipeline as text: each stage, its graph, and each pass's summary.

    Example:
        ```python
        from zero3_compile.compiler.pipeline import describe_pipeline

        print(describe_pipeline())  # "pre-dynamo (dynamo graph):\n  lift_region_gathers: ..."
        ```
    """
    lines = []
    for s in PIPELINE:
        lines.append(f"{s.name} ({s.graph} graph){', verified' if s.verified else ''}:")
        for graph_pass in s.passes:
            summary = " ".join((graph_pass.__doc__ or "").strip().split("\n\n")[0].split())
            lines.append(f"  {graph_pass.__name__}: {summary}")
    return "\n".join(lines)


def run_pipeline(
    gm: fx.GraphModule,
    ctx: PassContext,
    passes: Sequence[Pass] | None = None,
    *,
    graph: str | None = None,
) -> None:
    """Run the stages of ``graph`` (default: ``ctx.graph_kind``) on ``gm`` in place, in order,
    each timed; or only ``passes``, untimed (the memory budget's trial schedules)."""
    if passes is None:
        stages = stages_for(graph or ctx.graph_kind)
    else:
        verified = ctx.graph_kind in _SCHEDULED
        stages = (Stage("passes", ctx.graph_kind, tuple(passes), verified=verified),)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dump = Dumper(ctx, rank)
    if stages and stages[0].graph != "generated":
        dump.write("00_input", gm)
    step = 0
    for current in stages:
        with timed(current.phase) if current.phase else contextlib.nullcontext():
            step = _run_stage(current, gm, ctx, dump, step, rank)


def _run_stage(
    stage: Stage, gm: fx.GraphModule, ctx: PassContext, dump: Dumper, step: int, rank: int
) -> int:
    rewrites = stage.graph != "generated"
    verifying = stage.verified and ctx.options.verify
    debug = log.isEnabledFor(logging.DEBUG)
    for graph_pass in stage.passes:
        step += 1
        before = _op_counts(_shown(gm, ctx)) if debug else None
        start = time.perf_counter()
        graph_pass(gm, ctx)
        elapsed = time.perf_counter() - start
        if verifying:
            verify(gm, ctx)
        if debug:
            log.debug(
                "[rank %d] zero3: %s graph %s, %s stage: %s took %.1f ms, ops %s",
                rank,
                ctx.graph_kind,
                ctx.graph_id,
                stage.name,
                graph_pass.__name__,
                elapsed * 1e3,
                _diff(before, _op_counts(_shown(gm, ctx))),
            )
        if rewrites:
            for suffix, shown in _shown(gm, ctx):
                dump.write(f"{step:02d}_{graph_pass.__name__}{suffix}", shown)
    if verifying:
        verify(gm, ctx, lowered=True, guarded=insert_guard in stage.passes)
    if rewrites and _shown(gm, ctx)[0][1] is gm:  # a cut joint graph is done with
        gm.recompile()  # once a stage: no pass reads the generated code, the dumps print the graph
    return step


def _shown(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[str, fx.GraphModule]]:
    """The graphs a pass on ``gm`` has produced: the partition's, once the joint graph is cut."""
    partition = ctx.partition
    if partition is not None and partition.forward is not None:
        return [("_forward", partition.forward), ("_backward", partition.backward)]
    return [("", gm)]


def _op_counts(shown: list[tuple[str, fx.GraphModule]]) -> Counter:
    return Counter(
        str(n.target) for _, gm in shown for n in gm.graph.nodes if n.op == "call_function"
    )


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
