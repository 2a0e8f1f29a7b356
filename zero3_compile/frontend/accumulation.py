"""Gradient accumulation without a reduce-scatter on every micro-batch.

```python
z3.set_requires_gradient_sync(model, False)   # micro-batches 1..k-1: no gradient collective
for x in micro_batches[:-1]:
    loss_fn(step_model(x)).backward()
z3.set_requires_gradient_sync(model, True)    # the last micro-batch reduces everything
loss_fn(step_model(micro_batches[-1])).backward()
opt.step(); opt.zero_grad()
```
With sync off, each trainable parameter's full gradient accumulates unreduced in a full-size
buffer (more memory: an unsharded gradient per rank, in the parameter's dtype) and backward issues
no reduce-scatter. In the next synchronised backward, as soon as a parameter's shard gradient is
accumulated, its buffer is reduce-scattered and added to it, and freed; the buffers of parameters
that backward does not reach (frozen or unused in the last micro-batch) are reduced when it ends.
The sink that receives these gradients is a zero-strided leaf: it costs no memory itself.

``requires_grad`` may change between micro-batches, as in eager training: a parameter read while
``requires_grad=False`` gets no gradient from that micro-batch (its read passes no sink, or
detaches the kept parameter), and one frozen when sync is turned back on has its pending
gradient reduced there and then (no backward will reach it).

``keep_gathered=True`` also keeps the parameters gathered while sync is off (FSDP2's
``set_reshard_after_backward(False)``): each is gathered once when sync is turned off, and the
micro-batches until sync is turned back on run no collective at all (their graphs read the kept
parameters, and the full gradients accumulate on them). Turning sync on reduce-scatters the
accumulated gradients into the shards' ``.grad`` and frees the kept parameters; one that no
rank's loss reached in the window (it fed only outputs the loss ignored) keeps ``grad is None``,
as in eager training (the ranks agree on which first, over the side channel). It costs a full
parameter and a full gradient per rank (in the shard's dtype) over the window: DDP's memory.

While sync is off ``param.grad`` is a ``PendingGrad`` (``pending.py``): in-place scalings of it
(a pipeline schedule's ``scale_grads``) apply to the pending gradient when it is reduced; other
uses raise. ``optimizer.step()`` while gradients are pending unreduced raises: stepping then would apply a
partial gradient (or a stale kept parameter would be read after the step).
"""

from __future__ import annotations

import weakref
import zlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.autograd import queue_callback
from ..collectives.ops import REDUCE_GRAD, UNSHARD
from ..offload.grads import spool
from ..runtime import guard
from ..runtime.optimizers import watch_optimizers
from ..runtime.root import check_eager
from ..sharding.spec import ShardSpec
from ..sharding.state import ShardedParam, ShardState, module_state
from .loading import sharded_states
from .pending import apply_scalings, close_window, open_window


def set_requires_gradient_sync(
    model: nn.Module, requires_gradient_sync: bool, *, keep_gathered: bool = False
) -> None:
    """Turn the gradient reduce-scatter of ``model``'s sharded parameters on or off.

    ``keep_gathered`` (with ``requires_gradient_sync=False``): gather every parameter now and keep
    it gathered until sync is turned back on (no collective in the micro-batches between).

    Example:
        ```python
        for i, batch in enumerate(micro_batches):
            z3.set_requires_gradient_sync(model, i == len(micro_batches) - 1)  # reduce on the last
            loss_fn(step_model(batch)).backward()
        opt.step()
        ```
    """
    if keep_gathered and requires_gradient_sync:
        raise ValueError(
            "zero3: keep_gathered=True keeps parameters gathered while gradient sync is off; "
            "pass it with requires_gradient_sync=False"
        )
    watch_optimizers()  # the step refuses pending unreduced gradients
    states: dict[int, ShardedParam] = {}
    for module in model.modules():
        state = module_state(module)
        if state is None:
            continue
        for param_state in state.params.values():
            states.setdefault(id(param_state), param_state)
    # in module order, the same on every rank: the eager collectives below pair up
    reached = _kept_reached(states.values()) if requires_gradient_sync else set()
    for param_state in states.values():
        if requires_gradient_sync:
            # in-place scalings of param.grad in the window apply to the pending gradient
            param_state.pending_scalings += close_window(param_state)
            if param_state.state is ShardState.KEPT_GATHERED:
                _release(param_state, id(param_state) in reached)
            param_state.transition(ShardState.SHARDED)
            if _pending(param_state) is not None and not param_state.param.requires_grad:
                _reduce_pending(param_state)  # frozen now: no backward reaches its shard
            continue
        # frozen ones too: one may be unfrozen within the window (the getter passes the sink
        # only while the parameter requires grad)
        _ensure_sink(param_state)
        if keep_gathered and param_state.state is not ShardState.KEPT_GATHERED:
            _keep(param_state)
            param_state.transition(ShardState.KEPT_GATHERED)
        elif param_state.state is ShardState.SHARDED:
            param_state.transition(ShardState.ACCUMULATING)
        if param_state.param.requires_grad:
            open_window(param_state)  # else once a gradient is pending (_on_pending)
    if requires_gradient_sync:
        for param_state in states.values():
            if _pending(param_state) is not None:
                _closing.setdefault(param_state.root, []).append(param_state)


def _exact(spec: ShardSpec) -> str:
    """The spec without the compute cast: kept parameters and their gradients stay exact."""
    from dataclasses import replace

    return replace(spec, param_dtype=None).literal()


