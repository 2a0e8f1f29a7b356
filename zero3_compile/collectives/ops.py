"""The operations every sharded parameter goes through.

``zero3::unshard(shard, param_id, spec, grad_sink=None) -> full`` is what reading
``module.weight`` calls; ``spec`` is the parameter's ``ShardSpec.literal()`` (see
[Note: the marker contract] in ``sharding/spec.py``). Its backward is
``zero3::reduce_grad(full_grad, param_id, spec, shard_shape, shard_dtype) -> shard_grad``: a
reduce-scatter averaged over ranks (data-parallel semantics, as DDP and FSDP2).

Both are real operations: run eagerly they issue the collective at once (after the cross-rank
check of ``runtime/guard.py``), through the same collective scheme (``schemes.py``) the lowering
passes splice into graphs, so a model is correct without the compiler and between graph breaks.
Under ``torch.compile`` they appear in the traced graph as single nodes (markers); the backend's
passes replace them by bucketed collectives. Their fake implementations give the full / shard
shape.

``zero3::guard`` is the cross-rank check a scheduled graph runs before its first collective;
``zero3::reload`` reads an offloaded shard back; ``zero3::spool_grad`` writes a reduced gradient
shard to its model's gradient spool (``Offload(grads=...)``); ``UnshardMany`` gathers a leaf module's
parameters together, eagerly (``set_leaf_modules``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._torch.c10d import register_wait
from ..offload import grads as grad_spool
from ..offload.params import readable, reload_async
from ..runtime import guard
from ..runtime.root import active_runtime, check_eager
from ..sharding.spec import ShardSpec
from .schemes import EAGER, gather_scheme, reduce_scheme, run_gather, run_reduce


@torch.library.custom_op(
    "zero3::unshard",
    mutates_args=(),
    schema="(Tensor shard, int param_id, str spec, Tensor? grad_sink=None) -> Tensor",
)
def unshard(
    shard: torch.Tensor, param_id: int, spec: str, grad_sink: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather ``shard`` (this rank's dim-0 chunk) into the full parameter.

    The cast to ``param_dtype`` happens on the shard, before the collective, so mixed
    precision halves the bytes on the wire. ``grad_sink``: see ``frontend/accumulation.py``.
    """
    parsed = ShardSpec.parse(spec)
    scheme = gather_scheme(parsed, shard.dtype)
    if scheme.communicates:
        check_eager(parsed, guard.KIND_EAGER_GATHER, param_id, _label(parsed))
    (full,) = run_gather(scheme, EAGER, [readable(shard)], [parsed])
    return _not_aliasing(full, shard)


@unshard.register_fake
def _unshard_fake(shard, param_id, spec, grad_sink=None):
    parsed = ShardSpec.parse(spec)
    return shard.new_empty(parsed.shape, dtype=parsed.gather_dtype(shard.dtype))


@torch.library.custom_op(
    "zero3::reduce_grad",
    mutates_args=(),
    schema=(
        "(Tensor grad, int param_id, str spec, SymInt[] shard_shape, ScalarType shard_dtype)"
        " -> Tensor"
    ),
)
def reduce_grad(
    grad: torch.Tensor,
    param_id: int,
    spec: str,
    shard_shape: Sequence[int],
    shard_dtype: torch.dtype,
) -> torch.Tensor:
    """Reduce-scatter the full gradient ``grad``; return this rank's shard of the mean."""
    parsed = ShardSpec.parse(spec)
    scheme = reduce_scheme(parsed, grad.dtype, shard_dtype)
    if scheme.stages:
        check_eager(parsed, guard.KIND_EAGER_REDUCE, param_id, _label(parsed))
    (out,) = run_reduce(scheme, EAGER, [grad], [parsed], [list(shard_shape)])
    return _not_aliasing(out, grad)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, param_id, spec, shard_shape, shard_dtype):
    return grad.new_empty(tuple(shard_shape), dtype=shard_dtype)


