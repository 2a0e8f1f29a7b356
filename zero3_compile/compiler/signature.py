"""What a scheduled graph will issue: its collective signature, a digest of it, and checks that
Inductor's generated code issues (and waits for) the collectives as scheduled (the generated code
is read by ``_torch.inductor``)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch.fx as fx

from .._torch.c10d import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_REDUCE_INPLACE,
    ALL_TO_ALL,
    COLLECTIVES,
    REDUCE_SCATTER,
    WAIT,
)
from .._torch.inductor import generated_collective_order, generated_events
from ..sharding.layout import foreign_group_role
from ..sharding.spec import ShardSpec
from .node_keys import GROUP_ROLE, PARAMS

log = logging.getLogger(__name__)


def collective_signature(graph: fx.Graph, *, roles: bool = False) -> list[tuple]:
    """(kind, group, group size, elements, dtype) for every collective, in graph order.

    ``roles``: groups by their role ("shard", "replicate", set by the scheme that created the
    collective), the same on every rank, instead of their names (a 2-D mesh's subgroups have
    other names on other rows); a foreign collective's group (tensor parallelism's) by the name
    of its mesh dimension.
    """
    from ..collectives.ops import TAKE_GATHER

    signature = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is TAKE_GATHER:
            # a graph's first all-gather, maybe prefetched by the graph before (handoff.py)
            out, world, group = node.meta["val"], _take_world(node), node.args[4]
            name = node.meta.get(GROUP_ROLE) if roles else str(group)
            signature.append(("all_gather", name, world, out.numel() // world, str(out.dtype)))
            continue
        if node.op != "call_function" or node.target not in COLLECTIVES:
            continue
        tensor = node.args[0].meta["val"]
        if node.target is ALL_GATHER:
            kind, world, group = "all_gather", node.args[1], node.args[2]
        elif node.target is REDUCE_SCATTER:
            kind, world, group = f"reduce_scatter_{node.args[1]}", node.args[2], node.args[3]
        elif node.target is ALL_TO_ALL:
            kind, world, group = "all_to_all", len(node.args[1]), node.args[3]
        else:
            group = node.args[2]
            kind, world = f"all_reduce_{node.args[1]}", _group_size(group)
        if roles:
            name = node.meta.get(GROUP_ROLE) or foreign_group_role(str(group))
        else:
            name = str(group)
        signature.append((kind, name, int(world), int(tensor.numel()), str(tensor.dtype)))
    return signature


def _take_world(node: fx.Node) -> int:
    return ShardSpec.parse(node.args[1][0]).world_size


def _group_size(group_name: str) -> int:
    try:
        import torch.distributed as dist

        from .._torch.c10d import resolve_group

        return dist.get_world_size(resolve_group(group_name))
    except Exception:  # noqa: BLE001 - a graph read offline
        return -1


def collective_parameters(graph: fx.Graph) -> list[tuple[str, ...]]:
    """The parameter names each collective carries, in graph order."""
    return [
        tuple(node.meta.get(PARAMS, ()))
        for node in graph.nodes
        if node.op == "call_function" and node.target in COLLECTIVES
    ]


def signature_code(graph: fx.Graph) -> int:
    """A 62-bit digest of what a graph issues: its collective signature and which parameters
    each collective carries (experts of equal shapes must not pass for one another)."""
    key = (collective_signature(graph, roles=True), collective_parameters(graph))
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def describe_signature(signature: list[tuple], graph: fx.Graph | None = None) -> str:
    counts: dict[str, int] = {}
    for kind, *_ in signature:
        counts[kind] = counts.get(kind, 0) + 1
    text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no collectives"
    if graph is not None:
        names = [
            name
            for node in graph.nodes
            if node.target in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
            for name in node.meta.get(PARAMS, ())
        ]
        if names:
            shown = ", ".join(names[:3])
            text += f"; parameters {shown}{', ...' if len(names) > 3 else ''}"
    return text


def scheduled_events(graph: fx.Graph) -> list[tuple[str, int]]:
    """What ``generated_events`` must find for ``graph``."""
    from ..collectives.ops import GUARD, HANDOFF_GATHER, TAKE_GATHER

    issued: dict[fx.Node, int] = {}
    events: list[tuple[str, int]] = []
    for node in graph.nodes:
        if node.target in COLLECTIVES or node.target in (TAKE_GATHER, HANDOFF_GATHER):
            issued[node] = len(issued)
            events.append(("issue", issued[node]))
        elif node.target is WAIT and node.args[0] in issued:
            events.append(("wait", issued[node.args[0]]))
        elif node.target is GUARD:
            events.append(("guard", -1))
    return events


def most_in_flight(events: list[tuple[str, int]]) -> int:
    """The most collectives issued and not yet waited at any point of ``events``."""
    pending: set[int] = set()
    most = 0
    for kind, index in events:
        if kind == "issue":
            pending.add(index)
            most = max(most, len(pending))
        elif kind == "wait":
            pending.discard(index)
    return most


def expected_collective_order(graph: fx.Graph) -> list[tuple[str, int]]:
    """What ``generated_collective_order`` must find for ``graph``: kinds and output sizes."""
    from ..collectives.ops import HANDOFF_GATHER, TAKE_GATHER

    kinds = {
        TAKE_GATHER: "all_gather",
        HANDOFF_GATHER: "handoff",
        ALL_GATHER: "all_gather",
        REDUCE_SCATTER: "reduce_scatter",
        ALL_REDUCE: "all_reduce",
        ALL_REDUCE_INPLACE: "all_reduce",
        ALL_TO_ALL: "all_to_all",
    }
    return [
        (kinds[node.target], int(node.meta["val"].numel()))
        for node in graph.nodes
        if node.op == "call_function" and node.target in kinds
    ]


class GeneratedOrderError(RuntimeError):
    """Inductor's generated code does not issue the collectives as scheduled."""

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#generatedordererror)"


