"""``model.to()``, ``.half()``, ``.float()`` on a sharded model: ``_apply`` of every generated
class works on the shards and re-attaches the parameters' states; an offloaded shard is left in
its store or refused by name."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.modules import own_parameters
from ..sharding.state import module_state
from .classes import base_call, register_methods


def apply_(self: nn.Module, fn, recurse: bool = True):
    """``model.to()`` and friends: apply ``fn`` to the shards, re-attach the parameters' states
    (``swap_tensors`` replaced their contents and attributes)."""
    evicted = {
        id(own_parameters(self).get(attr)): state
        for attr, state in module_state(self).params.items()
        if getattr(state, "offload", None) is not None and state.offload.evicted
    }
    if evicted:
        fn = _leaving_evicted_shards(fn, evicted)
    result = base_call(self, "_apply", fn, recurse)
    for attr, state in module_state(self).params.items():
        param = own_parameters(self).get(attr)
        if param is None:
            continue
        if not isinstance(param, DTensor) or tuple(param.shape) != state.global_shape:
            raise RuntimeError(
                f"zero3: {state.fqn} is no longer a sharded parameter of shape "
                f"{state.global_shape} after module._apply(); only dtype and device changes are "
                "supported on a sharded model"
            )
        state.attach(param)
    return result


def _leaving_evicted_shards(fn, evicted: dict):
    """``fn`` for ``_apply``, but a shard offloaded to its store (no memory: its values are in
    the file) is left as it is when ``fn`` would neither move nor cast it (``model.to("cpu:0")``
    by the Hugging Face Trainer), and refused by name when it would: its values would be read
    from memory it no longer has."""

    def apply(tensor):
        state = evicted.get(id(tensor))
        if state is None:
            return fn(tensor)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if probe.dtype == tensor.dtype and probe.device == tensor.device:
            return tensor
        raise RuntimeError(
            f"zero3: {state.fqn} is offloaded (shard(offload=Offload(params=...))): this "
            f"module._apply() (model.to(), .half(), ...) would make it {probe.dtype} on "
            f"{probe.device} from {tensor.dtype} on {tensor.device}. Move or cast the model before "
            "zero3.shard, or compute in another dtype with MixedPrecision"
        )

    return apply


register_methods({"_apply": apply_})