def _not_aliasing(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A custom op may not return (a view of) its input."""
    if out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return out.clone()
    return out


def _setup_context(ctx, inputs, output):
    shard, param_id, spec, grad_sink = inputs
    ctx.param_id, ctx.spec = param_id, spec
    # the shard names the parameter whose gradient spool receives the reduced gradient
    ctx.spools = ShardSpec.parse(spec).grads_offloaded
    if ctx.spools:
        ctx.save_for_backward(shard)
    ctx.shard_shape = list(shard.shape)
    ctx.shard_dtype = shard.dtype
    ctx.sink_dtype = None if grad_sink is None else grad_sink.dtype
    # eager: the model whose collective this is (its backward reduces with its timeout)
    ctx.runtime = active_runtime()


def _backward(ctx, grad):
    if ctx.sink_dtype is not None:  # accumulating without synchronisation: no collective
        return None, None, None, grad.to(ctx.sink_dtype)
    if ctx.runtime is None:
        shard_grad = REDUCE_GRAD(grad, ctx.param_id, ctx.spec, ctx.shard_shape, ctx.shard_dtype)
    else:
        with ctx.runtime.active():
            shard_grad = REDUCE_GRAD(grad, ctx.param_id, ctx.spec, ctx.shard_shape, ctx.shard_dtype)
    if ctx.spools:
        shard_grad = SPOOL_GRAD(shard_grad, ctx.saved_tensors[0], True)
    return shard_grad, None, None, None


unshard.register_autograd(_backward, setup_context=_setup_context)

UNSHARD = torch.ops.zero3.unshard.default
REDUCE_GRAD = torch.ops.zero3.reduce_grad.default


def is_unshard(node) -> bool:
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node) -> bool:
    return node.op == "call_function" and node.target is REDUCE_GRAD


# ------------------------------------------------------------------------------- the graph guard


@torch.library.custom_op("zero3::guard", mutates_args=())
def graph_guard(
    group: str, replicate_group: str, kind: int, code: int, label: str, timeout_s: float
) -> None:
    """A scheduled graph's cross-rank check, run before its first collective (``guard.py``),
    on the side channel of the mesh whose shard and replicate groups are named.

    For a backward graph it also exchanges which outputs received a gradient (``gate.py``).
    Its arguments depend only on the graph and the options: the compiled code is cached and
    loaded by other processes (no process-local ids here).
    """
    from ..runtime.gate import run_graph_guard

    run_graph_guard(group, replicate_group, kind, code, label, timeout_s)


@graph_guard.register_fake
def _graph_guard_fake(group, replicate_group, kind, code, label, timeout_s) -> None:
    return None


GUARD = torch.ops.zero3.guard.default
torch.fx.node.has_side_effect(GUARD)  # kept through dead-code elimination


# ------------------------------------------------------------------------------- offload


@torch.library.custom_op("zero3::reload", mutates_args=())
def reload(shard: torch.Tensor, last: bool, owned: bool) -> torch.Tensor:
    """Start reading an offloaded shard back from its store; returns the tensor being filled.

    Like a collective's output, it must go through ``wait_tensor`` before it is read: the read
    runs on the store's I/O threads, and its completion is registered as the tensor's work.
    ``last`` (a backward graph's reload): an optimizer stepping in the backward keeps the values
    read for the parameter's step; ``owned=False`` (Inductor's graphs, which reuse the buffer
    after its last use): it keeps a copy (``params.reload_async``).
    """
    out, wait = reload_async(shard, last, owned)
    register_wait(out, wait)
    return out


@reload.register_fake
def _reload_fake(shard: torch.Tensor, last: bool, owned: bool) -> torch.Tensor:
    return torch.empty_like(shard)


RELOAD = torch.ops.zero3.reload.default


@torch.library.custom_op("zero3::spool_grad", mutates_args=())
def spool_grad(grad: torch.Tensor, shard: torch.Tensor, owned: bool) -> torch.Tensor:
    """Write a reduced gradient shard to the gradient spool of the parameter whose shard is
    ``shard``; returns the ``SpooledGrad`` that stands for it (no memory held once written).

    The write (or the in-backward step) reads ``grad`` after the op returned. ``owned=False``
    (Inductor's graphs: ``lower_reductions``): its buffer is the graph's, reused for a later
    tensor once this op ran, so the values are copied first."""
    return grad_spool.spool_grad(grad if owned else grad.clone(), shard)


@spool_grad.register_fake
def _spool_grad_fake(grad: torch.Tensor, shard: torch.Tensor, owned: bool) -> torch.Tensor:
    return torch.empty_like(grad)


SPOOL_GRAD = torch.ops.zero3.spool_grad.default


# ------------------------------------------------------------------------------- across graphs


@torch.library.custom_op(
    "zero3::take_gather",
    mutates_args=(),
    schema="(Tensor[] shards, str[] specs, ScalarType shard_dtype, int kind, str group) -> Tensor",
)
def take_gather(
    shards: list[torch.Tensor], specs: list[str], shard_dtype: torch.dtype, kind: int, group: str
) -> torch.Tensor:
    """A graph's first gather bucket: its all-gather's output (to be waited), issued now, or the
    one the previous graph's ``handoff_gather`` issued for exactly these shards
    (``collectives/handoff.py``). ``group`` names the all-gather's process group."""
    from .handoff import HANDOFF

    return HANDOFF.take(shards, specs, shard_dtype, kind)


@take_gather.register_fake
def _take_gather_fake(shards, specs, shard_dtype, kind, group):
    parsed = [ShardSpec.parse(s) for s in specs]
    scheme = gather_scheme(parsed[0], shard_dtype)
    numel = sum(p.padded_numel for p in parsed) * parsed[0].world_size
    return shards[0].new_empty(numel, dtype=scheme.dtype)


@torch.library.custom_op(
    "zero3::handoff_gather", mutates_args=(), schema="(Tensor after, int kind, str group) -> Tensor"
)
def handoff_gather(after: torch.Tensor, kind: int, group: str) -> torch.Tensor:
    """Issue the next graph's first all-gather, as learnt (``collectives/handoff.py``); returns an
    empty tensor whose ``wait_tensor`` waits it. ``after``: the last gathered value this graph
    needed (orders the issue after it)."""
    from .handoff import HANDOFF

    return HANDOFF.handoff(kind, after)


@handoff_gather.register_fake
def _handoff_gather_fake(after, kind, group):
    return after.new_empty(0)


TAKE_GATHER = torch.ops.zero3.take_gather.default
HANDOFF_GATHER = torch.ops.zero3.handoff_gather.default
torch.fx.node.has_side_effect(TAKE_GATHER)
torch.fx.node.has_side_effect(HANDOFF_GATHER)


# ------------------------------------------------------------------------------- leaf modules


class UnshardMany(torch.autograd.Function):
    """Gather several parameters with one collective per scheme (eager leaf modules).

    Backward reduce-scatters every gradient of the group at once, on every rank, whichever of
    them this rank's computation reached (the others count as zeros), so ranks that routed tokens
    to different experts still issue the same collectives. A gradient no rank produced stays None.
    """

    @staticmethod
    def forward(ctx, states, *shards: torch.Tensor):
        specs = [s.spec for s in states]
        ctx.states = states
        ctx.shard_shapes = [list(s.shape) for s in shards]
        ctx.shard_dtypes = [s.dtype for s in shards]
        ctx.set_materialize_grads(False)
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        schemes = [gather_scheme(spec, shard.dtype) for spec, shard in zip(specs, shards)]
        with states[0].root.active():
            for indices in _by_key([s.key() for s in schemes]):
                scheme = schemes[indices[0]]
                group = [states[i] for i in indices]
                if scheme.communicates:
                    check_eager(
                        specs[indices[0]],
                        guard.KIND_EAGER_GATHER,
                        _group_code(group),
                        _group_label(group),
                    )
                outs = run_gather(
                    scheme,
                    EAGER,
                    [readable(shards[i]) for i in indices],
                    [specs[i] for i in indices],
                )
                for i, full in zip(indices, outs):
                    fulls[i] = _not_aliasing(full, shards[i])
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        states = ctx.states
        out: list[torch.Tensor | None] = [None] * len(states)
        wanted = [i for i in range(len(states)) if ctx.needs_input_grad[1 + i]]
        # reduced in the shard's dtype unless the policy says otherwise, whatever dtype (or
        # absence) this rank's gradient has: every rank must group the same way
        schemes = {
            i: reduce_scheme(
                states[i].spec,
                states[i].spec.reduce_dtype or ctx.shard_dtypes[i],
                ctx.shard_dtypes[i],
            )
            for i in wanted
        }
        with states[0].root.active():
            for indices in _by_key([schemes[i].key() for i in wanted]):
                indices = [wanted[i] for i in indices]
                scheme = schemes[indices[0]]
                group = [states[i] for i in indices]
                present = [grads[i] is not None for i in indices]
                full = [
                    grads[i]
                    if grads[i] is not None
                    else torch.zeros(states[i].full_shape, dtype=scheme.dtype)
                    for i in indices
                ]
                union = present
                if scheme.stages:
                    union = check_eager(
                        states[indices[0]].spec,
                        guard.KIND_EAGER_REDUCE,
                        _group_code(group),
                        _group_label(group),
                        presence=present,
                    )
                reduced = run_reduce(
                    scheme,
                    EAGER,
                    full,
                    [s.spec for s in group],
                    [ctx.shard_shapes[i] for i in indices],
                )
                for i, grad, keep in zip(indices, reduced, union):
                    out[i] = grad if keep else None
        return (None, *out)


def _by_key(keys: list) -> list[list[int]]:
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _group_code(states) -> int:
    code = 0
    for state in states:
        code = (code * 1000003 + state.param_id) & 0x7FFFFFFF
    return code


def _group_label(states) -> str:
    names = [s.fqn for s in states]
    shown = ", ".join(repr(n) for n in names[:3])
    return f"of {len(names)} parameters ({shown}{', ...' if len(names) > 3 else ''})"


def _label(spec: ShardSpec) -> str:
    """What an eager collective of one parameter is, in a cross-rank check's error message."""
    return f"{spec.fqn!r} of shape {tuple(spec.shape)}"
