"""Collective schemes: how one bucket of shards becomes full parameters, and one bucket of full
gradients becomes gradient shards. One object per lowering (FSDP2's pluggable all-gather and
Inductor's traced bucket modes play this role).

A scheme is a sequence of steps, each one a call on an ``Emit``:

```
gather:  copy_in ─► issue ─► wait ─► copy_out                  (one stage)
reduce:  copy_in ─► issue[0] ─► wait[0] ─► issue[1] ─► wait[1] ─► ... ─► copy_out
```
The eager operations (``ops.py``) run the steps back to back on real tensors (``EAGER``); the
lowering passes run the same steps with an emitter that creates graph nodes, tagged with the
step's role, and place each step where the schedule wants it (issues early, waits late). So the
cast, copy-in, collective, copy-out and division exist once, for both.

- ``AllGather``: padded shards all-gathered over the shard group.
- ``QuantizedAllGather`` (ZeRO++'s qwZ): the bucket travels as blockwise integers and their
  scales (``quantize.py``), quantized after the copy-in, dequantized before the copy-out.
- ``SecondaryAllGather`` (ZeRO++'s hpZ): the backward's re-gather of the secondary shards the
  forward kept, over a node's ranks only (``compiler/secondary.py``).
- ``LocalCast``: one rank: the shard is the parameter, cast to the compute dtype.
- ``ReduceScatter``: a sum reduce-scatter over the shard group, then the division by N;
  ``HybridReduce`` adds a sum all-reduce of the reduced shards over the replicate group (hybrid
  sharding: the mean over every rank of the mesh).
- ``QuantizedReduceScatter`` (ZeRO++'s qgZ): each rank's N rows of the bucket quantized
  (stochastic rounding: the mean stays unbiased), sent to their owners with one all-to-all,
  dequantized and summed there (in the reduction dtype) with the owner's own row exact (it
  never crosses the wire); ``QuantizedHybridReduce`` sums the
  reduced shards across the replicas compressed too (a quantized all-to-all, then a quantized
  all-gather of the summed chunks); ``QuantizedNodeReduce``: a shard group across nodes sums
  exactly within each node first, and only the nodes' sums cross them, quantized.
- ``ReplicaReduce``: a mesh of N x 1: an all-reduce over the replicas (DDP's).
- ``LocalReduce``: one rank: only the dtype and the shape change.

``traced_copies`` (option ``fused_copies``): copy-in and copy-out as the ATen ops of
``arithmetic.py`` traced into the graph for Inductor to fuse, instead of the four fixed operations
of ``copy_ops.py``. Buckets only share a collective when their schemes' ``key`` is equal.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._torch.c10d import ALL_GATHER as ALL_GATHER_OP
from .._torch.c10d import ALL_REDUCE as ALL_REDUCE_OP
from .._torch.c10d import ALL_REDUCE_INPLACE as ALL_REDUCE_INPLACE_OP
from .._torch.c10d import ALL_TO_ALL as ALL_TO_ALL_OP
from .._torch.c10d import REDUCE_SCATTER as REDUCE_SCATTER_OP
from .._torch.c10d import WAIT, backend_of, group_rank
from ..sharding.nodes import across_nodes_group, node_group
from ..sharding.spec import ShardSpec
from . import arithmetic, copy_ops, roles
from .quantize import (
    Quantization,
    align_rows,
    aligned_numel,
    numel_of_payload,
    padded_numel,
    payload_bytes,
    unalign_rows,
)


class Emit:
    """Runs a scheme's steps now, on real tensors (``EAGER``). The lowering passes subclass it
    to create graph nodes instead (``in_graph``)."""

    in_graph = False

    def collective(
        self, role: str, group_role: str, target, *args, full_bytes: int | None = None
    ) -> Any:
        """Issue ``target(*args)``; ``full_bytes``: what it would carry uncompressed, for the
        reports (unset: its own bytes)."""
        return target(*args)

    def wait(self, role: str, work) -> Any:
        return WAIT(work)

    def traced(self, role: str, fn: Callable, inputs: Sequence[Any]) -> Any:
        return fn(*inputs)


EAGER = Emit()


def _fixed(emit: Emit, traced_copies: bool) -> bool:
    """Whether copy-in/copy-out go through the fixed operations (in graphs, unless fused)."""
    return emit.in_graph and not traced_copies


def _copy(emit: Emit, traced_copies: bool, fixed_op, traced: Callable, direct: Callable):
    """A copy-in: the fixed operation in graphs; the functional form where it is traced into
    them (``fused_copies``); on real tensors, the one-pass form that writes into one buffer."""
    if _fixed(emit, traced_copies):
        return fixed_op
    return traced if emit.in_graph else direct


# --------------------------------------------------------------------------- gathers


@dataclass(frozen=True)
class GatherScheme:
    dtype: torch.dtype  # on the wire (unless compressed) and of the full parameters

    communicates: ClassVar[bool] = True
    compresses: ClassVar[bool] = False  # the payload is smaller than the values it carries

    def key(self) -> tuple:
        return (type(self).__name__, self.dtype)

    def copy_in(self, emit: Emit, shards: Sequence[Any], specs: Sequence[ShardSpec]) -> list:
        raise NotImplementedError

    def issue(self, emit: Emit, payloads: list) -> list:
        raise NotImplementedError

    def wait(self, emit: Emit, works: list) -> list:
        raise NotImplementedError

    def copy_out(self, emit: Emit, waited: list, specs: Sequence[ShardSpec]) -> list:
        raise NotImplementedError


@dataclass(frozen=True)
class AllGather(GatherScheme):
    group: str = ""
    world_size: int = 1
    traced_copies: bool = False

    group_role: ClassVar[str] = roles.GROUP_SHARD

    def key(self) -> tuple:
        return (*super().key(), self.group, self.world_size, self.traced_copies)

    def copy_in(self, emit, shards, specs):
        sizes = arithmetic.sizes(specs)
        dtype = self.dtype
        copy = _copy(
            emit, self.traced_copies, copy_ops.GATHER_COPY_IN, arithmetic.gather_copy_in,
            arithmetic.gather_copy_in_direct,
        )  # fmt: skip

        def flat(*shards):
            return arithmetic.gather_input(shards, sizes, dtype, copy_in=copy)

        return [emit.traced(roles.GATHER_COPY_IN, flat, list(shards))]

    def issue(self, emit, payloads):
        (flat,) = payloads
        gathered = emit.collective(
            roles.ALL_GATHER, self.group_role, ALL_GATHER_OP, flat, self.world_size, self.group
        )
        return [gathered]

    def wait(self, emit, works):
        return [emit.wait(roles.GATHER_WAIT, work) for work in works]

    def copy_out(self, emit, waited, specs):
        (gathered,) = waited  # (world * bucket_numel,)
        fixed = _fixed(emit, self.traced_copies)
        parts = copy_ops.GATHER_COPY_OUT if fixed else arithmetic.gather_copy_out_parts
        specs = list(specs)

        def fulls(g):
            return arithmetic.gather_copy_out(g, specs, copy_parts=parts)

        return emit.traced(roles.GATHER_COPY_OUT, fulls, [gathered])


@dataclass(frozen=True)
class QuantizedAllGather(AllGather):
    """qwZ: the bucket's flat shard (this rank's ``bucket_numel`` elements) quantized into one
    ``uint8`` payload, all-gathered, and each rank's row dequantized into the gather dtype. Each
    member's part starts a new block (``quantize.align_rows``): a norm's weights near 1 never set
    the scale of a matrix's near 0.02."""

    quantization: Quantization = Quantization(8, 256)
    compresses: ClassVar[bool] = True

    def key(self) -> tuple:
        return (*super().key(), self.quantization)

    def copy_in(self, emit, shards, specs):
        (flat,) = super().copy_in(emit, shards, specs)
        block, bits = self.quantization.block, self.quantization.bits
        sizes = arithmetic.sizes(specs)

        def payload(flat):  # weights: to nearest; each member's part starts a new block
            row = align_rows(flat.view(1, -1), sizes, block)
            return copy_ops.QUANTIZE_ROWS(row, block, bits, False).view(-1)

        return [emit.traced(roles.GATHER_COPY_IN, payload, [flat])]

    def copy_out(self, emit, waited, specs):
        (gathered,) = waited  # (world * payload_bytes,) uint8
        sizes, world, dtype = arithmetic.sizes(specs), self.world_size, self.dtype
        block, bits = self.quantization.block, self.quantization.bits
        numel = aligned_numel(sizes, block)

        def values(gathered):  # (world * bucket_numel,): what an all-gather would have given
            rows = gathered.view(world, -1)
            rows = copy_ops.DEQUANTIZE_ROWS(rows, numel, block, bits, dtype)
            return unalign_rows(rows, sizes, block).reshape(-1)

        flat = emit.traced(roles.GATHER_COPY_OUT, values, [gathered])
        return super().copy_out(emit, [flat], specs)


