"""Replace ``reduce_grad`` markers by bucketed reduce-scatters issued as soon as a bucket is ready."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...collectives.arithmetic import reduce_bytes
from ...collectives.ops import REDUCE_GRAD, SPOOL_GRAD
from ...collectives.schemes import ReduceScheme, reduce_scheme
from ...sharding.spec import ShardSpec
from ..buckets import BucketRecord, GraphEmit, add_record
from ..context import PassContext
from ..graph_utils import move_users_after, node_order, output_node
from ..markers import ReduceGradCall
from ..node_keys import BUCKET, ROLE_REDUCE_COPY_OUT


def lower_reductions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Lower each reduce bucket to copy-in, one sum reduce-scatter, its wait and copy-outs.

    **Invariant** before: ``reduce_grad`` markers carry ``meta[BUCKET]`` in readiness order
    (``assign_buckets``). After: no marker is left; bucket ``j``'s copy-in and reduce-scatter sit
    right after the last of its gradients is computed, or right after bucket ``j - 1``'s issue
    if that comes later (buckets are issued in index order); its wait and copy-out (slice this rank's
    rows, divide by the world size, cast to the shard dtype) sit right before bucket
    ``j + reduce_scatter_depth`` is issued, or before the output for the last buckets, so at most
    ``reduce_scatter_depth`` full-size gradient buckets are in flight. A scheme of several stages
    (``schemes.py``; hybrid sharding: the reduced shard bucket is then all-reduced over the
    replicate group) issues stage ``s + 1`` right after stage ``s``'s wait and waits it one bucket
    later. Every bucket is recorded in ``gm.meta[BUCKETS]``. Copy-in and copy-out are the fixed
    operations ``zero3::reduce_copy_in`` / ``reduce_copy_out`` (bodies in ``arithmetic.py``); a
    lone gradient that needs no cast and no padding goes to the collective as it is (a view).

    ```
    before:
      inputs: arg0_1, arg1_1
      mul = mul(arg1_1, 2)
      reduce_grad = reduce_grad(mul, 'h.1.w')
      mul_1 = mul(arg0_1, 2)
      reduce_grad_1 = reduce_grad(mul_1, 'h.0.w')
      return [reduce_grad, reduce_grad_1]
    after:
      inputs: arg0_1, arg1_1
      mul = mul(arg1_1, 2)
      view = view(mul, [-1])
      reduce_scatter_tensor_default = reduce_scatter_tensor(view, 'sum', 4, '0')
      mul_1 = mul(arg0_1, 2)
      wait_tensor_default = wait_tensor(reduce_scatter_tensor_default)
      reduce_copy_out = reduce_copy_out(wait_tensor_default, [4], [4], 4, float32)
      getitem = getitem(reduce_copy_out, 0)
      view_2 = view(getitem, [1, 4])
      view_1 = view(mul_1, [-1])
      reduce_scatter_tensor_default_1 = reduce_scatter_tensor(view_1, 'sum', 4, '0')
      wait_tensor_default_1 = wait_tensor(reduce_scatter_tensor_default_1)
      reduce_copy_out_1 = reduce_copy_out(wait_tensor_default_1, [4], [4], 4, float32)
      getitem_1 = getitem(reduce_copy_out_1, 0)
      view_3 = view(getitem_1, [1, 4])
      return [view_2, view_3]
    ```
    """
    graph = gm.graph
    fused = ctx.options.fused_copies
    if ctx.options.codegen == "inductor":
        _spool_copies(graph)
    buckets: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is REDUCE_GRAD:
            if BUCKET not in node.meta:
                raise AssertionError("zero3: lower_reductions needs assign_buckets first")
            buckets[node.meta[BUCKET]].append(node)
    if not buckets:
        return
    issued: list[_Issued] = []
    previous: fx.Node | None = None  # the last node of the previous bucket's issue
    handed_out: set[fx.Node] = set()  # gradients a shard without a collective is a view of
    for index in sorted(buckets):
        order = node_order(graph)
        members = sorted(buckets[index], key=order.__getitem__)
        calls = [ReduceGradCall.of(m) for m in members]
        first = calls[0]
        scheme = reduce_scheme(
            first.spec,
            first.grad.meta["val"].dtype,
            first.shard_dtype,
            traced_copies=fused,
            quantization=ctx.reduce_quantization(),
            node_size=ctx.reduce_node_size(first.spec.group),
        )
        specs = [c.spec for c in calls]
        record = BucketRecord(
            kind="reduce",
            index=index,
            params=tuple(s.fqn for s in specs),
            scheme=type(scheme).__name__,
            groups=(first.spec.group, first.spec.replicate_group),
            full_bytes=reduce_bytes(specs, scheme.dtype) if scheme.compresses else None,
        )
        add_record(gm, record)
        emit = GraphEmit(graph, record, source=members[0])
        if not scheme.stages:  # in place: no collective to wait for
            for marker, call in zip(members, calls):
                grad = call.grad
                with graph.inserting_before(marker):
                    if grad in handed_out:
                        # the shard is (a view of) its gradient: one gradient node for several
                        # parameters (autograd's CSE of equal gradients) would give them one
                        # storage, and accumulating into one .grad would change the others
                        grad = emit.node(ROLE_REDUCE_COPY_OUT, torch.ops.aten.clone.default, grad)
                    handed_out.add(call.grad)
                    shards = scheme.copy_out(emit, [grad], [call.spec], [call.shard_shape])
                _replace([marker], shards, graph)
            continue
        # issued after its last gradient and after the previous bucket: buckets whose last
        # gradient is one node (one gradient computed for two blocks' parameters) would
        # otherwise be issued in reverse order, and the waits below assume index order
        anchor = max((c.grad for c in calls), key=order.__getitem__)
        if previous is not None and order[previous] > order[anchor]:
            anchor = previous
        with graph.inserting_before(anchor.next):
            payloads = scheme.copy_in(emit, [c.grad for c in calls], specs)
            works = scheme.issue(emit, 0, payloads, specs)
        previous = emit.created[-1]
        issued.append(_Issued(members, calls, scheme, emit, emit.created[0], works))

    depth = ctx.options.reduce_scatter_depth
    out = output_node(graph)

    def issue_of(k: int) -> fx.Node:
        return issued[k].first if k < len(issued) else out

    # stage s of bucket j is waited right before bucket j + depth + s is issued
    for stage in range(max((b.scheme.stages for b in issued), default=0)):
        for j, bucket in enumerate(issued):
            scheme = bucket.scheme
            if stage >= scheme.stages:
                continue
            with graph.inserting_before(issue_of(j + depth + stage)):
                waited = scheme.wait(bucket.emit, stage, bucket.works)
                if stage + 1 < scheme.stages:
                    bucket.works = scheme.issue(bucket.emit, stage + 1, waited, bucket.specs)
                    continue
                shards = scheme.copy_out(
                    bucket.emit, waited, bucket.specs, [c.shard_shape for c in bucket.calls]
                )
            _replace(bucket.members, shards, graph)
    graph.lint()


def _spool_copies(graph: fx.Graph) -> None:
    """A reduced gradient that ``spool_grad`` writes (or steps) after it returned lives, in
    Inductor's code, in a buffer that Inductor reuses for a later tensor as soon as its last
    reader ran: ``spool_grad`` copies it first (``owned=False``)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is SPOOL_GRAD:
            node.args = (node.args[0], node.args[1], False)


@dataclass
class _Issued:
    members: list[fx.Node]
    calls: list[ReduceGradCall]
    scheme: ReduceScheme
    emit: GraphEmit
    first: fx.Node  # the first node of the bucket's copy-in and issue
    works: list

    @property
    def specs(self) -> list[ShardSpec]:
        return [c.spec for c in self.calls]


def _replace(members: list[fx.Node], shards: list[fx.Node], graph: fx.Graph) -> None:
    order = node_order(graph)
    for marker, shard in zip(members, shards):
        marker.replace_all_uses_with(shard)
        graph.erase_node(marker)
        move_users_after(shard, shard, order)
