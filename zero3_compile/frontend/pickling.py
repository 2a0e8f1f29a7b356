"""``torch.save(model)`` and ``copy.deepcopy(model)`` of a sharded model: rebuilt with fresh
parameter states (new identities) once the contents are unpickled."""

from __future__ import annotations

import torch.nn as nn

from .._torch.modules import own_parameters
from ..sharding.mesh import DataParallelMesh
from ..sharding.policy import MixedPrecision
from ..sharding.state import (
    ModuleState,
    ShardedParam,
    ShardState,
    module_state,
    param_id_of,
    set_module_state,
    state_of,
)
from .classes import BASE, class_namespace, generated_class, reclass, register_methods


def reduce_ex(self: nn.Module, protocol):
    base = type(self).__dict__[BASE]
    state = dict(self.__dict__)
    module = module_state(self)
    if any(p.layout is not None for p in module.params.values()):
        raise TypeError(
            "zero3: a sharded model with tensor-parallel parameters cannot be pickled or "
            "deep-copied; save it with z3.save_checkpoint, or copy the model before "
            "parallelize_module and shard"
        )
    state.pop("_zero3", None)
    return (_rebuild_module, (base, (module.prefix, module.root)), state)


def _rebuild_module(base: type, info) -> nn.Module:
    """The first half of unpickling a sharded module: an empty instance of a generated class
    whose ``__setstate__`` re-attaches fresh parameter states once the contents are in."""
    module = base.__new__(base)
    prefix, root = info
    set_module_state(module, ModuleState(prefix=prefix, root=root))
    namespace = class_namespace(base)
    namespace["__setstate__"] = _setstate
    module.__class__ = generated_class(base, namespace)
    return module


def _setstate(self: nn.Module, state: dict) -> None:
    own = module_state(self)
    base = type(self).__dict__[BASE]
    base.__setstate__(self, state) if hasattr(base, "__setstate__") else self.__dict__.update(state)
    set_module_state(self, own)
    self.__dict__.pop("_flat_weights", None)
    for attr, param in own_parameters(self).items():
        if param is not None:
            own.params[attr] = _unpickled_state(param, own, attr)
    reclass(self)


def _unpickled_state(param: nn.Parameter, module: ModuleState, attr: str) -> ShardedParam:
    state = state_of(param)
    if state is not None:  # tied: another module of this model re-attached it already
        return state
    root = module.root
    fqn = f"{module.prefix}.{attr}" if module.prefix else attr
    dp = (
        root.dp
        if root is not None
        else DataParallelMesh.resolve(param.device_mesh.get_group(), None, param.device.type)
    )
    policy = root.policy if root is not None else MixedPrecision()
    spec = dp.spec(fqn, param.shape, policy)
    state = ShardedParam(
        param_id=param_id_of(fqn, param.shape),
        spec=spec,
        rank=dp.shard_rank,
        param=param,
        root=root,
        state=ShardState.SHARDED,
    )
    state.attach(param)
    return state


register_methods({"__reduce_ex__": reduce_ex})
