"""Replace ``unshard`` markers by bucketed functional all-gathers, right before first use."""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from ..._torch.c10d import WAIT
from ...collectives.arithmetic import gather_bytes
from ...collectives.ops import RELOAD, UNSHARD
from ...collectives.schemes import gather_scheme
from ...sharding.nodes import shard_group_of
from ..buckets import BucketRecord, GraphEmit, add_record
from ..context import PassContext
from ..graph_facts import is_view
from ..graph_utils import node_order
from ..markers import UnshardCall
from ..node_keys import BUCKET, ROLE_RELOAD, ROLE_RELOAD_WAIT


def lower_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Lower each gather bucket to copy-in, one all-gather, its wait and copy-outs.

    **Invariant** before: markers carry ``meta[BUCKET]`` (``assign_buckets``). After: no
    ``unshard`` marker is left; each bucket is its collective scheme's steps (``schemes.py``:
    copy-in, the all-gather, its ``wait_tensor``, copy-out), all placed right before the bucket's
    first use (the prefetch pass moves the issue earlier), and recorded in
    ``gm.meta[BUCKETS]`` (``buckets.BucketRecord``). Shard views are hoisted to the top so issues
    can move freely. Copy-in and copy-out are the fixed operations ``zero3::gather_copy_in`` /
    ``gather_copy_out`` (bodies in ``arithmetic.py``): Inductor calls them rather than compiling a
    kernel per bucket shape; with ``fused_copies`` the scheme traces the ATen ops instead.

    ```
    before:
      inputs: arg0_1, arg1_1, arg2_1
      unshard = unshard(arg1_1, 'h.0.fc.weight')
      unshard_1 = unshard(arg2_1, 'h.0.fc.bias')
      t = t(unshard)
      addmm = addmm(unshard_1, arg0_1, t)
      relu = relu(addmm)
      return relu
    after:
      inputs: arg0_1, arg1_1, arg2_1
      gather_copy_in = gather_copy_in([arg1_1, arg2_1], [16, 2], float32)
      all_gather_into_tensor_default = all_gather_into_tensor(gather_copy_in, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      gather_copy_out = gather_copy_out(wait_tensor_default, 4, [16, 2])
      getitem = getitem(gather_copy_out, 0)
      getitem_1 = getitem(gather_copy_out, 1)
      view = view(getitem, [8, 8])
      view_1 = view(getitem_1, [8])
      t = t(view)
      addmm = addmm(view_1, arg0_1, t)
      relu = relu(addmm)
      return relu
    ```
    A single-parameter bucket needs no copy-out: its first ``dim0`` gathered rows are the
    parameter (padding sits only at the tail, see ``layout.py``); nor a copy-in when its shard
    needs no cast and no padding. An offloaded shard is read
    back first: ``reload(shard)`` and its ``wait_tensor``, right before the copy-in.
    """
    graph = gm.graph
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is UNSHARD:
            if not node.users:
                continue
            if BUCKET not in node.meta:
                raise AssertionError("zero3: lower_gathers needs assign_buckets first")
            buckets[node.meta[BUCKET]].append(node)
    for node in [n for n in graph.nodes if n.target is UNSHARD and not n.users]:
        graph.erase_node(node)
    if not buckets:
        return
    _hoist_shard_views(graph, [m for members in buckets.values() for m in members])
    for index in sorted(buckets):
        members = buckets[index]
        order = node_order(graph)
        first_use = min((u for m in members for u in m.users), key=order.__getitem__)
        with graph.inserting_before(first_use):
            fulls = _emit_bucket(gm, index, members, ctx)
        for marker, full in zip(members, fulls):
            marker.replace_all_uses_with(full)
            graph.erase_node(marker)
    _erase_unused_views(graph)
    graph.lint()


def _erase_unused_views(graph: fx.Graph) -> None:
    """Views nobody reads any more (an offloaded shard's: it holds no memory to view)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if not node.users and is_view(node):
                graph.erase_node(node)
                changed = True


def _hoist_shard_views(graph: fx.Graph, markers: list[fx.Node]) -> None:
    """Move each marker's shard (a view chain of a placeholder) up to the placeholders."""
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    hoisted: set[fx.Node] = set()
    for marker in markers:
        chain = []
        node = UnshardCall.of(marker).shard
        while is_view(node):
            chain.append(node)
            node = node.args[0]
        if node.op != "placeholder":
            continue  # computed shards (unusual) stay where they are
        for view in reversed(chain):
            if view in hoisted:
                continue
            hoisted.add(view)
            if view is anchor:
                anchor = view.next
            else:
                anchor.prepend(view)


# Test-only switch: lower reloads without their waits, to show that Offload(poison=True) makes
# a missing wait fail loudly (tests/distributed/test_offload.py). Never set it otherwise.
_TEST_ONLY_DROP_RELOAD_WAITS = False


def _reloaded(emit: GraphEmit, call: UnshardCall, ctx: PassContext) -> fx.Node:
    """An offloaded shard read back from its store: ``reload`` then ``wait_tensor`` (the read is
    moved earlier by ``prefetch_reloads``; the wait stays right before the copy-in). A backward
    graph's is the step's last read of the shard (``last``: an optimizer stepping in the
    backward keeps the values); Inductor's graphs own the buffer (``owned=False``).

    The read starts from the graph input itself: an evicted shard holds no memory, so not even a
    view of it may run; the views the graph applied to the input are applied to the read copy.
    """
    chain = []
    node = call.shard
    while is_view(node):
        chain.append(node)
        node = node.args[0]
    last = ctx.graph_kind == "backward"
    owned = ctx.options.codegen != "inductor"
    started = emit.node(ROLE_RELOAD, RELOAD, node, last, owned)
    if _TEST_ONLY_DROP_RELOAD_WAITS:  # the poison-mode test's broken schedule
        value = started
    else:
        value = emit.node(ROLE_RELOAD_WAIT, WAIT, started)
    for view in reversed(chain):
        value = emit.node(ROLE_RELOAD_WAIT, view.target, value, *view.args[1:], **view.kwargs)
    return value


def _emit_bucket(
    gm: fx.GraphModule, index: int, members: list[fx.Node], ctx: PassContext
) -> list[fx.Node]:
    calls = [UnshardCall.of(m) for m in members]
    specs = [c.spec for c in calls]
    scheme = gather_scheme(
        specs[0],
        calls[0].shard.meta["val"].dtype,
        traced_copies=ctx.options.fused_copies,
        quantization=ctx.gather_quantization(),
    )
    record = BucketRecord(
        kind="gather",
        index=index,
        params=tuple(s.fqn for s in specs),
        scheme=type(scheme).__name__,
        groups=(shard_group_of(specs[0].group), specs[0].replicate_group),  # the mesh
        full_bytes=gather_bytes(specs, scheme.dtype) if scheme.compresses else None,
        specs=tuple(s.literal() for s in specs),
        shards=[c.shard.name for c in calls],
        shard_dtype=calls[0].shard.meta["val"].dtype,
    )
    emit = GraphEmit(gm.graph, record, source=members[0])
    shards = [_reloaded(emit, c, ctx) if c.spec.offloaded else c.shard for c in calls]
    payloads = scheme.copy_in(emit, shards, specs)
    waited = scheme.wait(emit, scheme.issue(emit, payloads))
    fulls = scheme.copy_out(emit, waited, specs)
    add_record(gm, record)
    return fulls