@dataclass(frozen=True)
class ScheduledOrder:
    """The collectives of a scheduled graph as Inductor's code must issue them, captured before
    Inductor runs: its post-grad passes rewrite the graph in place (``reorder_for_locality``
    moves waits in inference graphs), so the graph afterwards no longer says what was scheduled."""

    collectives: list[tuple[str, int]]
    events: list[tuple[str, int]]

    @classmethod
    def of(cls, graph: fx.Graph) -> ScheduledOrder:
        return cls(expected_collective_order(graph), scheduled_events(graph))


def check_generated_order(scheduled: ScheduledOrder, source_code: str | None, label: str) -> None:
    """Raise if Inductor's generated code issues the collectives in another order than
    ``scheduled``, keeps more of them in flight, or runs the cross-rank guard after one of them.

    All ranks run the same passes, but Inductor sees rank-specific shapes (uneven shards), so a
    reordering there could differ between ranks and hang them; this turns that into an error.
    """
    expected = scheduled.collectives
    if not expected or source_code is None:
        return
    found = generated_collective_order(source_code)
    if not found:
        log.warning("zero3: could not read the collective order of %s from Inductor's code", label)
        return
    same = len(found) == len(expected) and all(
        fk == ek and (fn is None or fn == en) for (fk, fn), (ek, en) in zip(found, expected)
    )
    events = generated_events(source_code)
    guard_first = bool(events) and events[0] == ("guard", -1)
    # a serialized graph (gloo: ``serialize_collectives``) must stay serialized
    serial = most_in_flight(events) <= max(1, most_in_flight(scheduled.events))
    if not same or not guard_first or not serial:
        raise GeneratedOrderError(
            f"zero3: Inductor reordered the collectives of {label}: scheduled "
            f"{scheduled.events}, generated {events} ({found}). This could hang ranks; "
            "use options={'codegen': 'eager'} and please report it."
        )
