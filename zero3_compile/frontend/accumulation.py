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
accumulated, its buffer is reduce-scattered and added to it, and freed. The sink that receives
these gradients is a zero-strided leaf: it costs no memory itself.

``keep_gathered=True`` also keeps the parameters gathered while sync is off (FSDP2's
``set_reshard_after_backward(False)``): each is gathered once when sync is turned off, and the
micro-batches until sync is turned back on run no collective at all (their graphs read the kept
parameters, and the full gradients accumulate on them). Turning sync on reduce-scatters the
accumulated gradients into the shards' ``.grad`` and frees the kept parameters. It costs a full
parameter and a full gradient per rank (in the shard's dtype) over the window: DDP's memory.

While sync is off ``param.grad`` is a ``PendingGrad`` (``pending.py``): in-place scalings of it
(a pipeline schedule's ``scale_grads``) apply to the pending gradient when it is reduced; other
uses raise. ``optimizer.step()`` while gradients are pending unreduced raises: stepping then would apply a
partial gradient (or a stale kept parameter would be read after the step).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..collectives.ops import REDUCE_GRAD, UNSHARD
from ..offload.grads import spool
from ..runtime.optimizers import watch_optimizers
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
    for param_state in states.values():
        if requires_gradient_sync:
            # in-place scalings of param.grad in the window apply to the pending gradient
            param_state.pending_scalings += close_window(param_state)
            if param_state.state is ShardState.KEPT_GATHERED:
                _release(param_state)
            param_state.transition(ShardState.SHARDED)
            continue
        if param_state.param.requires_grad:
            _ensure_sink(param_state)
        if keep_gathered and param_state.state is not ShardState.KEPT_GATHERED:
            _keep(param_state)
            param_state.transition(ShardState.KEPT_GATHERED)
        elif param_state.state is ShardState.SHARDED:
            param_state.transition(ShardState.ACCUMULATING)
        open_window(param_state)


def _exact(spec: ShardSpec) -> str:
    """The spec without the compute cast: kept parameters and their gradients stay exact."""
    from dataclasses import replace

    return replace(spec, param_dtype=None).literal()


def _keep(state: ShardedParam) -> None:
    """Gather the parameter (in the shard's dtype) into a leaf that collects its gradients."""
    local = state.local()
    with torch.no_grad(), state.root.active():
        full = UNSHARD(local, state.param_id, _exact(state.spec), None)
    full.requires_grad_(state.param.requires_grad)
    sink = state.grad_sink
    if sink is not None and sink.grad is not None:  # pending from micro-batches before keeping
        full.grad = sink.grad.to(full.dtype)
        sink.grad = None
    state.kept_full = full


def _release(state: ShardedParam) -> None:
    """Reduce-scatter the kept parameter's accumulated gradient into the shard's; free it."""
    full, state.kept_full = state.kept_full, None
    if full.grad is None:
        return
    _add_reduced(state, full.grad)


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
    state.param.register_post_accumulate_grad_hook(_flush(state))


def _flush(state: ShardedParam):
    def flush(param: nn.Parameter) -> None:
        """Runs when the shard's gradient was accumulated: add the reduced pending gradient."""
        sink = state.grad_sink
        pending = None if sink is None else sink.grad
        # the hook also runs for steps that gave the shard no gradient (sync off)
        if pending is None or param.grad is None or not state.requires_sync:
            return
        sink.grad = None
        _add_reduced(state, pending)

    return flush


def discard_pending(model: nn.Module) -> None:
    """Drop every gradient of ``model``'s sharded parameters, pending or reduced, and every kept
    parameter, without a collective (what a pipeline's metadata inference computed)."""
    for param_state in sharded_states(model):
        close_window(param_state)
        param_state.pending_scalings = []
        if param_state.grad_sink is not None:
            param_state.grad_sink.grad = None
        if param_state.state is ShardState.KEPT_GATHERED:
            param_state.kept_full = None
        param_state.transition(ShardState.SHARDED)
        param_state.param.grad = None