@dataclass(frozen=True)
class SecondaryAllGather(AllGather):
    """hpZ: the backward's re-gather of secondary shards (``compiler/secondary.py``) over a
    node's ranks of the shard group; the gathered buffer is the primary gather's, so copy-in and
    copy-out are ``AllGather``'s with the node's world size."""

    group_role: ClassVar[str] = roles.GROUP_NODE


@dataclass(frozen=True)
class LocalCast(GatherScheme):
    """One rank: the shard is the full parameter; only the dtype may change."""

    communicates: ClassVar[bool] = False

    def copy_in(self, emit, shards, specs):
        def cast(shard):
            return arithmetic.single_rank_gather(shard, self.dtype)

        return [emit.traced(roles.GATHER_COPY_IN, cast, [shard]) for shard in shards]

    def issue(self, emit, payloads):
        return payloads

    def wait(self, emit, works):
        return works

    def copy_out(self, emit, waited, specs):
        return waited


def gather_scheme(
    spec: ShardSpec,
    shard_dtype: torch.dtype,
    *,
    traced_copies: bool = False,
    quantization: Quantization | None = None,
) -> GatherScheme:
    dtype = spec.gather_dtype(shard_dtype)
    if spec.world_size == 1:
        return LocalCast(dtype)
    if spec.primary_size:
        return SecondaryAllGather(dtype, spec.group, spec.world_size, traced_copies)
    if quantization is not None and dtype.is_floating_point:
        return QuantizedAllGather(dtype, spec.group, spec.world_size, traced_copies, quantization)
    return AllGather(dtype, spec.group, spec.world_size, traced_copies)


