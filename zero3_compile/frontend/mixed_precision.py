"""Mixed precision on a sharded model: gather and compute in a low precision, keep fp32 master
shards. The policy type, ``MixedPrecision``, is the sharding layer's (``sharding/policy.py``;
importable from here too); this module casts the root module's inputs and outputs and changes a
model's policy (``set_mixed_precision``)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from .._torch.pytree import tree_map
from ..sharding.policy import MixedPrecision
from ..sharding.state import module_state
from .classes import reclass
from .loading import resting_states

__all__ = ["MixedPrecision", "install_hooks", "set_mixed_precision"]


def _cast_floating(dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return cast


def install_hooks(root: nn.Module, runtime) -> None:
    """Cast the root module's floating inputs / outputs as the model's policy says (forward hooks
    that read ``runtime.policy`` at each call, so ``set_mixed_precision`` can change it)."""
    root.register_forward_pre_hook(_CastInputs(runtime), with_kwargs=True)
    root.register_forward_hook(_CastOutputs(runtime))


class _CastInputs:
    """A forward pre-hook (a class, so that a model with it pickles)."""

    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, module, args, kwargs):
        policy = self.runtime.policy
        if not policy.cast_forward_inputs or policy.param_dtype is None:
            return None
        cast_in = _cast_floating(policy.param_dtype)
        return tree_map(cast_in, args), tree_map(cast_in, kwargs)


class _CastOutputs:
    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, module, args, output):
        policy = self.runtime.policy
        if policy.output_dtype is None:
            return None
        return tree_map(_cast_floating(policy.output_dtype), output)


def set_mixed_precision(model: nn.Module, policy: MixedPrecision) -> None:
    """Give a sharded model another mixed-precision policy (compiled code recompiles)."""
    policy.validate()
    states = resting_states(model, "changing the mixed-precision policy")
    runtimes = {id(s.root): s.root for s in states}
    for runtime in runtimes.values():
        runtime.policy = policy
    for state in states:
        state.spec = replace(
            state.spec, param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype
        )
    for module in model.modules():
        if module_state(module) is not None:
            reclass(module)
