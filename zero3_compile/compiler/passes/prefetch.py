"""Issue all-gathers ahead of their use so communication overlaps compute."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..buckets import name_map, records
from ..context import PassContext
from ..graph_facts import is_view, view_root
from ..graph_utils import move_before, node_order
from ..node_keys import (
    ROLE,
    ROLE_ALL_GATHER,
    ROLE_GATHER_COPY_IN,
    ROLE_GATHER_COPY_OUT,
    ROLE_GATHER_WAIT,
    ROLE_GUARD,
    ROLE_RELOAD,
    ROLE_RELOAD_WAIT,
)


@dataclass
class _Gather:
    issue: list[fx.Node] = field(default_factory=list)  # copy-in nodes, then the all-gather
    wait: fx.Node | None = None
    finish: list[fx.Node] = field(default_factory=list)  # the wait and its copy-outs
    nbytes: int = 0


def prefetch_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Move each bucket's copy-in and all-gather ahead of its wait, within the prefetch budget.

    **Invariant** before: each gather bucket is issue nodes then wait then copy-outs, issued right
    before first use (``lower_gathers``). After: buckets are issued in the order of their waits;
    bucket ``i`` is issued right after bucket ``i - prefetch_depth`` finished its wait and copy-out
    (at the top of the graph when there is none), later if the bytes gathered but not yet used
    would exceed ``max_inflight_bytes`` (the first prefetched bucket is always allowed), and right
    before its own wait when ``prefetch_depth == 0``. Waits and uses do not move.

    ```
    before:
      inputs: arg0_1, arg1_1, arg2_1
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      view_1 = view(wait_tensor_default, [4, 4])
      t = t(view_1)
      mm = mm(arg0_1, t)
      view_2 = view(arg2_1, [-1])
      all_gather_into_tensor_default_1 = all_gather_into_tensor(view_2, 4, '0')
      wait_tensor_default_1 = wait_tensor(all_gather_into_tensor_default_1)
      view_3 = view(wait_tensor_default_1, [4, 4])
      t_1 = t(view_3)
      mm_1 = mm(mm, t_1)
      return mm_1
    after:
      inputs: arg0_1, arg1_1, arg2_1
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      view_1 = view(wait_tensor_default, [4, 4])
      view_2 = view(arg2_1, [-1])
      all_gather_into_tensor_default_1 = all_gather_into_tensor(view_2, 4, '0')
      t = t(view_1)
      mm = mm(arg0_1, t)
      wait_tensor_default_1 = wait_tensor(all_gather_into_tensor_default_1)
      view_3 = view(wait_tensor_default_1, [4, 4])
      t_1 = t(view_3)
      mm_1 = mm(mm, t_1)
      return mm_1
    ```
    """
    graph = gm.graph
    gathers = _collect(gm)
    if not gathers:
        return
    order = node_order(graph)
    ordered = sorted(gathers.values(), key=lambda g: order[g.wait])
    depth = ctx.options.prefetch_depth
    cap = ctx.options.max_inflight_bytes
    slots = _choose_slots(ordered, depth, cap)
    top = _first_compute_node(graph)
    for gather, slot in zip(ordered, slots):
        if slot == _OWN_WAIT:
            anchor = gather.wait
        elif slot < 0:
            anchor = top
        else:
            anchor = ordered[slot].finish[-1].next
        anchor = _not_before_inputs(gather.issue, anchor, node_order(graph))
        move_before(gather.issue, anchor)
    graph.lint()