def run_gather(scheme: GatherScheme, emit: Emit, shards, specs) -> list:
    """Every step of a gather, back to back."""
    works = scheme.issue(emit, scheme.copy_in(emit, shards, specs))
    return scheme.copy_out(emit, scheme.wait(emit, works), specs)


# --------------------------------------------------------------------------- reductions


@dataclass(frozen=True)
class ReduceScheme:
    dtype: torch.dtype  # the gradients are summed in this dtype
    shard_dtype: torch.dtype  # the reduced shards are cast back to this one
    traced_copies: bool = False

    # (issue role, wait role) of each stage; a stage's collectives are waited before the next
    # stage issues
    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = ()
    compresses: ClassVar[bool] = False  # the payload is smaller than the values it carries

    def key(self) -> tuple:
        return (type(self).__name__, self.dtype, self.shard_dtype, self.traced_copies)

    @property
    def stages(self) -> int:
        return len(self.stage_roles)

    @property
    def divisor(self) -> int:
        """How many ranks summed each gradient: the mean divides by it."""
        return 1

    def copy_in(self, emit: Emit, grads, specs) -> list:
        sizes = arithmetic.sizes(specs)
        world, dtype = self._copy_in_world(), self.dtype
        copy = _copy(
            emit, self.traced_copies, copy_ops.REDUCE_COPY_IN, arithmetic.reduce_copy_in,
            arithmetic.reduce_copy_in_direct,
        )  # fmt: skip

        owned = self._reduces_in_place

        def flat(*grads):
            return arithmetic.reduce_input(grads, world, sizes, dtype, copy_in=copy, owned=owned)

        return [emit.traced(roles.REDUCE_COPY_IN, flat, list(grads))]

    def _copy_in_world(self) -> int:
        return 1

    @property
    def _reduces_in_place(self) -> bool:
        """The first collective writes into the copy-in's buffer, which must then be its own (never
        a view of a gradient)."""
        return False

    def issue(self, emit: Emit, stage: int, payloads: list, specs) -> list:
        """Stage ``stage``'s collectives (``specs``: the bucket's members)."""
        raise NotImplementedError

    def wait(self, emit: Emit, stage: int, works: list) -> list:
        role = self.stage_roles[stage][1]
        return [emit.wait(role, work) for work in works]

    def copy_out(self, emit: Emit, reduced: list, specs, shard_shapes) -> list:
        (flat,) = reduced  # (bucket_numel,): this rank's rows of every gradient, summed
        sizes = arithmetic.sizes(specs)
        shapes = [list(s) for s in shard_shapes]
        numels = [math.prod(s) for s in shapes]
        divisor, dtype = self.divisor, self.shard_dtype
        fixed = _fixed(emit, self.traced_copies)
        copy = arithmetic.reduce_copy_out if emit.in_graph else arithmetic.reduce_copy_out_direct

        def shards(r):
            if fixed:
                flats = copy_ops.REDUCE_COPY_OUT(r, sizes, numels, divisor, dtype)
            else:
                flats = copy(r, sizes, numels, divisor, [dtype] * len(sizes))
            return [x.view(shape) for x, shape in zip(flats, shapes)]

        return emit.traced(roles.REDUCE_COPY_OUT, shards, [flat])


