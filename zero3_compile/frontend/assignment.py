"""Parameters and modules assigned to a sharded model after ``shard()``: sharded on assignment."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.modules import own_parameters
from ..sharding.state import (
    ModuleState,
    ShardedParam,
    ShardState,
    is_sharded,
    module_state,
    state_of,
)
from .classes import base_call, is_sharded_module, make_sharded, reclass, register_methods
from .loading import adopt
from .shard import shard_parameter


def setattr_(self: nn.Module, name: str, value) -> None:
    from ..runtime.write_through import GatheredParameter

    if isinstance(value, GatheredParameter) and tuple(value.shape) == value.sharded_shape():
        # ``a.weight = b.weight`` ties: reading b.weight gave b's parameter as a full tensor
        value = value._zero3_link.state.param
    if isinstance(value, nn.Module) and not isinstance(value, nn.Parameter):
        if any(not is_sharded_module(m) for m in value.modules()):
            shard_submodule(self, name, value)
    base_call(self, "__setattr__", name, value)
    if name in self.__dict__.get("_parameters", {}) and value is None:
        if module_state(self).params.pop(name, None) is not None:
            reclass(self)


def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    state = module_state(self)
    own = state.params.get(name)
    if own is not None and own.state is ShardState.LOADING and param is not None:
        if not is_sharded(param):  # a loader hands this rank's values as a parameter
            adopt(own, param)
            return
    if isinstance(param, DTensor) and not is_sharded(param):
        if own is None or not _same_layout(own, param):
            raise ValueError(
                f"zero3: cannot assign a DTensor parameter to {state.prefix or '<root>'}.{name}; "
                "assign a plain nn.Parameter (it is sharded on assignment)"
            )
        param = _recast(own, param)  # a cast of the shard (peft's cast_adapter_dtype)
    elif param is not None and not is_sharded(param):
        fqn = f"{state.prefix}.{name}" if state.prefix else name
        param = shard_parameter(param, fqn, state.root).param
    base_call(self, "register_parameter", name, param)
    if param is None:
        state.params.pop(name, None)
    else:
        shared = state_of(param)
        if shared.fqn != (f"{state.prefix}.{name}" if state.prefix else name):
            shared.tied = True  # one parameter under two names (a loader's tie_weights)
        state.params[name] = shared
    reclass(self)


def _same_layout(state: ShardedParam, param: DTensor) -> bool:
    current = state.param
    return (
        tuple(param.shape) == tuple(current.shape)
        and param.device_mesh == current.device_mesh
        and param.placements == current.placements
        and param.to_local().shape == current.to_local().shape
    )


def _recast(state: ShardedParam, param: DTensor) -> nn.Parameter:
    """``module.w = nn.Parameter(module.w_shard.to(dtype))``, with ``w_shard`` the sharded
    parameter (``named_parameters()``): the shard takes the new values and dtype in place (the
    parameter object and its state stay)."""
    if state.offload is not None:
        raise ValueError(
            f"zero3: {state.fqn!r} is offloaded; its dtype cannot change after shard() (cast the "
            "model before sharding it)"
        )
    target = state.param
    torch.utils.swap_tensors(
        target, nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    )
    state.attach(target)
    return target


def shard_submodule(parent: nn.Module, name: str, child: nn.Module) -> None:
    """A module assigned into a sharded model after ``shard()``: shard it the same way."""
    state = module_state(parent)
    root = state.root
    prefix = f"{state.prefix}.{name}" if state.prefix else name
    named = list(child.named_parameters(remove_duplicate=False))
    canonical = {}
    for sub_name, param in named:
        canonical.setdefault(id(param), f"{prefix}.{sub_name}")
    states: dict[int, ShardedParam] = {}
    for sub_prefix, sub in child.named_modules():
        if is_sharded_module(sub):
            continue
        own = {}
        for attr, param in list(own_parameters(sub).items()):
            if param is None:
                continue
            shared = state_of(param) or states.get(id(param))
            if shared is None:
                shared = shard_parameter(param, canonical[id(param)], root)
                states[id(param)] = shared
            full_name = ".".join(p for p in (prefix, sub_prefix, attr) if p)
            shared.tied = shared.tied or shared.fqn != full_name
            own_parameters(sub)[attr] = shared.param
            own[attr] = shared
        full_prefix = f"{prefix}.{sub_prefix}" if sub_prefix else prefix
        make_sharded(sub, ModuleState(params=own, root=root, prefix=full_prefix))


register_methods({"__setattr__": setattr_, "register_parameter": register_parameter})
