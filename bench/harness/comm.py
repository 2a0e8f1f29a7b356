"""Collectives per training step, by kind, and what they cost on a ring.

Two sources:

* ``from_profile``: the ``c10d::`` operator events of a ``torch.profiler`` run with
  ``record_shapes=True``. Every path into a process group (DDP's C++ reducer, FSDP2,
  DeepSpeed, functional collectives) goes through these dispatcher operators, so this works
  for every contender. Nested ``c10d::`` events are counted once (the outermost).
* ``from_graphs``: the collectives zero3 compiled into its forward and backward graphs
  (``zero3_compile.compiler.signature.collective_signature``).

Bytes are logical: the full tensor of the operation (an all-gather's gathered output, a
reduce-scatter's unreduced input, an all-reduce's tensor). gloo has no native reduce-scatter and
runs an all-reduce of the whole input underneath, so its wire traffic is higher than NCCL's;
the tables report the logical operation. "Ring bytes" convert to what one rank sends on a ring:
(N-1)/N of the full tensor for all-gather, reduce-scatter and broadcast, twice that for
all-reduce; the ZeRO-3 ideal is 3 psi (N-1)/N (two all-gathers and one reduce-scatter of the
parameters, psi = parameter bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

# c10d operator -> (kind, index of the argument holding the full tensor(s))
_C10D_OPS: dict[str, tuple[str, int]] = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
}
_IGNORED = {"c10d::barrier", "c10d::monitored_barrier_"}
RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0, "all_reduce": 2.0}


def _metadata_bytes(value) -> int:
    """Bytes of a recorded argument: a tensor's metadata or (nested) lists of them."""
    if isinstance(value, (list, tuple)):
        return sum(_metadata_bytes(v) for v in value)
    sizes = getattr(value, "sizes", None)
    dtype = getattr(value, "dtype", None)
    if sizes is None or not isinstance(dtype, torch.dtype):
        return 0
    numel = 1
    for size in sizes:
        numel *= size
    return numel * dtype.itemsize


def from_profile(prof: torch.profiler.profile) -> list[tuple[str, int]]:
    """(kind, logical bytes) of every collective in the profiled region, in issue order."""
    from torch._C._profiler import _EventType

    found: list[tuple[int, str, int]] = []
    pending = [(event, False) for event in prof.profiler.kineto_results.experimental_event_tree()]
    while pending:
        event, inside_c10d = pending.pop()
        is_c10d = event.typed[0] == _EventType.TorchOp and event.name.startswith("c10d::")
        if is_c10d and not inside_c10d and event.name not in _IGNORED:
            kind, arg = _C10D_OPS.get(event.name, (event.name, 0))
            inputs = event.typed[1].inputs
            size = _metadata_bytes(inputs[arg]) if arg < len(inputs) else 0
            found.append((event.start_time_ns, kind, size))
        pending.extend((child, inside_c10d or is_c10d) for child in event.children)
    return [(kind, size) for _, kind, size in sorted(found)]


def from_graphs(records: Iterable) -> list[tuple[str, int]]:
    """(kind, logical bytes) of the collectives in zero3's compiled forward/backward graphs."""
    from zero3_compile.compiler.signature import collective_signature

    found = []
    for record in records:
        if record.kind not in ("forward", "backward"):
            continue
        for kind, _group, world, numel, dtype in collective_signature(record.gm.graph):
            itemsize = getattr(torch, dtype.split(".")[-1]).itemsize
            if kind == "all_gather":
                found.append(("all_gather", numel * world * itemsize))  # numel is the shard
            else:
                found.append(("reduce_scatter", numel * itemsize))  # the full padded bucket
    return found


def summarize(collectives: list[tuple[str, int]], world: int) -> dict:
    """Counts and logical bytes by kind, and the bytes one rank sends on a ring."""
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for kind, size in collectives:
        counts[kind] += 1
        sizes[kind] += size
    share = (world - 1) / world if world > 1 else 0.0
    ring = sum(RING_FACTOR.get(kind, 1.0) * share * size for kind, size in sizes.items())
    return {
        "by_kind": {k: {"count": counts[k], "bytes": sizes[k]} for k in sorted(counts)},
        "count": sum(counts.values()),
        "ring_bytes_per_rank": int(ring),
    }


def zero3_ideal_ring_bytes(param_bytes: int, world: int) -> int:
    """3 psi (N-1)/N: all-gather in forward and backward, reduce-scatter of the gradients."""
    return int(3 * param_bytes * (world - 1) / world) if world > 1 else 0
