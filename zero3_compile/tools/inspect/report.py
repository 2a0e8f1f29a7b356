"""What the compiler did to one graph, read from the scheduled graph: a ``GraphReport``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
import torch.fx as fx

from ..._torch.c10d import ALL_GATHER, COLLECTIVES, REDUCE_SCATTER, WAIT, resolve_group
from ...collectives.copy_ops import SECONDARY_SLICE
from ...compiler.buckets import name_map, records
from ...compiler.graph_facts import gathered_values, is_view
from ...compiler.memory import memory_timeline
from ...compiler.node_keys import (
    FULL_BYTES,
    GROUP_ROLE,
    ROLE,
    ROLE_GATHER_COPY_OUT,
    ROLE_REDUCE_COPY_IN,
    ROLE_REDUCE_SCATTER,
    ROLE_RELOAD,
    ROLE_REPLICA_ALL_REDUCE,
)
from ...compiler.recording import GraphRecord
from ...sharding.layout import foreign_group_role
from ...sharding.mesh import group_backend


@dataclass
class GatherInfo:
    """One all-gather bucket. Positions are node indices in the scheduled graph."""

    bucket: int
    params: list[str]
    bytes: int  # gathered (full, padded) bytes
    issue: int  # the all_gather node
    wait: int  # its wait_tensor
    first_use: int  # first node reading the gathered parameters (after copy-out)
    release: int  # last node reading them: the buffer is freed right after it
    compute_ahead: int  # compute nodes between issue and wait: how much the gather can overlap
    buckets_ahead: int = 0  # buckets first used while it is in flight: the prefetch distance
    full_bytes: int = 0  # ``bytes`` uncompressed (equal to it when not compressed)
    # compressed: this rank's part of what the first step sends, quantized and back
    # ({"max_relative": max |error| / max |value|, "mean_relative": mean |error| / mean |value|})
    quantization_error: dict | None = None


@dataclass
class ReduceInfo:
    bucket: int
    params: list[str]
    bytes: int  # full (padded) gradient bytes reduced
    ready: int  # the last gradient of the bucket is computed here
    issue: int  # the reduce_scatter node
    wait: int  # its wait_tensor
    compute_overlapped: int  # compute nodes between issue and wait
    full_bytes: int = 0  # ``bytes`` uncompressed (equal to it when not compressed)
    # compressed: this rank's reduced gradient shards of the first step against the same step
    # reduced exactly ({"max_relative": max |error| / max |exact|, "mean_relative": mean |error|
    # / mean |exact|})
    quantization_error: dict | None = None


@dataclass
class ReloadInfo:
    """The read of an offloaded shard from its store (``shard(offload=...)``)."""

    bucket: int  # the all-gather bucket it feeds
    bytes: int
    issue: int  # the reload node
    wait: int  # its wait_tensor, right before the copy-in
    compute_overlapped: int  # compute nodes between issue and wait


@dataclass
class SavedTensor:
    name: str
    shape: list[int]
    dtype: str
    bytes: int
    secondary: bool = False  # a secondary shard (hpZ), re-gathered within the node by backward


@dataclass
class GraphReport:
    kind: str
    graph_id: str
    num_nodes: int
    gathers: list[GatherInfo] = field(default_factory=list)
    reductions: list[ReduceInfo] = field(default_factory=list)
    reloads: list[ReloadInfo] = field(default_factory=list)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> count, bytes
    # group role ("shard", "replicate"; a foreign collective's group name) -> kind -> bytes
    group_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    group_full_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # uncompressed
    memory: list[int] = field(default_factory=list)  # bytes alive above the start, per node
    peak_bytes: int = 0
    peak_node: str = ""
    end_bytes: int = 0  # bytes the graph created that outlive it (outputs, saved tensors)
    saved: list[SavedTensor] = field(default_factory=list)
    node_kinds: list[str] = field(default_factory=list)  # "compute" or a communication role
    # the memory budget's plan (forward graphs compiled with ``memory_budget_mb``): budget,
    # minimum, estimated, persistent bytes, kept parameters ({name, nbytes, last_forward_use})
    budget: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"== {self.kind} graph {self.graph_id}: {self.num_nodes} nodes, "
            f"estimated peak {self.peak_bytes / mib:.2f} MiB at {self.peak_node}",
        ]
        for kind, stats in sorted(self.collectives.items()):
            line = f"   {kind}: {stats['count']} collective(s), {stats['bytes'] / mib:.3f} MiB"
            if stats.get("full_bytes", stats["bytes"]) != stats["bytes"]:
                line += f" compressed from {stats['full_bytes'] / mib:.3f} MiB"
            lines.append(line)
        if len(self.group_bytes) > 1:
            for group, kinds in sorted(self.group_bytes.items()):
                full = self.group_full_bytes.get(group, {})
                text = ", ".join(
                    f"{k} {v / mib:.3f} MiB"
                    + (f" ({full[k] / mib:.3f} uncompressed)" if full.get(k, v) != v else "")
                    for k, v in sorted(kinds.items())
                )
                lines.append(f"   group {group}: {text}")
        if self.gathers:
            lines.append(
                "   all-gather  bucket  params  MiB      issue  wait  first use  release  ahead(nodes/buckets)"
            )
            for g in self.gathers:
                lines.append(
                    f"               {g.bucket:>5}  {len(g.params):>6}  {g.bytes / mib:7.3f}  {g.issue:>5}  "
                    f"{g.wait:>4}  {g.first_use:>9}  {g.release:>7}  {g.compute_ahead:>5}/{g.buckets_ahead}"
                    f"   {_names(g.params)}"
                )
        _error_line(lines, "int8 all-gathers, this rank's first step", self.gathers)
        if self.reductions:
            lines.append(
                "   reduce-scatter  bucket  params  MiB      ready  issue  wait  overlapped nodes"
            )
            for r in self.reductions:
                lines.append(
                    f"                   {r.bucket:>5}  {len(r.params):>6}  {r.bytes / mib:7.3f}  {r.ready:>5}  "
                    f"{r.issue:>5}  {r.wait:>4}  {r.compute_overlapped:>16}   {_names(r.params)}"
                )
        what = "quantized gradient reductions, this rank's first step against an exact one"
        _error_line(lines, what, self.reductions)
        if self.reloads:
            lines.append(
                f"   reloads of offloaded shards: {len(self.reloads)}, "
                f"{sum(r.bytes for r in self.reloads) / mib:.3f} MiB; issued "
                f"{min(r.compute_overlapped for r in self.reloads)}-"
                f"{max(r.compute_overlapped for r in self.reloads)} compute nodes before their wait"
            )
        if self.kind == "forward":
            total = sum(s.bytes for s in self.saved)
            line = f"   saved for backward: {len(self.saved)} tensors, {total / mib:.3f} MiB"
            secondary = [s for s in self.saved if s.secondary]
            if secondary:
                line += (
                    f", of which {len(secondary)} secondary shards (hpZ) "
                    f"{sum(s.bytes for s in secondary) / mib:.3f} MiB"
                )
            lines.append(line)
        if self.budget is not None:
            lines.append("   " + budget_summary(self.budget))
            for kept in self.budget["kept"]:
                lines.append(
                    f"     {kept['name']} ({kept['nbytes'] / mib:.3f} MiB, last used in forward "
                    f"at joint node {kept['last_forward_use']}): kept gathered for backward, "
                    "one all-gather less"
                )
        return "\n".join(lines)


def budget_summary(plan: dict) -> str:
    """One line on a memory budget's plan (``planner.BudgetPlan.to_dict()``)."""
    mib = 2**20
    kept = plan["kept"]
    text = (
        f"memory budget {plan['budget'] / mib:.1f} MiB: estimated {plan['estimated'] / mib:.1f} "
        f"MiB (pure ZeRO-3 {plan['minimum'] / mib:.1f} MiB, of which persistent state "
        f"{plan['persistent'] / mib:.1f} MiB); {len(kept)} of {plan['candidates']} parameters "
        f"kept gathered from forward to backward ({sum(k['nbytes'] for k in kept) / mib:.2f} MiB)"
    )
    if plan.get("next_estimate") is not None:
        text += f"; one more would need {plan['next_estimate'] / mib:.1f} MiB"
    return text