@dataclass(frozen=True)
class ReduceScatter(ReduceScheme):
    group: str = ""
    world_size: int = 1
    # ``rank`` set: the bucket is summed with an in-place all-reduce of the copy-in's buffer and
    # this rank's rows are taken in the copy-out (gloo groups: gloo's reduce-scatter all-reduces a
    # copy of the whole input, see ``gloo_reduce_scatter_as_all_reduce``)
    rank: int | None = None
    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = (
        (roles.REDUCE_SCATTER, roles.REDUCE_WAIT),
    )

    def key(self) -> tuple:
        return (*super().key(), self.group, self.world_size, self.rank)

    @property
    def divisor(self) -> int:
        return self.world_size

    def _copy_in_world(self) -> int:
        return self.world_size

    @property
    def _reduces_in_place(self) -> bool:
        return self.rank is not None

    def issue(self, emit, stage, payloads, specs):
        (flat,) = payloads
        if self.rank is not None:
            work = emit.collective(
                roles.REDUCE_SCATTER,
                roles.GROUP_SHARD,
                ALL_REDUCE_INPLACE_OP,
                flat,
                "sum",
                self.group,
            )
            return [work]
        work = emit.collective(
            roles.REDUCE_SCATTER,
            roles.GROUP_SHARD,
            REDUCE_SCATTER_OP,
            flat,
            "sum",
            self.world_size,
            self.group,
        )
        return [work]

    def copy_out(self, emit, reduced, specs, shard_shapes):
        if self.rank is None:
            return super().copy_out(emit, reduced, specs, shard_shapes)
        return super().copy_out(emit, self._own_rows(emit, reduced), specs, shard_shapes)

    def _own_rows(self, emit, reduced) -> list:
        (summed,) = reduced  # (N * bucket_numel,): every rank's rows, summed
        rank, world = self.rank, self.world_size

        def rows(summed):
            size = summed.shape[0] // world
            return summed.narrow(0, rank * size, size)

        return [emit.traced(roles.REDUCE_COPY_OUT, rows, [summed])]


