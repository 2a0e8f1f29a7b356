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

``optimizer.step()`` while gradients are pending unreduced raises: stepping then would apply a
partial gradient (or a stale kept parameter would be read after the step).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .ops import REDUCE_GRAD, UNSHARD
from .param import ShardedParam, marker_tuple, module_state, state_of


def set_requires_gradient_sync(
    model: nn.Module, requires_gradient_sync: bool, *, keep_gathered: bool = False
) -> None:
    """Turn the gradient reduce-scatter of ``model``'s sharded parameters on or off.

    ``keep_gathered`` (with ``requires_gradient_sync=False``): gather every parameter now and keep
    it gathered until sync is turned back on (no collective in the micro-batches between).
    """
    if keep_gathered and requires_gradient_sync:
        raise ValueError(
            "zero3: keep_gathered=True keeps parameters gathered while gradient sync is off; "
            "pass it with requires_gradient_sync=False"
        )
    _install_step_check()
    states: dict[int, ShardedParam] = {}
    for module in model.modules():
        state = module_state(module)
        if state is None:
            continue
        state.requires_sync = requires_gradient_sync
        for param_state in state.params.values():
            param_state.requires_sync = requires_gradient_sync
            states.setdefault(id(param_state), param_state)
            if not requires_gradient_sync and param_state.param.requires_grad:
                _ensure_sink(param_state)
    # in module order, the same on every rank: the eager collectives below pair up
    if keep_gathered:
        for param_state in states.values():
            if param_state.kept_full is None:
                _keep(param_state)
    elif requires_gradient_sync:
        for param_state in states.values():
            if param_state.kept_full is not None:
                _release(param_state)


def _keep(state: ShardedParam) -> None:
    """Gather the parameter (in the shard's dtype) into a leaf that collects its gradients."""
    local = state.local()
    exact = dataclasses.replace(state.marker, param_dtype=None)  # no cast: grads accumulate exactly
    with torch.no_grad():
        full = UNSHARD(local, *marker_tuple(exact), None)
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
    local = state.local()
    with torch.no_grad():
        reduced = REDUCE_GRAD(
            full.grad, *marker_tuple(state.marker), list(local.shape), local.dtype
        )
    param = state.param
    if param.grad is None:
        param.grad = DTensor.from_local(
            reduced, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    else:
        param.grad.to_local().add_(reduced)


_STEP_CHECK = []


def _install_step_check() -> None:
    if not _STEP_CHECK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_CHECK.append(register_optimizer_step_pre_hook(_check_no_pending_gradients))


def _check_no_pending_gradients(optimizer, args, kwargs) -> None:
    """Refuse a step while sharded parameters hold unreduced gradients."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = state_of(param)
            if state is None:
                continue
            sink = state.grad_sink
            kept = state.kept_full is not None and state.kept_full.grad is not None
            if not (kept or (sink is not None and sink.grad is not None)):
                continue
            fix = (
                "call z3.set_requires_gradient_sync(model, True) before the last micro-batch's "
                "backward (with keep_gathered=True: at the latest before the step)"
                if not state.requires_sync
                else "run the last micro-batch's backward after turning sync back on: it reduces "
                "them"
            )
            raise RuntimeError(
                f"zero3: optimizer.step() while {state.fqn!r} holds gradients accumulated with "
                f"gradient sync off and not reduced yet, so the step would apply a partial "
                f"gradient: {fix}"
            )


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
        local = param.to_local()
        with torch.no_grad():
            reduced = REDUCE_GRAD(
                pending, *marker_tuple(state.marker), list(local.shape), local.dtype
            )
            param.grad.to_local().add_(reduced)

    return flush