def _names(params: list[str], limit: int = 3) -> str:
    shown = ", ".join(params[:limit])
    return shown + (f", ... (+{len(params) - limit})" if len(params) > limit else "")


def _error_line(lines: list[str], what: str, buckets: list) -> None:
    """One line summing the buckets' ``quantization_error`` (when any has one)."""
    errors = [b.quantization_error for b in buckets if b.quantization_error]
    if errors:
        lines.append(
            f"   {what}: relative error max {max(e['max_relative'] for e in errors):.2e}, mean "
            f"{sum(e['mean_relative'] for e in errors) / len(errors):.2e} over "
            f"{len(errors)} bucket(s)"
        )


def _nbytes(val) -> int:
    """Bytes of a value; a symbolic size (a saved RNG state's) counts at its hint."""
    if not isinstance(val, torch.Tensor):
        return 0
    return _concrete(val.numel()) * val.element_size()


def _concrete(size) -> int:
    if isinstance(size, int):
        return size
    try:
        return int(size.node.hint) if size.node.hint is not None else 0
    except AttributeError:
        return 0


def _plain_shape(val) -> list:
    """A shape the report can hold (and copy, and write as JSON): ints, and a symbolic size as
    its expression."""
    return [d if isinstance(d, int) else str(d) for d in val.shape]


