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
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .ops import REDUCE_GRAD
from .param import ShardedParam, marker_tuple, module_state


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient reduce-scatter of ``model``'s sharded parameters on or off."""
    for module in model.modules():
        state = module_state(module)
        if state is None:
            continue
        state.requires_sync = requires_gradient_sync
        for param_state in state.params.values():
            param_state.requires_sync = requires_gradient_sync
            if not requires_gradient_sync and param_state.param.requires_grad:
                _ensure_sink(param_state)


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
