"""The operations every sharded parameter goes through.

``zero3::unshard(shard, <marker fields>, grad_sink=None) -> full`` is what reading
``module.weight`` calls. Its backward is ``zero3::reduce_grad(full_grad, <marker fields>,
shard_shape, shard_dtype) -> shard_grad``: a reduce-scatter averaged over ranks (data-parallel
semantics, as DDP and FSDP2).

Both are real operations: run eagerly they issue the collective at once (after the cross-rank
check of ``guard.py``), so a model is correct without the compiler and between graph breaks.
Under ``torch.compile`` they appear in the traced graph as single nodes; the backend's passes then
replace them by bucketed functional collectives, spliced in from the same arithmetic
(``arithmetic.py``). Their fake implementations give the full / shard shape.

``zero3::guard`` is the cross-rank check a scheduled graph runs before its first collective.
``unshard_many`` gathers a leaf module's parameters together, eagerly (``set_leaf_modules``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import arithmetic, guard
from .compat import (
    all_gather,
    all_reduce_sum,
    mark_side_effect,
    reduce_scatter_sum,
    register_wait,
)
from .offload.params import readable, reload_async
from .param import NUM_MARKER_FIELDS, MarkerArgs, marker_schema, marker_tuple

UNSHARD_SCHEMA = marker_schema("Tensor shard", "Tensor? grad_sink=None", "Tensor")
REDUCE_GRAD_SCHEMA = marker_schema(
    "Tensor grad", "SymInt[] shard_shape, ScalarType shard_dtype", "Tensor"
)


def _split(values: Sequence) -> tuple[MarkerArgs, list]:
    return MarkerArgs.decode(values[:NUM_MARKER_FIELDS]), list(values[NUM_MARKER_FIELDS:])


@torch.library.custom_op("zero3::unshard", mutates_args=(), schema=UNSHARD_SCHEMA)
def unshard(shard: torch.Tensor, *rest) -> torch.Tensor:
    """All-gather ``shard`` (this rank's dim-0 chunk) into the full parameter.

    The cast to ``param_dtype`` happens on the shard, before the collective, so mixed
    precision halves the bytes on the wire. ``grad_sink``: see ``accumulation.py``.
    """
    args, _ = _split(rest)
    dtype = arithmetic.gather_dtype(shard.dtype, args.param_dtype)
    if args.world_size == 1:
        return _not_aliasing(arithmetic.single_rank_gather(readable(shard), dtype), shard)
    guard.check(args.group_name, guard.KIND_EAGER_GATHER, args.param_id, repr(args.fqn))
    flat = arithmetic.gather_input([readable(shard)], [args.layout.padded_numel], dtype)
    gathered = all_gather(flat, args.world_size, args.group_name)
    return arithmetic.gather_copy_out(gathered, [args.layout])[0]


@unshard.register_fake
def _unshard_fake(shard: torch.Tensor, *rest) -> torch.Tensor:
    args, _ = _split(rest)
    dtype = arithmetic.gather_dtype(shard.dtype, args.param_dtype)
    return shard.new_empty(tuple(args.full_shape), dtype=dtype)


@torch.library.custom_op("zero3::reduce_grad", mutates_args=(), schema=REDUCE_GRAD_SCHEMA)
def reduce_grad(grad: torch.Tensor, *rest) -> torch.Tensor:
    """Reduce-scatter the full gradient ``grad``; return this rank's shard of the mean."""
    args, (shard_shape, shard_dtype) = _split(rest)
    dtype = args.reduce_dtype or grad.dtype
    if args.world_size == 1 and args.replicate_size == 1:
        out = arithmetic.single_rank_reduce(grad, dtype, shard_shape, shard_dtype)
        return _not_aliasing(out, grad)
    if args.world_size == 1:  # replicated, not sharded (a 4x1 mesh): DDP's all-reduce
        guard.check(args.group_name, guard.KIND_EAGER_REDUCE, args.param_id, repr(args.fqn))
        full = all_reduce_sum(arithmetic.cast(grad, dtype).contiguous(), args.replicate_group)
        return arithmetic.single_rank_reduce(
            full / args.replicate_size, dtype, shard_shape, shard_dtype
        )
    guard.check(args.group_name, guard.KIND_EAGER_REDUCE, args.param_id, repr(args.fqn))
    flat = arithmetic.reduce_input([grad], args.world_size, [args.layout.padded_numel], dtype)
    reduced = reduce_scatter_sum(flat, args.world_size, args.group_name)
    if args.replicate_size > 1:  # hybrid sharding: the shard's sum over the replicas too
        reduced = all_reduce_sum(reduced, args.replicate_group)
    (out,) = arithmetic.reduce_copy_out(
        reduced,
        [args.layout.padded_numel],
        [math.prod(shard_shape)],
        args.world_size * args.replicate_size,
        [shard_dtype],
    )
    return out.view(shard_shape)


@reduce_grad.register_fake
def _reduce_grad_fake(grad: torch.Tensor, *rest) -> torch.Tensor:
    _, (shard_shape, shard_dtype) = _split(rest)
    return grad.new_empty(tuple(shard_shape), dtype=shard_dtype)


def _not_aliasing(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A custom op may not return (a view of) its input."""
    if out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return out.clone()
    return out


def _setup_context(ctx, inputs, output):
    shard, *rest = inputs
    args, (grad_sink,) = _split(rest)
    ctx.args = args
    ctx.shard_shape = list(shard.shape)
    ctx.shard_dtype = shard.dtype
    ctx.sink_dtype = None if grad_sink is None else grad_sink.dtype


def _backward(ctx, grad):
    nones = (None,) * NUM_MARKER_FIELDS
    if ctx.sink_dtype is not None:  # accumulating without synchronisation: no collective
        return (None, *nones, grad.to(ctx.sink_dtype))
    shard_grad = torch.ops.zero3.reduce_grad.default(
        grad, *marker_tuple(ctx.args), ctx.shard_shape, ctx.shard_dtype
    )
    return (shard_grad, *nones, None)


unshard.register_autograd(_backward, setup_context=_setup_context)

UNSHARD = torch.ops.zero3.unshard.default
REDUCE_GRAD = torch.ops.zero3.reduce_grad.default


def is_unshard(node) -> bool:
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_GRAD


# ------------------------------------------------------------------------------- copy-in, copy-out
# What the lowering passes put around a bucket's collective: fixed operations, so Inductor calls
# them instead of generating (and, on CPU, compiling) a kernel for every bucket's shapes.


@torch.library.custom_op("zero3::gather_copy_in", mutates_args=())
def gather_copy_in(
    shards: list[torch.Tensor], sizes: list[int], dtype: torch.dtype
) -> torch.Tensor:
    return arithmetic.gather_copy_in(shards, sizes, dtype)


@gather_copy_in.register_fake
def _gather_copy_in_fake(shards, sizes, dtype):
    return shards[0].new_empty(sum(sizes), dtype=dtype)


@torch.library.custom_op("zero3::gather_copy_out", mutates_args=())
def gather_copy_out(gathered: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    return arithmetic.gather_copy_out_parts(gathered, world, sizes)


@gather_copy_out.register_fake
def _gather_copy_out_fake(gathered, world, sizes):
    return [gathered.new_empty((world, size)) for size in sizes]


@torch.library.custom_op("zero3::reduce_copy_in", mutates_args=())
def reduce_copy_in(
    grads: list[torch.Tensor], world: int, sizes: list[int], dtype: torch.dtype
) -> torch.Tensor:
    return arithmetic.reduce_copy_in(grads, world, sizes, dtype)


@reduce_copy_in.register_fake
def _reduce_copy_in_fake(grads, world, sizes, dtype):
    return grads[0].new_empty(world * sum(sizes), dtype=dtype)


@torch.library.custom_op("zero3::reduce_copy_out", mutates_args=())
def reduce_copy_out(
    reduced: torch.Tensor, sizes: list[int], numels: list[int], divisor: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    return arithmetic.reduce_copy_out(reduced, sizes, numels, divisor, [dtype] * len(sizes))


@reduce_copy_out.register_fake
def _reduce_copy_out_fake(reduced, sizes, numels, divisor, dtype):
    return [reduced.new_empty(numel, dtype=dtype) for numel in numels]


GATHER_COPY_IN = torch.ops.zero3.gather_copy_in.default
GATHER_COPY_OUT = torch.ops.zero3.gather_copy_out.default
REDUCE_COPY_IN = torch.ops.zero3.reduce_copy_in.default
REDUCE_COPY_OUT = torch.ops.zero3.reduce_copy_out.default


# ------------------------------------------------------------------------------- the graph guard


@torch.library.custom_op("zero3::guard", mutates_args=())
def graph_guard(group_name: str, kind: int, code: int, label: str, timeout_s: float) -> None:
    """A scheduled graph's cross-rank check, run before its first collective (``guard.py``).

    For a backward graph it also exchanges which outputs received a gradient (``runtime.py``);
    ``timeout_s`` <= 0: the group's. Its arguments depend only on the graph and the options:
    the compiled code is cached and loaded by other processes (no process-local ids here).
    """
    from .runtime import run_graph_guard

    run_graph_guard(group_name, kind, code, label, timeout_s if timeout_s > 0 else None)


@graph_guard.register_fake
def _graph_guard_fake(group_name: str, kind: int, code: int, label: str, timeout_s: float) -> None:
    return None


GUARD = torch.ops.zero3.guard.default
mark_side_effect(GUARD)


# ------------------------------------------------------------------------------- offload


@torch.library.custom_op("zero3::reload", mutates_args=())
def reload(shard: torch.Tensor) -> torch.Tensor:
    """Start reading an offloaded shard back from its store; returns the tensor being filled.

    Like a collective's output, it must go through ``wait_tensor`` before it is read: the read
    runs on the store's I/O threads, and its completion is registered as the tensor's work.
    """
    out, wait = reload_async(shard)
    register_wait(out, wait)
    return out


@reload.register_fake
def _reload_fake(shard: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(shard)


RELOAD = torch.ops.zero3.reload.default


# ------------------------------------------------------------------------------- leaf modules


class UnshardMany(torch.autograd.Function):
    """Gather several parameters with one collective per dtype (eager leaf modules).

    Backward reduce-scatters every gradient of the group at once, on every rank, whichever of
    them this rank's computation reached (the others count as zeros), so ranks that routed tokens
    to different experts still issue the same collectives. A gradient no rank produced stays None.
    """

    @staticmethod
    def forward(ctx, markers: tuple[MarkerArgs, ...], *shards: torch.Tensor):
        ctx.markers = markers
        ctx.shard_shapes = [list(s.shape) for s in shards]
        ctx.shard_dtypes = [s.dtype for s in shards]
        ctx.set_materialize_grads(False)
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        for indices in _by_dtype(
            [arithmetic.gather_dtype(s.dtype, m.param_dtype) for s, m in zip(shards, markers)]
        ):
            group = [markers[i] for i in indices]
            dtype = arithmetic.gather_dtype(shards[indices[0]].dtype, group[0].param_dtype)
            first = group[0]
            if first.world_size == 1:
                for i in indices:
                    fulls[i] = arithmetic.single_rank_gather(readable(shards[i]), dtype).clone()
                continue
            guard.check(
                first.group_name, guard.KIND_EAGER_GATHER, _group_code(group), _group_label(group)
            )
            layouts = [m.layout for m in group]
            flat = arithmetic.gather_input(
                [readable(shards[i]) for i in indices], arithmetic.sizes(layouts), dtype
            )
            gathered = all_gather(flat, first.world_size, first.group_name)
            for i, full in zip(indices, arithmetic.gather_copy_out(gathered, layouts)):
                fulls[i] = full
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        markers = ctx.markers
        out: list[torch.Tensor | None] = [None] * len(markers)
        wanted = [i for i in range(len(markers)) if ctx.needs_input_grad[1 + i]]
        dtypes = [markers[i].reduce_dtype or ctx.shard_dtypes[i] for i in range(len(markers))]
        for indices in _by_dtype([dtypes[i] for i in wanted]):
            indices = [wanted[i] for i in indices]
            group = [markers[i] for i in indices]
            first, dtype = group[0], dtypes[indices[0]]
            present = [grads[i] is not None for i in indices]
            full = [
                grads[i] if grads[i] is not None else torch.zeros(m.full_shape, dtype=dtype)
                for i, m in zip(indices, group)
            ]
            if first.world_size == 1:
                reduced = [
                    arithmetic.single_rank_reduce(
                        g, dtype, ctx.shard_shapes[i], ctx.shard_dtypes[i]
                    )
                    for i, g in zip(indices, full)
                ]
                union = present
            else:
                union = guard.check(
                    first.group_name,
                    guard.KIND_EAGER_REDUCE,
                    _group_code(group),
                    _group_label(group),
                    presence=present,
                )
                layouts = [m.layout for m in group]
                sizes = arithmetic.sizes(layouts)
                flat = arithmetic.reduce_input(full, first.world_size, sizes, dtype)
                result = reduce_scatter_sum(flat, first.world_size, first.group_name)
                if first.replicate_size > 1:
                    result = all_reduce_sum(result, first.replicate_group)
                shapes = [ctx.shard_shapes[i] for i in indices]
                flats = arithmetic.reduce_copy_out(
                    result,
                    sizes,
                    [math.prod(shape) for shape in shapes],
                    first.world_size * first.replicate_size,
                    [ctx.shard_dtypes[i] for i in indices],
                )
                reduced = [x.view(shape) for x, shape in zip(flats, shapes)]
            for i, grad, keep in zip(indices, reduced, union):
                out[i] = grad if keep else None
        return (None, *out)


def _by_dtype(dtypes: list[torch.dtype]) -> list[list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    return list(groups.values())


def _group_code(markers: Sequence[MarkerArgs]) -> int:
    code = 0
    for m in markers:
        code = (code * 1000003 + m.param_id) & 0x7FFFFFFF
    return code


def _group_label(markers: Sequence[MarkerArgs]) -> str:
    names = [m.fqn for m in markers]
    shown = ", ".join(repr(n) for n in names[:3])
    return f"of {len(names)} parameters ({shown}{', ...' if len(names) > 3 else ''})"