def _collective_kind(node: fx.Node) -> str:
    """How the reports count a collective: by the step of a scheme it is, else by its op."""
    role = node.meta.get(ROLE)
    if role == ROLE_REDUCE_SCATTER:
        return "reduce_scatter"  # also an all-to-all (qgZ) or an all-reduce (gloo, torch 2.14)
    if role == ROLE_REPLICA_ALL_REDUCE:
        return "all_reduce"  # also qgZ's all-to-all and all-gather across replicas
    return {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}.get(
        node.target, "all_reduce"
    )


def _collective_bytes(node: fx.Node) -> int:
    """A collective's bytes: an all-gather's output, any other's input."""
    return _nbytes(node.meta["val"] if node.target is ALL_GATHER else node.args[0].meta["val"])


def build_report(record: GraphRecord) -> GraphReport:
    """Everything a user wants to know about one scheduled graph."""
    gm = record.gm
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    kinds = [n.meta.get(ROLE, "compute") if n.op == "call_function" else n.op for n in nodes]
    compute = [
        k == "compute" and n.op == "call_function" and not is_view(n) for k, n in zip(kinds, nodes)
    ]
    report = GraphReport(
        kind=record.kind, graph_id=record.graph_id, num_nodes=len(nodes), node_kinds=kinds
    )

    by_name = name_map(gm.graph)
    for bucket in records(gm, "gather"):
        collectives = bucket.resolve(by_name, bucket.collectives)
        waits = bucket.resolve(by_name, bucket.waits)
        if not collectives or not waits:
            continue  # one rank: a cast, no collective
        readers = set()
        for wait in waits:
            readers |= gathered_values(wait)[1]
        uses = [pos[r] for r in readers if r.meta.get(ROLE) != ROLE_GATHER_COPY_OUT]
        issue, wait = min(pos[c] for c in collectives), max(pos[w] for w in waits)
        wire = sum(_nbytes(c.meta["val"]) for c in collectives)
        report.gathers.append(
            GatherInfo(
                bucket=bucket.index,
                params=list(bucket.params),
                bytes=wire,
                full_bytes=bucket.full_bytes or wire,
                issue=issue,
                wait=wait,
                first_use=min(uses, default=wait),
                release=max(uses, default=wait),
                compute_ahead=sum(compute[issue + 1 : wait]),
            )
        )
        for reload in bucket.role_nodes(by_name, ROLE_RELOAD):
            (reload_wait,) = [u for u in reload.users if u.target is WAIT]
            report.reloads.append(
                ReloadInfo(
                    bucket=bucket.index,
                    bytes=_nbytes(reload.meta["val"]),
                    issue=pos[reload],
                    wait=pos[reload_wait],
                    compute_overlapped=sum(compute[pos[reload] + 1 : pos[reload_wait]]),
                )
            )
    for bucket in records(gm, "reduce"):
        collectives = bucket.resolve(by_name, bucket.collectives)
        waits = bucket.resolve(by_name, bucket.waits)
        if not collectives or collectives[0].meta.get(ROLE) != ROLE_REDUCE_SCATTER or not waits:
            continue  # one rank, or replicated parameters (counted as all-reduces below)
        # the reduction's own stages: one, or two (qgZ across nodes: within the node, then
        # across); an all-reduce across replicas after them is counted as one below
        stages = [c for c in collectives if c.meta.get(ROLE) == ROLE_REDUCE_SCATTER]
        first, wait = stages[0], waits[len(stages) - 1]
        grads = _gradient_sources(first)
        sizes = [_nbytes(c.args[0].meta["val"]) for c in stages]
        full = [bucket.full_bytes or sizes[0]]
        full += [c.meta.get(FULL_BYTES, size) for c, size in zip(stages[1:], sizes[1:])]
        report.reductions.append(
            ReduceInfo(
                bucket=bucket.index,
                params=list(bucket.params),
                bytes=sum(sizes),
                full_bytes=sum(full),
                ready=max((pos[g] for g in grads), default=pos[first]),
                issue=pos[first],
                wait=pos[wait],
                compute_overlapped=sum(compute[pos[first] + 1 : pos[wait]]),
            )
        )
    for gather in report.gathers:
        gather.buckets_ahead = sum(
            1 for other in report.gathers if gather.issue < other.first_use < gather.wait
        )
    for name, items in (("all_gather", report.gathers), ("reduce_scatter", report.reductions)):
        if items:
            report.collectives[name] = {
                "count": len(items),
                "bytes": sum(i.bytes for i in items),
                "full_bytes": sum(i.full_bytes for i in items),
            }
    # a compressed bucket's first collective: the bytes it would carry uncompressed; a later
    # stage's compressed collectives say so themselves
    full_bytes = {
        bucket.collectives[0]: bucket.full_bytes
        for bucket in records(gm)
        if bucket.full_bytes is not None
    }
    for node in nodes:
        if node.op == "call_function" and FULL_BYTES in node.meta:
            full_bytes[node.name] = node.meta[FULL_BYTES]
    # the replicas' sum of reduced shards (an all-reduce, or compressed: an all-to-all and an
    # all-gather), and any other all-reduce
    all_reduces = [
        n for n in nodes if n.target in COLLECTIVES and _collective_kind(n) == "all_reduce"
    ]
    if all_reduces:
        wire = [_collective_bytes(n) for n in all_reduces]
        report.collectives["all_reduce"] = {
            "count": len(all_reduces),
            "bytes": sum(wire),
            "full_bytes": sum(full_bytes.get(n.name, b) for n, b in zip(all_reduces, wire)),
        }
    for node in nodes:
        if node.target in COLLECTIVES:
            group = node.args[2] if node.target is ALL_GATHER else node.args[-1]
            kind, value = _collective_kind(node), _collective_bytes(node)
            name = node.meta.get(GROUP_ROLE) or foreign_group_role(str(group))
            per_group = report.group_bytes.setdefault(name, {})
            per_group[kind] = per_group.get(kind, 0) + value
            full = report.group_full_bytes.setdefault(name, {})
            full[kind] = full.get(kind, 0) + full_bytes.get(node.name, value)

    timeline = memory_timeline(
        gm,
        inputs_die=record.kind == "backward",
        gloo_temporaries=any(
            _backend_of(n.args[-1]) == "gloo" for n in nodes if n.target in COLLECTIVES
        ),
    )
    report.memory = timeline.live_bytes
    report.peak_bytes = timeline.peak_bytes
    report.peak_node = timeline.peak_node
    report.end_bytes = timeline.end_bytes
    if record.budget is not None:
        report.budget = record.budget.to_dict()
    report.saved = [
        SavedTensor(
            n.name,
            _plain_shape(n.meta["val"]),
            str(n.meta["val"].dtype),
            _nbytes(n.meta["val"]),
            secondary=n.target is SECONDARY_SLICE,
        )
        for n in record.saved
        if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    return report


def _backend_of(group_name: str) -> str | None:
    try:
        return group_backend(resolve_group(group_name))
    except Exception:  # noqa: BLE001  - no process group here (a report built offline)
        return None


def _gradient_sources(reduce_scatter: fx.Node) -> list[fx.Node]:
    """The gradient nodes a reduce-scatter's copy-in reads (walking back over the copy-in)."""
    sources, stack, seen = [], [reduce_scatter.args[0]], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.meta.get(ROLE) == ROLE_REDUCE_COPY_IN:
            stack.extend(node.all_input_nodes)
        else:
            sources.append(node)
    return sources


def step_peak_bytes(forward: GraphReport, backward: GraphReport | None) -> int:
    """Estimated peak of one training step above the memory held before it.

    Forward creates its intermediates, then keeps its outputs (loss, saved activations) alive;
    backward starts from those and frees the saved ones as it consumes them.
    """
    if backward is None:
        return forward.peak_bytes
    return max(forward.peak_bytes, forward.end_bytes + backward.peak_bytes)


__all__ = [
    "GatherInfo",
    "ReloadInfo",
    "GraphReport",
    "ReduceInfo",
    "SavedTensor",
    "build_report",
    "step_peak_bytes",
]
