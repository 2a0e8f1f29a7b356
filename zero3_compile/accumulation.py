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

from .shard import is_sharded, spec_of


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient reduce-scatter of ``model``'s sharded parameters on or off."""
    sinks: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if not hasattr(type(module), "_zero3_base_class"):
            continue
        if not requires_gradient_sync and module._zero3_sinks is None:
            module._zero3_sinks = {
                attr: _sink_for(param, sinks)
                for attr, param in module._parameters.items()
                if param is not None and is_sharded(param)
            }
        module._zero3_sync = requires_gradient_sync
        for param in module._parameters.values():
            if param is not None and is_sharded(param):
                param._zero3_sync = requires_gradient_sync


def _sink_for(param: nn.Parameter, sinks: dict[int, torch.Tensor]) -> torch.Tensor | None:
    if not param.requires_grad:
        return None
    sink = sinks.get(id(param))
    if sink is None:
        sink = getattr(param, "_zero3_grad_sink", None)
    if sink is None:
        local = param.to_local()
        sink = torch.zeros((), dtype=local.dtype, device=local.device).expand(param.shape)
        sink = sink.detach().requires_grad_(True)
        param._zero3_grad_sink = sink
        param.register_post_accumulate_grad_hook(_flush_into(sink))
    sinks[id(param)] = sink
    return sink


def _flush_into(sink: torch.Tensor):
    def flush(param: nn.Parameter) -> None:
        """Runs when the shard's gradient was accumulated: add the reduced pending gradient."""
        pending = sink.grad
        # the hook also runs for steps that gave the shard no gradient (sync off)
        if pending is None or param.grad is None or not getattr(param, "_zero3_sync", True):
            return
        sink.grad = None
        spec = spec_of(param)
        local = param.to_local()
        with torch.no_grad():
            reduced = torch.ops.zero3.reduce_grad(
                pending,
                list(local.shape),
                spec.group_name,
                spec.world_size,
                spec.reduce_dtype,
                local.dtype,
                spec.name,
            )
            param.grad.to_local().add_(reduced)

    return flush