def _keep(state: ShardedParam) -> None:
    """Gather the parameter (in the shard's dtype) into a leaf that collects its gradients."""
    local = state.local()
    with torch.no_grad(), state.root.active():
        full = UNSHARD(local, state.param_id, _exact(state.spec), None)
    # a frozen parameter's reads detach it (the getter): it may be unfrozen within the window
    full.requires_grad_(True)
    full.register_post_accumulate_grad_hook(_on_pending(state))
    sink = state.grad_sink
    if sink is not None and sink.grad is not None:  # pending from micro-batches before keeping
        full.grad = sink.grad.to(full.dtype)
        sink.grad = None
    state.kept_full = full


def _kept_reached(states) -> set[int]:
    """The kept parameters (ids of their states) whose gradient some rank accumulated in the
    window, agreed over the ranks: one whose outputs no loss read (the runtime gate) has none,
    and a rank whose loss alone did not reach it reduces zeros with the others."""
    groups: dict[tuple, list[ShardedParam]] = {}
    for state in states:
        if state.state is ShardState.KEPT_GATHERED:
            groups.setdefault((state.spec.group, state.spec.replicate_group), []).append(state)
    reached = set()
    for members in groups.values():
        for start in range(0, len(members), guard.MAX_PRESENCE):
            chunk = members[start : start + guard.MAX_PRESENCE]
            presence = [s.kept_full.grad is not None for s in chunk]
            code = zlib.crc32(str([s.param_id for s in chunk]).encode()) & 0x7FFFFFFF
            label = f"kept gradients of {len(chunk)} parameters from {chunk[0].fqn}"
            with chunk[0].root.active():
                union = check_eager(chunk[0].spec, guard.KIND_EAGER_REDUCE, code, label, presence)
            reached.update(id(s) for s, bit in zip(chunk, union or presence) if bit)
    return reached


def _release(state: ShardedParam, reached: bool) -> None:
    """Reduce-scatter the kept parameter's accumulated gradient into the shard's (zeros where
    another rank's reached it and this one's did not); free it."""
    full, state.kept_full = state.kept_full, None
    if not reached:
        return
    _add_reduced(state, full.grad if full.grad is not None else torch.zeros_like(full))


def _add_reduced(state: ShardedParam, pending: torch.Tensor) -> None:
    local = state.local()
    with torch.no_grad(), state.root.active():
        reduced = REDUCE_GRAD(
            pending, state.param_id, state.spec.literal(), list(local.shape), local.dtype
        )
    if state.pending_scalings:  # scaled while pending (pending.py)
        apply_scalings(reduced, state.pending_scalings)
        state.pending_scalings = []
    if state.spec.grads_offloaded:
        reduced = spool(state, reduced)
    param = state.param
    if param.grad is None:
        param.grad = DTensor.from_local(
            reduced, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        param.grad.to_local().add_(reduced)


def _ensure_sink(state: ShardedParam) -> None:
    if state.grad_sink is not None:
        return
    local = state.local()
    sink = torch.zeros((), dtype=local.dtype, device=local.device).expand(state.full_shape)
    state.grad_sink = sink.detach().requires_grad_(True)
    state.grad_sink.register_post_accumulate_grad_hook(_on_pending(state))
    _hook_param(state)


# states whose shard carries the flush hook (a frozen parameter takes no hook: it is added once
# a gradient reaches its sink)
_hooked: weakref.WeakSet = weakref.WeakSet()
# runtime -> its states with gradients pending when sync was turned on, in module order: what
# the next synchronised backward has not reduced when it ends is reduced then (_reduce_rest)
_closing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_queued: weakref.WeakSet = weakref.WeakSet()  # runtimes whose _reduce_rest is queued


def _hook_param(state: ShardedParam) -> None:
    if state not in _hooked and state.param.requires_grad:
        state.param.register_post_accumulate_grad_hook(_flush(state))
        _hooked.add(state)


def _on_pending(state: ShardedParam):
    def on_pending(leaf: torch.Tensor) -> None:
        """A gradient arrived in the sink or the kept parameter: ``param.grad`` stands for it
        (a parameter frozen when sync was turned off opens its window here)."""
        if not state.requires_sync:
            open_window(state)
            _hook_param(state)

    return on_pending


def _pending(state: ShardedParam) -> torch.Tensor | None:
    sink = state.grad_sink
    return None if sink is None else sink.grad


def _reduce_pending(state: ShardedParam) -> None:
    pending, state.grad_sink.grad = state.grad_sink.grad, None
    _add_reduced(state, pending)


def _flush(state: ShardedParam):
    def flush(param: nn.Parameter) -> None:
        """Runs when the shard's gradient was accumulated: add the reduced pending gradient."""
        # the hook also runs for steps that gave the shard no gradient (sync off)
        if param.grad is None or not state.requires_sync:
            return
        if _pending(state) is not None:
            _reduce_pending(state)
        runtime = state.root
        if runtime in _closing and runtime not in _queued:
            _queued.add(runtime)
            queue_callback(lambda: _reduce_rest(runtime))

    return flush


def _reduce_rest(runtime) -> None:
    """At the end of the first synchronised backward: reduce the pending gradients it did not
    reach (parameters frozen or unused in the last micro-batch), in module order on every rank."""
    _queued.discard(runtime)
    for state in _closing.pop(runtime, ()):
        if state.requires_sync and _pending(state) is not None:
            _reduce_pending(state)


def discard_pending(model: nn.Module) -> None:
    """Drop every gradient of ``model``'s sharded parameters, pending or reduced, and every kept
    parameter, without a collective (what a pipeline's metadata inference computed)."""
    for param_state in sharded_states(model):
        _closing.pop(param_state.root, None)
        close_window(param_state)
        param_state.pending_scalings = []
        if param_state.grad_sink is not None:
            param_state.grad_sink.grad = None
        if param_state.state is ShardState.KEPT_GATHERED:
            param_state.kept_full = None
        param_state.transition(ShardState.SHARDED)
        param_state.param.grad = None