def _not_before_inputs(issue: list[fx.Node], anchor: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """``anchor``, or a later node if an input of the issue nodes is computed after it."""
    group = set(issue)
    latest = max(
        (inp for node in issue for inp in node.all_input_nodes if inp not in group),
        key=order.__getitem__,
        default=None,
    )
    if latest is not None and order[latest] >= order[anchor]:
        return latest.next
    return anchor


_OWN_WAIT = None


def _choose_slots(ordered: list[_Gather], depth: int, cap: int | None) -> list[int | None]:
    """For bucket i: issue after bucket ``slot`` finished (-1: at the top; None: at own wait)."""
    slots: list[int | None] = []
    previous = -1
    for i, gather in enumerate(ordered):
        if depth == 0:
            slots.append(_OWN_WAIT)
            continue
        slot = max(i - depth, previous)
        while cap is not None and slot < i - 1:
            # in flight at slot: buckets issued at or before it and waited after it
            inflight = sum(
                ordered[j].nbytes
                for j in range(slot + 1, i)
                if slots[j] is not _OWN_WAIT and slots[j] <= slot
            )
            if inflight == 0 or inflight + gather.nbytes <= cap:
                break
            slot += 1
        slots.append(slot)
        previous = slot
    return slots


def _collect(gm: fx.GraphModule) -> dict[int, _Gather]:
    """Each gather bucket's nodes, from the records ``lower_gathers`` kept."""
    graph = gm.graph
    nodes = name_map(graph)
    order = node_order(graph)
    gathers: dict[int, _Gather] = {}
    for record in records(gm, "gather"):
        waits = record.resolve(nodes, record.waits)
        if not waits:
            continue  # one rank: nothing to wait for
        gather = _Gather()
        roles = (ROLE_RELOAD, ROLE_RELOAD_WAIT, ROLE_GATHER_COPY_IN, ROLE_ALL_GATHER)
        gather.issue = sorted(record.role_nodes(nodes, *roles), key=order.__getitem__)
        gather.wait = min(waits, key=order.__getitem__)
        finish = record.role_nodes(nodes, ROLE_GATHER_WAIT, ROLE_GATHER_COPY_OUT)
        gather.finish = sorted(finish, key=order.__getitem__)
        for node in record.resolve(nodes, record.collectives):
            val = node.meta["val"]
            gather.nbytes += val.numel() * val.dtype.itemsize
        gathers[record.index] = gather
    return gathers


def _first_compute_node(graph: fx.Graph) -> fx.Node:
    """The first node that is not a placeholder, a view of one (hoisted shards) or a gather issue."""
    for node in graph.nodes:
        if node.op == "placeholder" or node.meta.get(ROLE) in (
            ROLE_RELOAD,
            ROLE_RELOAD_WAIT,
            ROLE_GATHER_COPY_IN,
            ROLE_ALL_GATHER,
        ):
            continue
        if is_view(node) and view_root(node).op == "placeholder":
            continue
        if node.meta.get(ROLE) == ROLE_GUARD:
            continue
        return node
    raise AssertionError("zero3: graph has no output node")


def _first_not_reload(gather: _Gather) -> fx.Node:
    return next(n for n in gather.issue if n.meta.get(ROLE) != ROLE_RELOAD)


def prefetch_reloads(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Issue the reads of offloaded shards ``reload_depth`` buckets ahead of their all-gather.

    **Invariant** before: each offloaded shard is read by ``reload`` then ``wait_tensor`` right
    before its bucket's copy-in (``lower_gathers``), issues in final order (``prefetch_gathers``).
    After: the ``reload`` of bucket ``i`` sits right before the issue of bucket
    ``i - reload_depth`` (at the top of the graph when there is none); waits do not move, so a
    read overlaps the all-gathers and compute in between, and its buffer dies after the copy-in.
    A graph without offloaded shards is unchanged.
    """
    graph = gm.graph
    gathers = _collect(gm)
    if not any(n.meta.get(ROLE) == ROLE_RELOAD for g in gathers.values() for n in g.issue):
        return
    order = node_order(graph)
    ordered = sorted(gathers.values(), key=lambda g: order[g.issue[0]])
    depth = ctx.options.reload_depth
    top = _first_compute_node(graph)
    for i, gather in enumerate(ordered):
        reloads = [n for n in gather.issue if n.meta.get(ROLE) == ROLE_RELOAD]
        if not reloads or depth == 0:
            continue
        earlier = i - depth
        # the first issue of that bucket that is not itself a read moved ahead (anchoring on
        # its reload would chain every read to the top of the graph)
        anchor = _first_not_reload(ordered[earlier]) if earlier >= 0 else top
        if order[anchor] < order[reloads[0]]:
            move_before(reloads, anchor)
            order = node_order(graph)
    graph.lint()
