"""Hand each graph's first all-gather over to the graph before it (``collectives/handoff.py``)."""

from __future__ import annotations

import torch.fx as fx

from ..._torch.c10d import WAIT
from ...collectives.ops import HANDOFF_GATHER, TAKE_GATHER
from ...runtime import guard
from ..buckets import BucketRecord, name_map, records
from ..context import PassContext
from ..graph_utils import NodeFactory, node_order, output_node
from ..node_keys import (
    BUCKET,
    GROUP_ROLE,
    PARAMS,
    ROLE,
    ROLE_ALL_GATHER,
    ROLE_GATHER_COPY_IN,
    ROLE_GATHER_COPY_OUT,
    ROLE_GATHER_WAIT,
    ROLE_RELOAD,
)

_KINDS = guard.GRAPH_KINDS


def handoff_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """With ``cross_graph_prefetch``: the first gather bucket is taken, the next graph's handed off.

    **Invariant** before: gather buckets lowered and scheduled (``prefetch_gathers``). After, in a
    graph whose first bucket (by wait) is a plain all-gather of shards held in memory: its copy-in
    and all-gather are one ``zero3::take_gather(shards, specs, dtype, kind, group)``, whose output
    the bucket's wait waits as before; after the last bucket's wait and copy-outs,
    ``handoff_gather(last gathered, kind, group)`` issues the next graph's first bucket as learnt,
    and its ``wait_tensor`` sits before the output (``serialize_collectives`` moves it before a
    later collective on gloo). Other graphs are unchanged.

    ```
    before:
      inputs: arg0_1, arg1_1
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      view_1 = view(wait_tensor_default, [4, 4])
      t = t(view_1)
      mm = mm(arg0_1, t)
      return mm
    after:
      inputs: arg0_1, arg1_1
      take_gather_default = take_gather([arg1_1], ['{"fqn":"h.0.w","grads_offloaded":false,"group":"0","offloaded":false,"param_dtype":null,"primary_size":0,"reduce_dtype":null,"replicate_group":"","replicate_size":1,"shape":[4,4],"v":1,"world_size":4}'], float32, 1, '0')
      wait_tensor_default = wait_tensor(take_gather_default)
      view_1 = view(wait_tensor_default, [4, 4])
      handoff_gather_default = handoff_gather(wait_tensor_default, 1, '0')
      t = t(view_1)
      mm = mm(arg0_1, t)
      wait_tensor_default_1 = wait_tensor(handoff_gather_default)
      return mm
    ```
    (The take's arguments: the shards, their specs' literals, the shards' dtype, the graph's
    kind, the group.)
    """
    if not ctx.options.cross_graph_prefetch or ctx.graph_kind not in _KINDS:
        return
    graph = gm.graph
    nodes, order = name_map(graph), node_order(graph)
    gathers = [r for r in records(gm, "gather") if r.resolve(nodes, r.waits)]
    if not gathers:
        return

    def first_wait(record: BucketRecord) -> int:
        return min(order[w] for w in record.resolve(nodes, record.waits))

    by_wait = sorted(gathers, key=first_wait)
    first = by_wait[0]
    shards = first.resolve(nodes, first.shards)
    collectives = first.resolve(nodes, first.collectives)
    if (
        first.scheme != "AllGather"
        or first.nodes.get(ROLE_RELOAD)
        or len(collectives) != 1
        or len(shards) != len(first.specs)
        or len(shards) != len(first.params)
    ):
        return
    kind = _KINDS[ctx.graph_kind]
    (gather,) = collectives
    group = str(gather.args[-1])
    meta = {
        ROLE: ROLE_ALL_GATHER,
        BUCKET: first.index,
        PARAMS: first.params,
        GROUP_ROLE: gather.meta.get(GROUP_ROLE),
    }
    with graph.inserting_before(gather):
        take = NodeFactory(graph, source=gather, **meta)(
            TAKE_GATHER, shards, list(first.specs), first.shard_dtype, kind, group
        )
    gather.replace_all_uses_with(take)
    copy_ins = first.role_nodes(nodes, ROLE_GATHER_COPY_IN)
    graph.erase_node(gather)
    for node in reversed(copy_ins):
        if not node.users:
            graph.erase_node(node)
    first.collectives = [take.name]
    first.nodes[ROLE_ALL_GATHER] = [take.name]
    first.nodes[ROLE_GATHER_COPY_IN] = []

    nodes, order = name_map(graph), node_order(graph)
    last = by_wait[-1]
    finish = last.role_nodes(nodes, ROLE_GATHER_WAIT, ROLE_GATHER_COPY_OUT)
    after = max(last.resolve(nodes, last.waits), key=order.__getitem__)
    anchor = max(finish, key=order.__getitem__).next
    factory = NodeFactory(graph, source=after, **{ROLE: ROLE_ALL_GATHER})
    with graph.inserting_before(anchor):
        handoff = factory(HANDOFF_GATHER, after, kind, group)
    with graph.inserting_before(output_node(graph)):
        NodeFactory(graph, source=after, **{ROLE: ROLE_GATHER_WAIT})(WAIT, handoff)
    graph.lint()
