"""Initialise a model built on the ``meta`` device after sharding, one module at a time.

```python
with torch.device("meta"):
    model = Transformer(config)          # no memory
z3.shard(model)                          # shards are meta too
z3.materialize(model, init_fn=model._init_weights)
```
Each module's parameters are created full-size, initialised by ``init_fn(module)`` (default:
``module.reset_parameters()``), and only this rank's chunk is kept; no rank ever holds more than
its shards plus the parameters of one module. Modules are visited in ``model.apply`` order, so
with the same seed the values equal the unsharded model's after
``model.to_empty(device=...); model.apply(init_fn)`` (or ``reset_parameters()`` in that order).
Unless ``shard(sync_module_states=False)``, every rank keeps the first rank's initial values (one
broadcast per module, then one of the buffers), so ranks without a common seed agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from .._torch.modules import own_parameters
from ..frontend.broadcast import broadcast_from, source_rank
from ..frontend.classes import base_class
from ..offload.model import register_loaded
from ..offload.params import loaded
from ..sharding.state import module_state, state_of


def materialize(
    model: nn.Module, *, init_fn: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """Allocate and initialise the shards of a sharded model built on ``meta``; return it.

    Example:
        ```python
        with torch.device("meta"):
            model = Transformer(config)  # no memory
        z3.shard(model)  # the shards are meta too
        z3.materialize(model, init_fn=model._init_weights)  # one module at a time
        ```
    """
    # sized once for the largest module: a buffer grown midway could stay alive beside its
    # successor while a collective still holds it
    workspace = _Workspace(
        max((_Workspace.nbytes(_full_specs(m)) for m in model.modules()), default=0)
    )
    _apply_post_order(model, lambda module: _materialize_module(module, init_fn, workspace))
    for name, buffer in list(model.named_buffers()):
        if buffer.device.type == "meta":
            raise ValueError(
                f"zero3: buffer {name!r} is still on the meta device; initialise buffers yourself "
                "(e.g. in init_fn, or register them as non-persistent and recompute them)"
            )
    root = _runtime(model)
    if root is not None and root.sync_module_states:
        buffers = [b.detach() for b in model.buffers()]
        broadcast_from(buffers, root.dp, source_rank(root.dp, None), coalesce=False)
    return model


def _runtime(model: nn.Module):
    for module in model.modules():
        state = module_state(module)
        if state is not None:
            return state.root
    return None


def _apply_post_order(module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
    for child in module.children():  # the order nn.Module.apply uses
        _apply_post_order(child, fn)
    fn(module)


class _Workspace:
    """One buffer that holds the full parameters of each module in turn. Reused rather than
    allocated per module: a collective (the first rank's broadcast) may hold on to its tensors a
    moment after it completes (gloo's worker thread lets go of them later), which with fresh
    tensors would keep the previous module's full parameters alive beside the next one's."""

    _ALIGN = 64

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # bytes: the largest module's (see materialize)
        self.buffer: torch.Tensor | None = None

    @classmethod
    def nbytes(cls, specs: list[tuple[tuple, torch.dtype]]) -> int:
        return sum(cls._sizes(specs))

    @classmethod
    def _sizes(cls, specs: list[tuple[tuple, torch.dtype]]) -> list[int]:
        return [
            -(-math.prod(shape) * dtype.itemsize // cls._ALIGN) * cls._ALIGN
            for shape, dtype in specs
        ]

    def tensors(self, specs: list[tuple[tuple, torch.dtype]], device) -> list[torch.Tensor]:
        sizes = self._sizes(specs)
        if self.buffer is None or self.buffer.numel() < sum(sizes) or self.buffer.device != device:
            self.buffer = None
            size = max(sum(sizes), self.capacity)
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        out, offset = [], 0
        for (shape, dtype), size in zip(specs, sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            out.append(self.buffer[offset : offset + nbytes].view(dtype).view(shape))
            offset += size
        return out


def _materialize_module(
    module: nn.Module, init_fn: Callable[[nn.Module], None] | None, workspace: _Workspace
) -> None:
    state = module_state(module)
    own = _own_sharded(module)
    if not own:
        if init_fn is not None:
            init_fn(module)
        return
    swapped_class = type(module)
    base = base_class(module)
    device = _target_device(own.values())
    storage = workspace.tensors(_full_specs(module), device)
    full = {
        name: nn.Parameter(tensor, requires_grad=p.requires_grad)
        for (name, p), tensor in zip(own.items(), storage)
    }
    # run the initialiser on a plain module holding full-size parameters
    module.__class__ = base
    own_parameters(module).update(full)
    try:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                raise ValueError(
                    f"zero3: {base.__name__} has parameters but no reset_parameters(); pass "
                    "init_fn to zero3_compile.materialize"
                )
    finally:
        values = {name: own_parameters(module)[name].detach() for name in own}
        own_parameters(module).update(own)
        module.__class__ = swapped_class
    root = state.root
    if root.sync_module_states:  # the first rank's initial values on every rank
        broadcast_from(list(values.values()), root.dp, source_rank(root.dp, None), coalesce=False)
    for name, param in own.items():
        _keep_local_chunk(param, values[name], device)


def _own_sharded(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's own sharded parameters, by attribute name."""
    return {
        name: param
        for name, param in own_parameters(module).items()
        if param is not None and state_of(param) is not None
    }


def _full_specs(module: nn.Module) -> list[tuple[tuple, torch.dtype]]:
    """(full shape, dtype) of each of the module's own sharded parameters."""
    state = module_state(module)
    return [(state.params[name].full_shape, p.dtype) for name, p in _own_sharded(module).items()]


def _target_device(params) -> torch.device:
    meshes = {p.device_mesh.device_type for p in params}
    device_type = meshes.pop()
    return (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device(device_type)
    )


@torch.no_grad()
def _keep_local_chunk(param: nn.Parameter, full: torch.Tensor, device: torch.device) -> None:
    """Store this rank's dim-0 chunk of ``full`` as ``param``'s shard (same Parameter object)."""
    state = state_of(param)
    local = state.spec.chunk(full, state.rank)
    if param.to_local().device.type == "meta":
        real = nn.Parameter(
            state.root.dp.wrap(local, state.spec, state.layout), requires_grad=param.requires_grad
        )
        torch.utils.swap_tensors(param, real)  # also swaps the attributes: attach the state again
        state.attach(param)
    elif state.offload is not None:
        with loaded([state], write_back=True):
            param.to_local().copy_(local)
    else:
        param.to_local().copy_(local)
    register_loaded(state)  # with offload: into the store, out of memory