@dataclass(frozen=True)
class QuantizedReduceScatter(ReduceScatter):
    """qgZ: the bucket's ``(world, bucket_numel)`` rows (row r: what rank r keeps) quantized row
    by row, exchanged with one all-to-all (rank r receives every rank's row r), then dequantized
    and summed in the reduction dtype; the copy-out divides by N as a reduce-scatter's does.

    Each member's part of a row starts a new block (``quantize.align_rows``): a block's scale is
    its own parameter's largest value, never a neighbour's (a norm's small gradients beside a
    matrix's would otherwise round to noise). Parts that are whole blocks, as large models'
    are, cost nothing; the tail of a part that is not travels padded.

    ``own_rank`` set (this rank's index in the shard group): its own row never crosses the wire,
    so it is summed exactly, kept from the copy-in beside the payload (1/N of the bucket), and
    only the other N - 1 contributions carry quantization noise (on 2 ranks, half the
    variance, for no byte more). None (a graph read without its process group): every row is
    summed as received."""

    quantization: Quantization = Quantization(8, 256)
    own_rank: int | None = None
    compresses: ClassVar[bool] = True

    def key(self) -> tuple:
        return (*super().key(), self.quantization, self.own_rank)

    def copy_in(self, emit, grads, specs):
        (flat,) = super().copy_in(emit, grads, specs)  # (world * bucket_numel,)
        world, block, bits = self.world_size, self.quantization.block, self.quantization.bits
        sizes = arithmetic.sizes(specs)

        def payload(flat):  # gradients: stochastically, so the mean stays unbiased
            rows = align_rows(flat.view(world, -1), sizes, block)
            return copy_ops.QUANTIZE_ROWS(rows, block, bits, True).view(-1)

        payloads = [emit.traced(roles.REDUCE_COPY_IN, payload, [flat])]
        if self.own_rank is not None:
            rank = self.own_rank

            def own(flat):  # a copy: the copy-in's whole buffer is not kept for it
                row = flat.view(world, -1)[rank : rank + 1]
                return align_rows(row, sizes, block).view(-1).clone()

            payloads.append(emit.traced(roles.REDUCE_COPY_IN, own, [flat]))
        return payloads

    def issue(self, emit, stage, payloads, specs):
        payload, *own = payloads  # (world * payload_bytes,) uint8; this rank's exact row
        value = payload.meta["val"] if emit.in_graph else payload
        rows = [value.shape[0] // self.world_size] * self.world_size  # bytes to and from each
        work = emit.collective(
            roles.REDUCE_SCATTER, roles.GROUP_SHARD, ALL_TO_ALL_OP, payload, rows, rows, self.group
        )
        return [work, *own]

    def wait(self, emit, stage, works):
        if stage > 0:
            return super().wait(emit, stage, works)
        work, *own = works  # the exact row is a value, not a collective
        return [emit.wait(self.stage_roles[0][1], work), *own]

    def _exchange(self) -> tuple[int, int | None]:
        """(ranks, this rank's index) of the quantized all-to-all."""
        return self.world_size, self.own_rank

    def _summed_fn(self):
        """(received, [own]) -> their sum (aligned_numel,) in the reduction dtype, the row's
        members still aligned to blocks; received (ranks * payload_bytes,): every rank's
        quantized row of ours; own: our exact row, aligned, in place of its quantized copy."""
        (world, rank), dtype = self._exchange(), self.dtype
        block, bits = self.quantization.block, self.quantization.bits

        def summed(received, *own):
            rows = received.view(world, -1)
            numel = numel_of_payload(rows.shape[1], block, bits)  # aligned: the padding is 0
            values = copy_ops.DEQUANTIZE_ROWS(rows, numel, block, bits, dtype)  # a new tensor
            if own:
                (exact,) = own  # (aligned_numel,); its padding is 0 as the payload's
                values[rank, : exact.shape[0]] = exact
            return values.sum(dim=0)

        return summed

    def copy_out(self, emit, reduced, specs, shard_shapes):
        sizes, block = arithmetic.sizes(specs), self.quantization.block
        summed_fn = self._summed_fn()

        def values(*reduced):
            summed = summed_fn(*reduced)
            return unalign_rows(summed.view(1, -1), sizes, block).view(-1)

        flat = emit.traced(roles.REDUCE_COPY_OUT, values, list(reduced))
        return ReduceScheme.copy_out(self, emit, [flat], specs, shard_shapes)


@dataclass(frozen=True)
class QuantizedNodeReduce(QuantizedReduceScatter):
    """qgZ on a shard group that spans nodes of ``node_size`` ranks (ZeRO++'s hierarchical
    reduction, its first level exact): the bucket's rows are summed within the node in the
    reduction dtype (a reduce-scatter over the node group; stage 0), each rank keeping the sums
    for its own index on every node; those ``nodes`` rows are then quantized, exchanged across
    the nodes with one all-to-all among the ranks of that index, and dequantized and summed by
    their owners, each its own node's row exact (stage 1). Rank ``r = n * k + j`` (node ``n``,
    index ``j``, ``k = node_size``):

    ```
    copy-in:  rows (N, B) -> (k, nodes, B)        row (j, n): what rank (n, j) keeps
    node:     reduce_scatter, node group ─► (nodes, B): row n the node's sum for rank (n, j)
    across:   all_to_all(q(rows)), ranks j ─► sum(dq, own) = s     (B,)
    ```

    The bytes that cross nodes are ``1 / k`` of the flat exchange's; within the node (links an
    order of magnitude faster: NVLink beside one NIC per GPU) the bucket travels uncompressed.
    Each other node's sum is rounded once (its scale that sum's), where the flat exchange rounds
    each other rank's row: on real gradients the error of the mean is about the flat one's
    (``bench/reduction_error.py``: -13% to +18% once training is under way, up to 1.5x at
    initialisation, where every rank's gradients agree), while rounding within the node as well
    (ZeRO++'s two quantized levels) adds 20-40%.

    ``node_rank`` set (gloo, see ``ReduceScatter.rank``): stage 0 is an in-place all-reduce over
    the node group, this rank's ``(nodes, B)`` taken after it. ``own_node``: this rank's node
    (its index in the across group); None: a graph read without its process groups."""

    node_group: str = ""
    node_size: int = 1
    node_rank: int | None = None
    across_group: str = ""
    own_node: int | None = None
    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = (
        (roles.REDUCE_SCATTER, roles.REDUCE_WAIT),
        (roles.REDUCE_SCATTER, roles.REDUCE_WAIT),
    )

    def key(self) -> tuple:
        node = (self.node_group, self.node_size, self.node_rank, self.across_group)
        return (*super().key(), *node, self.own_node)

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def _exchange(self) -> tuple[int, int | None]:
        return self.nodes, self.own_node

    @property
    def _reduces_in_place(self) -> bool:
        return False  # stage 0 reads the regrouped copy, never the copy-in's buffer

    def copy_in(self, emit, grads, specs):
        (flat,) = ReduceScheme.copy_in(self, emit, grads, specs)  # (N * B,)
        nodes, size = self.nodes, self.node_size

        def by_index(flat):  # (nodes, k, B) -> (k, nodes, B): each index's rows together
            # permute, not transpose: the graph is ATen, and Inductor lowers no transpose.int
            return flat.view(nodes, size, -1).permute(1, 0, 2).contiguous().view(-1)

        return [emit.traced(roles.REDUCE_COPY_IN, by_index, [flat])]

    def issue(self, emit, stage, payloads, specs):
        if stage == 0:
            (flat,) = payloads
            if self.node_rank is not None:
                args = (ALL_REDUCE_INPLACE_OP, flat, "sum", self.node_group)
            else:
                args = (REDUCE_SCATTER_OP, flat, "sum", self.node_size, self.node_group)
            return [emit.collective(roles.REDUCE_SCATTER, roles.GROUP_NODE, *args)]
        (summed,) = payloads  # the node's sums: (nodes, B), or every index's (gloo)
        nodes, size, index, mine = self.nodes, self.node_size, self.node_rank, self.own_node
        block, bits, sizes = (
            self.quantization.block,
            self.quantization.bits,
            arithmetic.sizes(specs),
        )

        def payload(summed):
            if index is not None:  # an all-reduce's: this rank's index's rows of it
                part = summed.shape[0] // size
                summed = summed.narrow(0, index * part, part)
            rows = align_rows(summed.view(nodes, -1), sizes, block)
            quantized = copy_ops.QUANTIZE_ROWS(rows, block, bits, True).view(-1)
            return [quantized] if mine is None else [quantized, rows[mine].clone()]

        quantized, *own = emit.traced(roles.REDUCE_COPY_OUT, payload, [summed])
        value = quantized.meta["val"] if emit.in_graph else quantized
        splits = [value.shape[0] // nodes] * nodes
        work = emit.collective(
            roles.REDUCE_SCATTER,
            roles.GROUP_ACROSS_NODES,
            ALL_TO_ALL_OP,
            quantized,
            splits,
            splits,
            self.across_group,
            # uncompressed: the node's sums of the rows of this index
            full_bytes=nodes * sum(sizes) * self.dtype.itemsize,
        )
        return [work, *own]

    def wait(self, emit, stage, works):
        work, *own = works  # the exact row is a value, not a collective
        return [emit.wait(self.stage_roles[stage][1], work), *own]


@dataclass(frozen=True)
class _AcrossReplicas:
    """The second stage of hybrid sharding's reduction: the reduced shards summed across the
    replicas (an all-reduce over the replicate group); the mean divides by every rank."""

    replicate_group: str = ""
    replicate_size: int = 1
    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = (
        (roles.REDUCE_SCATTER, roles.REDUCE_WAIT),
        (roles.REPLICA_ALL_REDUCE, roles.REPLICA_WAIT),
    )

    def key(self) -> tuple:
        return (*super().key(), self.replicate_group, self.replicate_size)

    @property
    def divisor(self) -> int:
        return self.world_size * self.replicate_size

    def _across_replicas(self, emit, flat) -> list:
        work = emit.collective(
            roles.REPLICA_ALL_REDUCE,
            roles.GROUP_REPLICATE,
            ALL_REDUCE_OP,
            flat,
            "sum",
            self.replicate_group,
        )
        return [work]

    def copy_out(self, emit, reduced, specs, shard_shapes):
        # this rank's rows were taken (or summed) before the replica stage
        return ReduceScheme.copy_out(self, emit, reduced, specs, shard_shapes)


@dataclass(frozen=True)
class QuantizedHybridReduce(_AcrossReplicas, QuantizedReduceScatter):
    """Hybrid sharding with qgZ, compressed on both levels (ZeRO++'s hierarchical reduction):
    the quantized exchange within the row, its rows dequantized and summed (stage 0); then, across
    the replicas, the summed shard cut into ``replicate_size`` chunks, quantized and exchanged
    with one all-to-all, each chunk summed by its owner (stage 1), and the summed chunks quantized
    once more and all-gathered (stage 2). Every replica dequantizes the same gathered payloads,
    so the replicas' shards stay identical; both roundings are stochastic (unbiased).

    ``own_replica`` set (this rank's index in the replicate group): as the row's own row in
    stage 0, its own chunk of stage 1 never crosses the wire: kept exact beside the payload and
    summed in place of its quantized copy, so of the replicas' contributions only the other
    ``replicate_size - 1`` carry that stage's noise. Stage 2's quantized sum cannot be kept
    exact: every replica must read the same values.

    ```
    row:       all_to_all(q(rows)) ─► sum(dq, own) = s     (bucket_numel,)      shard group
    replicas:  all_to_all(q(chunks of s)) ─► sum(dq) = c   (chunk,)             replicate group
               all_gather(q(c)) ─► dq, concatenated        (bucket_numel,)      replicate group
    ```
    """

    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = (
        (roles.REDUCE_SCATTER, roles.REDUCE_WAIT),
        (roles.REPLICA_ALL_REDUCE, roles.REPLICA_WAIT),
        (roles.REPLICA_ALL_REDUCE, roles.REPLICA_WAIT),
    )

    own_replica: int | None = None

    def key(self) -> tuple:
        return (*super().key(), self.own_replica)

    def _chunk(self, summed_numel: int) -> int:
        """Elements of each replica's chunk of a summed shard of ``summed_numel``: whole blocks."""
        return padded_numel(-(-summed_numel // self.replicate_size), self.quantization.block)

    def wait(self, emit, stage, works):
        work, *own = works  # an exact row or chunk is a value, not a collective
        return [emit.wait(self.stage_roles[stage][1], work), *own]

    def issue(self, emit, stage, payloads, specs):
        if stage == 0:
            return super().issue(emit, stage, payloads, specs)
        replicas, dtype, mine = self.replicate_size, self.dtype, self.own_replica
        block, bits = self.quantization.block, self.quantization.bits
        received, *own = payloads  # stage 1: and this rank's exact row (``own_rank``)
        value = received.meta["val"] if emit.in_graph else received
        if stage == 1:  # received: every row rank's quantized rows of ours
            summed_numel = numel_of_payload(value.shape[0] // self.world_size, block, bits)
            chunk = self._chunk(summed_numel)
            summed_fn = self._summed_fn()

            def chunks(received, *own):
                summed = summed_fn(received, *own)
                summed = torch.nn.functional.pad(summed, (0, replicas * chunk - summed.shape[0]))
                rows = summed.view(replicas, chunk)
                payload = copy_ops.QUANTIZE_ROWS(rows, block, bits, True).view(-1)
                if mine is None:
                    return [payload]
                return [payload, rows[mine].clone()]  # our own chunk, exact

            payload, *mine_exact = emit.traced(roles.REDUCE_COPY_OUT, chunks, [received, *own])
            splits = [payload_bytes(chunk, block, bits)] * replicas
            work = emit.collective(
                roles.REPLICA_ALL_REDUCE,
                roles.GROUP_REPLICATE,
                ALL_TO_ALL_OP,
                payload,
                splits,
                splits,
                self.replicate_group,
                # the uncompressed all-reduce's: the summed row, not its aligned blocks
                full_bytes=sum(arithmetic.sizes(specs)) * dtype.itemsize,
            )
            return [work, *mine_exact]
        # stage 2; received: every replica's quantized chunk of ours; own: ours, exact
        chunk = numel_of_payload(value.shape[0] // replicas, block, bits)

        def requantized(received, *own):
            rows = copy_ops.DEQUANTIZE_ROWS(received.view(replicas, -1), chunk, block, bits, dtype)
            if own:
                rows[mine] = own[0]
            return copy_ops.QUANTIZE_ROWS(rows.sum(dim=0, keepdim=True), block, bits, True).view(-1)

        payload = emit.traced(roles.REDUCE_COPY_OUT, requantized, [received, *own])
        work = emit.collective(
            roles.REPLICA_ALL_REDUCE,
            roles.GROUP_REPLICATE,
            ALL_GATHER_OP,
            payload,
            replicas,
            self.replicate_group,
            full_bytes=0,  # counted with the all-to-all before it
        )
        return [work]

    def copy_out(self, emit, reduced, specs, shard_shapes):
        (gathered,) = reduced  # (replicas * chunk_payload,): every replica's summed chunk
        block, bits = self.quantization.block, self.quantization.bits
        sizes = arithmetic.sizes(specs)
        summed_numel = aligned_numel(sizes, block)
        chunk, replicas, dtype = self._chunk(summed_numel), self.replicate_size, self.dtype

        def values(gathered):
            rows = gathered.view(replicas, -1)
            rows = copy_ops.DEQUANTIZE_ROWS(rows, chunk, block, bits, dtype)
            summed = rows.view(1, -1)[:, :summed_numel]
            return unalign_rows(summed, sizes, block).view(-1)

        flat = emit.traced(roles.REDUCE_COPY_OUT, values, [gathered])
        return ReduceScheme.copy_out(self, emit, [flat], specs, shard_shapes)


@dataclass(frozen=True)
class HybridReduce(_AcrossReplicas, ReduceScatter):
    """Reduce-scatter within the row, then the reduced shards summed across the replicas."""

    def issue(self, emit, stage, payloads, specs):
        if stage == 0:
            return super().issue(emit, stage, payloads, specs)
        (flat,) = payloads
        if self.rank is not None:
            # stage 0 was an all-reduce: keep this rank's rows before summing across replicas
            (flat,) = self._own_rows(emit, payloads)
        return self._across_replicas(emit, flat)


@dataclass(frozen=True)
class ReplicaReduce(ReduceScheme):
    """A mesh of N x 1: parameters are replicated, not sharded: an all-reduce (DDP's)."""

    replicate_group: str = ""
    replicate_size: int = 1
    stage_roles: ClassVar[tuple[tuple[str, str], ...]] = (
        (roles.REPLICA_ALL_REDUCE, roles.REDUCE_WAIT),
    )

    def key(self) -> tuple:
        return (*super().key(), self.replicate_group, self.replicate_size)

    @property
    def divisor(self) -> int:
        return self.replicate_size

    def issue(self, emit, stage, payloads, specs):
        (flat,) = payloads
        work = emit.collective(
            roles.REPLICA_ALL_REDUCE,
            roles.GROUP_REPLICATE,
            ALL_REDUCE_OP,
            flat,
            "sum",
            self.replicate_group,
        )
        return [work]


@dataclass(frozen=True)
class LocalReduce(ReduceScheme):
    """One rank: the gradient already is the mean; only dtypes and the shape change."""

    def copy_in(self, emit, grads, specs):
        return list(grads)

    def copy_out(self, emit, reduced, specs, shard_shapes):
        def shard_of(shape):
            def shard(grad):
                return arithmetic.single_rank_reduce(grad, self.dtype, shape, self.shard_dtype)

            return shard

        return [
            emit.traced(roles.REDUCE_COPY_OUT, shard_of(list(shape)), [grad])
            for grad, shape in zip(reduced, shard_shapes)
        ]


def reduce_scheme(
    spec: ShardSpec,
    grad_dtype: torch.dtype,
    shard_dtype: torch.dtype,
    *,
    traced_copies: bool = False,
    quantization: Quantization | None = None,
    node_size: int | None = None,
) -> ReduceScheme:
    """How ``spec``'s gradients are reduced; ``node_size``: the shard group's ranks per node
    where a quantized reduction is to sum within each node first (``QuantizedNodeReduce``)."""
    dtype = spec.reduce_dtype or grad_dtype
    if quantization is not None and spec.world_size > 1:
        row = {
            "group": spec.group,
            "world_size": spec.world_size,
            "quantization": quantization,
            "own_rank": group_rank(spec.group),
        }
        if node_size is not None and spec.replicate_size == 1:
            node = node_group(spec.group, node_size)
            across = across_nodes_group(spec.group, node_size)
            nodes = {
                "node_group": node.name,
                "node_size": node_size,
                "node_rank": gloo_reduce_scatter_as_all_reduce(node.name),
                "across_group": across.name,
                "own_node": across.index,
            }
            return QuantizedNodeReduce(dtype, shard_dtype, traced_copies, **row, **nodes)
        if spec.replicate_size > 1:
            replicas = {
                "replicate_group": spec.replicate_group,
                "replicate_size": spec.replicate_size,
                "own_replica": group_rank(spec.replicate_group),
            }
            return QuantizedHybridReduce(dtype, shard_dtype, traced_copies, **row, **replicas)
        return QuantizedReduceScatter(dtype, shard_dtype, traced_copies, **row)
    if spec.world_size == 1 and spec.replicate_size == 1:
        return LocalReduce(dtype, shard_dtype)
    if spec.world_size == 1:
        return ReplicaReduce(
            dtype,
            shard_dtype,
            traced_copies,
            replicate_group=spec.replicate_group,
            replicate_size=spec.replicate_size,
        )
    if spec.replicate_size > 1:
        return HybridReduce(
            dtype,
            shard_dtype,
            traced_copies,
            group=spec.group,
            world_size=spec.world_size,
            replicate_group=spec.replicate_group,
            replicate_size=spec.replicate_size,
            rank=gloo_reduce_scatter_as_all_reduce(spec.group),
        )
    return ReduceScatter(
        dtype,
        shard_dtype,
        traced_copies,
        group=spec.group,
        world_size=spec.world_size,
        rank=gloo_reduce_scatter_as_all_reduce(spec.group),
    )


def run_reduce(scheme: ReduceScheme, emit: Emit, grads, specs, shard_shapes) -> list:
    """Every step of a reduction, back to back."""
    payloads = scheme.copy_in(emit, grads, specs)
    for stage in range(scheme.stages):
        payloads = scheme.wait(emit, stage, scheme.issue(emit, stage, payloads, specs))
    return scheme.copy_out(emit, payloads, specs, shard_shapes)


def gloo_reduce_scatter_as_all_reduce(group_name: str) -> int | None:
    """This rank's index in ``group_name`` where its reduce-scatters are to be issued as in-place
    all-reduces of the copy-in's buffer (the caller keeps its own rows), else None: on gloo
    groups, unless ``ZERO3_GLOO_REDUCE_SCATTER=1``.

    gloo has no reduce-scatter of its own: its ``reduce_scatter_tensor`` all-reduces a copy of
    the whole input. The same all-reduce issued in place on the buffer the copy-in made moves
    the same bytes without that second full-size copy (1.5 GB for the tied embedding of a 3B
    Llama). ``ZERO3_GLOO_REDUCE_SCATTER=1`` issues gloo's own reduce-scatter, for comparisons.

    History: the heap corruptions of our soak runs on torch 2.14 were first blamed on gloo's
    reduce-scatter; ``bench/repros/gloo_reduce_scatter_race.py`` showed the trigger is any
    collectives in flight together, all-reduces too; the cure is ``passes/serialize.py`` (one
    gloo collective in flight).
    """
    choice = os.environ.get("ZERO3_GLOO_REDUCE_SCATTER", "")
    if choice not in ("", "0", "1"):
        raise ValueError(
            f"ZERO3_GLOO_REDUCE_SCATTER={choice!r}: use 1 (gloo's own reduce-scatter), 0 or leave "
            "it unset (an in-place all-reduce of the copy-in's buffer)"
        )
    if choice == "1" or backend_of(group_name) != "gloo":
        return None
    return group_rank(group_name)
