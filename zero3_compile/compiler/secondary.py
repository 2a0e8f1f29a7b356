"""ZeRO++'s hpZ as an edit of the partition: the forward keeps a node-local secondary shard of
each parameter its backward gathers again, and the backward gathers that within the node.

[Note: secondary shards]
A shard group of N ranks spans nodes of k ranks each (``sharding/nodes.py``: a node's ranks of
the group are consecutive). Without hpZ the backward re-gathers every parameter over all N ranks,
across the nodes' links. With ``secondary_shard``:

```
forward:   full = all_gather(shard, N)                      (as before)
           secondary = secondary_slice(full, numel', i)     i: this rank's index on its node
           ... full dies after its last forward use; secondary is saved for backward ...
backward:  full = all_gather(secondary, k, node group)      never leaves the node
```
The secondary spec (``ShardSpec.primary_size = N``, ``group`` / ``world_size`` the node's) gives
each of the node's k ranks N/k consecutive padded primary shards, so the gathered buffer is the
primary gather's, byte for byte, and copy-out is unchanged: the values are exactly those of the
primary gather (for ``weight_quantization``, the forward's dequantized values: the backward then
differentiates the function the forward computed). Each rank holds, per parameter, 1/k of it in
the gather dtype from forward to backward (the memory budget and ``explain`` count it), instead
of the 1/N the backward would read from its primary shard; an offloaded parameter's backward
reads no store.

The edit runs on the partitioned graphs, before scheduling: a forward ``unshard`` marker of a
parameter the backward also gathers gets a ``zero3::secondary_slice`` reader, saved as one more
tensor checked for version changes (where AOTAutograd slices those, ``order_saved_values``); the
backward takes it as a placeholder at the matching position and its markers of that parameter
read it with the secondary spec. The lowering passes then see ordinary markers.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .._torch.aot_autograd import saved_value_group
from ..collectives.copy_ops import SECONDARY_SLICE
from ..collectives.ops import UNSHARD
from ..sharding.nodes import node_group, ranks_per_node
from .graph_utils import NodeFactory, node_order, output_node
from .markers import UnshardCall
from .options import Options


def keep_secondary_shards(
    fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, options: Options
) -> int:
    """Apply hpZ to a partition (see [Note: secondary shards]); returns how many parameters
    gained a secondary shard. A no-op unless ``options.secondary_shard`` is set."""
    if options.secondary_shard is None:
        return 0
    size = ranks_per_node(options.secondary_shard)
    forward = _markers(fw.graph)
    backward = _markers(bw.graph)
    order = node_order(fw.graph)
    output = output_node(fw.graph)
    outputs = list(output.args[0])
    saved = outputs[num_fwd_outputs:]
    syms = sum(1 for n in saved if saved_value_group(n) == 3)
    checked = sum(1 for n in saved if saved_value_group(n) == 0)
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[syms + checked] if syms + checked < len(placeholders) else None
    kept = 0
    for shard, markers in backward.items():
        if shard not in forward:
            continue
        primary = forward[shard][0]
        spec = UnshardCall.of(primary).spec
        if spec.world_size == 1 or spec.primary_size:
            continue
        node = node_group(spec.group, size)
        secondary = dataclasses.replace(
            spec,
            group=node.name,
            world_size=node.size,
            primary_size=spec.world_size,
            offloaded=False,
        )
        first_use = min(primary.users, key=order.__getitem__)
        with fw.graph.inserting_before(first_use):
            value = NodeFactory(fw.graph, source=primary)(
                SECONDARY_SLICE, primary, secondary.padded_numel, node.index
            )
        outputs.insert(num_fwd_outputs + checked + kept, value)
        if anchor is None:
            with bw.graph.inserting_after(placeholders[-1] if placeholders else None):
                taken = bw.graph.placeholder(f"secondary_{kept}")
            placeholders.append(taken)
        else:
            with bw.graph.inserting_before(anchor):
                taken = bw.graph.placeholder(f"secondary_{kept}")
        taken.meta["val"] = value.meta["val"]
        literal = secondary.literal()
        for marker in markers:
            call = UnshardCall.of(marker)
            with bw.graph.inserting_before(marker):
                read = bw.graph.call_function(
                    UNSHARD, (taken, call.param_id, literal, call.grad_sink)
                )
            read.meta.update(marker.meta)
            marker.replace_all_uses_with(read)
            bw.graph.erase_node(marker)
        kept += 1
    if kept:
        output.args = (tuple(outputs), *output.args[1:])
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
    return kept


def _markers(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """The ``unshard`` markers that something reads, in graph order, by the name of the node
    their shard is: one node of the joint graph, so the same name in the forward and in the
    backward (saved, or recomputed there). Not by the spec's name: a marker traced inside an
    activation-checkpointed region has none."""
    found: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is UNSHARD and node.users:
            shard = UnshardCall.of(node).shard
            if isinstance(shard, fx.Node):
                found.setdefault(shard.name, []).append(node)
    return found
