"""Put the cross-rank check in front of a scheduled graph's collectives."""

from __future__ import annotations

import torch.fx as fx

from ...collectives.ops import GUARD
from ...runtime import guard
from ..buckets import records
from ..context import PassContext
from ..graph_utils import NodeFactory
from ..node_keys import ROLE, ROLE_GUARD
from ..signature import collective_signature, describe_signature, signature_code

_KINDS = guard.GRAPH_KINDS


def insert_guard(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Insert ``zero3::guard(group, replicate_group, kind, code, label, timeout)`` after the
    placeholders.

    **Invariant** after: a graph that issues collectives runs exactly one guard before any of
    them; its code is the digest of the graph's collective sequence (kinds, groups, sizes,
    dtypes, the parameters each carries), so the ranks compare what they are about to issue, not
    how often each compiled. It runs on the side channel of the mesh the buckets' collectives
    use (``gm.meta[BUCKETS]``), with the options' ``sync_timeout_s`` (the backend fills in the
    model's own when the options leave it unset).
    A graph without collectives is unchanged.

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
      guard_default = guard('0', kind=1)
      view = view(arg1_1, [-1])
      all_gather_into_tensor_default = all_gather_into_tensor(view, 4, '0')
      wait_tensor_default = wait_tensor(all_gather_into_tensor_default)
      view_1 = view(wait_tensor_default, [4, 4])
      t = t(view_1)
      mm = mm(arg0_1, t)
      return mm
    ```
    """
    graph = gm.graph
    signature = collective_signature(graph)
    ours = [r for r in records(gm) if r.collectives]
    if not signature or not ours:
        return
    group, replicate_group = ours[0].groups
    code = signature_code(graph)
    # no process-local ids (graph ids): the compiled code is cached and run by other processes
    label = f"({describe_signature(signature, graph)})"
    guard.describe(_KINDS[ctx.graph_kind], code, label)
    timeout = float(ctx.options.sync_timeout_s or guard.DEFAULT_TIMEOUT_S)
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(anchor):
        NodeFactory(graph, **{ROLE: ROLE_GUARD})(
            GUARD, group, replicate_group, _KINDS[ctx.graph_kind], code, label, timeout
        )
    graph.lint()
