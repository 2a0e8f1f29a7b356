"""The memory budget: keep parameters gathered from forward to backward while memory allows.

``torch.compile(model, backend="zero3", options={"memory_budget_mb": 20_000})``: per rank, the
bytes a training step may hold at its peak: the persistent state (parameter and gradient
shards, and ``optimizer_states`` tensors of optimizer state per trainable parameter, 2 for Adam)
plus the step's transient memory (activations, gathered parameters, collective buffers), as the
inspection tools estimate it from the scheduled graphs.

The planner starts from pure ZeRO-3 (every parameter gathered in forward and again in backward)
and spends the headroom on parameters kept gathered from their forward use to their backward
use: one all-gather less each per step (at the whole budget: ZeRO-2's and DDP's 2 psi of traffic
instead of ZeRO-3's 3 psi). A kept parameter holds its full size across the forward/backward
boundary, where the step peaks, so every byte kept costs a byte of peak; the parameters used
last in forward are kept first (they are held for the shortest time). The plan is checked by
estimating the planned schedule again, and trimmed until it fits. It depends only on the graph
and the options: the same on every rank.

A budget below the least estimate (pure ZeRO-3's, or keeping everything's, which can be lower:
backward's re-gathers go away too) raises an error stating that minimum.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .._torch.c10d import backend_of
from ..collectives.ops import REDUCE_GRAD, UNSHARD
from .context import Partition, PassContext
from .graph_facts import shard_inputs
from .graph_utils import copy_graph_module
from .markers import ReduceGradCall, UnshardCall
from .memory import memory_timeline

log = logging.getLogger(__name__)

MiB = 2**20


class BudgetError(ValueError):
    """The memory budget is below what pure ZeRO-3 needs."""

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#budgeterror)"


@dataclass
class KeptParam:
    name: str
    nbytes: int
    last_forward_use: int  # position in the joint graph of its last forward use

    def why(self) -> str:
        return (
            f"{self.name} ({self.nbytes / MiB:.2f} MiB): kept gathered from forward to backward, "
            "saving its backward all-gather"
        )


@dataclass
class BudgetPlan:
    budget: int
    persistent: int  # parameter + gradient shards + optimizer state (estimated)
    minimum: int  # the least estimate seen: pure ZeRO-3's, everything kept's, the plan's
    estimated: int  # persistent + the planned schedule's step peak
    kept: list[KeptParam] = field(default_factory=list)  # in the order they were chosen
    candidates: int = 0
    # the estimate with one more parameter kept (None: every parameter is kept)
    next_estimate: int | None = None
    estimates: int = 0  # schedules estimated to find the plan

    @property
    def kept_names(self) -> frozenset[str]:
        return frozenset(k.name for k in self.kept)

    @property
    def kept_bytes(self) -> int:
        return sum(k.nbytes for k in self.kept)

    def describe(self) -> str:
        text = (
            f"memory budget {self.budget / MiB:.1f} MiB per rank: the graph needs at least "
            f"{self.minimum / MiB:.1f} MiB (persistent state {self.persistent / MiB:.1f} MiB + "
            f"step peak), the plan {self.estimated / MiB:.1f} MiB, keeping {len(self.kept)} of "
            f"{self.candidates} parameters gathered from forward to backward "
            f"({self.kept_bytes / MiB:.1f} MiB; each saves its backward all-gather)"
        )
        if self.next_estimate is not None:
            text += (
                f"; keeping one more would need {self.next_estimate / MiB:.1f} MiB, over the budget"
            )
        return text

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_budget(joint: fx.GraphModule, joint_inputs, kwargs, ctx: PassContext) -> BudgetPlan:
    """Choose the markers to keep gathered; tag them ``MUST_SAVE`` in ``joint``.

    Candidates are ordered by their last forward use, latest first (a parameter used late in
    forward is held the shortest time across the boundary), and the plan keeps the longest prefix
    of that order whose estimated peak fits. The peak grows with the prefix (nearly always), so a
    binary search over its length finds it in O(log n) estimates; whatever it returns was
    estimated to fit.
    """
    budget = ctx.options.memory_budget_bytes
    markers = [n for n in joint.graph.nodes if n.target is UNSHARD]
    order = {node: i for i, node in enumerate(joint.graph.nodes)}
    boundary = _first_backward_position(joint, order)

    def last_forward_use(marker: fx.Node) -> int:
        uses = [order[u] for u in marker.users if order[u] < boundary]
        return max(uses, default=order[marker])

    candidates = sorted(markers, key=lambda m: (-last_forward_use(m), order[m]))
    persistent = _persistent_bytes(joint, ctx)

    def estimate(count: int) -> int:
        plan.estimates += 1
        keep = {id(m) for m in candidates[:count]}
        return persistent + estimate_step_peak(joint, joint_inputs, kwargs, ctx, keep)

    plan = BudgetPlan(budget, persistent, 0, 0, candidates=len(candidates))
    pure = estimate(0)
    everything = estimate(len(candidates)) if candidates else pure
    # keeping can cost nothing (backward's re-gathers and their prefetch buffers go away too)
    plan.minimum = min(pure, everything)
    if budget < plan.minimum:
        raise BudgetError(
            f"zero3: memory_budget_mb={budget / MiB:.1f} is below what this graph needs under "
            f"ZeRO-3: about {plan.minimum / MiB:.1f} MiB per rank (parameter, gradient and "
            f"optimizer state {persistent / MiB:.1f} MiB plus the step's peak). Raise the budget "
            f"to at least {math.ceil(plan.minimum / MiB)}, or leave memory_budget_mb unset."
        )
    # the longest prefix known to fit, and the shortest known not to (None: none exceeds)
    fits, fits_estimate = 0, pure
    over, over_estimate = len(candidates) + 1, None
    if everything <= budget:
        fits, fits_estimate = len(candidates), everything
    else:
        over, over_estimate = len(candidates), everything
    while over - fits > 1:
        middle = (fits + over) // 2
        value = estimate(middle)
        if value <= budget:
            fits, fits_estimate = middle, value
        else:
            over, over_estimate = middle, value
    chosen = candidates[:fits]
    plan.estimated = fits_estimate
    # keeping a few can lower the peak below both ends (with one gloo collective in flight,
    # the re-gathers they save carried temporaries at backward's peak): the least one seen
    plan.minimum = min(plan.minimum, fits_estimate)
    plan.next_estimate = over_estimate
    plan.kept = [
        KeptParam(UnshardCall.of(m).spec.fqn, _nbytes(m), last_forward_use(m)) for m in chosen
    ]
    for marker in chosen:
        marker.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    log.info("zero3: %s", plan.describe())
    return plan


def _first_backward_position(joint: fx.GraphModule, order: dict[fx.Node, int]) -> int:
    """Where backward starts in the joint graph: the first node reading a tangent."""
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and "tangent" in n.name]
    readers = [order[u] for t in tangents for u in t.users]
    return min(readers, default=len(order))


def estimate_step_peak(joint, joint_inputs, kwargs, ctx: PassContext, keep: set[int]) -> int:
    """The step's transient peak for a schedule that keeps the markers ``keep`` gathered:
    partition a copy of the joint graph, schedule copies of its graphs, read their liveness.
    The pipeline's own partition, forward and backward stages, less the partition check (the
    copy's kept markers are not the plan's yet) and the cross-rank guard."""
    from .passes import check_no_gathered_saved, insert_guard
    from .pipeline import passes_for, run_pipeline, stage_named

    copy, mapping = copy_graph_module(joint)
    for node, original in mapping.items():
        if original.target is UNSHARD and id(original) in keep:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    quiet = dataclasses.replace(ctx.options, verify=False, dump_dir=None)
    partition = Partition(joint_inputs, kwargs)
    partitioning = [p for p in stage_named("partition").passes if p is not check_no_gathered_saved]
    run_pipeline(
        copy, PassContext(options=quiet, graph_kind="joint", partition=partition), partitioning
    )
    fw, bw = partition.forward, partition.backward
    scheduling = [p for p in passes_for("forward") if p is not insert_guard]
    run_pipeline(fw, PassContext(options=quiet, graph_kind="forward"), scheduling)
    scheduling = [p for p in passes_for("backward") if p is not insert_guard]
    run_pipeline(bw, PassContext(options=quiet, graph_kind="backward"), scheduling)
    gloo = _uses_gloo(fw) or _uses_gloo(bw)
    forward = memory_timeline(fw, gloo_temporaries=gloo)
    backward = memory_timeline(bw, inputs_die=True, gloo_temporaries=gloo)
    return max(forward.peak_bytes, forward.end_bytes + backward.peak_bytes)


def _nbytes(marker: fx.Node) -> int:
    val = marker.meta.get("val")
    return val.numel() * val.element_size() if val is not None else 0


def _persistent_bytes(joint: fx.GraphModule, ctx: PassContext) -> int:
    shards = shard_inputs(joint.graph)
    shard_bytes = sum(_nbytes(s) for s in shards)
    trainable = 0
    for node in joint.graph.nodes:
        if node.target is REDUCE_GRAD:
            call = ReduceGradCall.of(node)
            numel = 1
            for size in call.shard_shape:
                numel *= size
            trainable += numel * call.shard_dtype.itemsize
    return shard_bytes + trainable * (1 + ctx.options.optimizer_states)


def _uses_gloo(gm: fx.GraphModule) -> bool:
    from .._torch.c10d import COLLECTIVES

    for node in gm.graph.nodes:
        if node.target in COLLECTIVES:
            return backend_of(str(node.args[-1])) == "gloo"
    return False
