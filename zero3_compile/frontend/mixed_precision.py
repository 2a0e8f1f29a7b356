"""Mixed precision policy: gather and compute in a low precision, keep fp32 master shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """How parameters, inputs, gradients and outputs are cast.

    param_dtype: dtype shards are cast to before the all-gather (half the bytes on the wire for
        bf16) and the forward and backward compute in. The shards, their gradients and the
        optimizer state keep the parameters' own dtype (fp32 master weights).
    reduce_dtype: dtype gradients are reduce-scattered (summed over ranks) in; default: the
        gradient's dtype, i.e. param_dtype. fp32 avoids summing in bf16.
    cast_forward_inputs: cast floating-point tensors passed to the root module's forward to
        param_dtype (so ``model(x_fp32)`` works with bf16 weights).
    output_dtype: cast floating-point outputs of the root module's forward to this dtype.

    Example:
        ```python
        policy = z3.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        z3.shard(model, mp_policy=policy)  # bf16 gathers and compute, fp32 reductions and shards
        ```
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    output_dtype: torch.dtype | None = None

    def validate(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"zero3: MixedPrecision.{name} must be a floating-point torch.dtype, got {value!r}"
                )


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
    from dataclasses import replace

    from ..sharding.state import module_state
    from .classes import reclass
    from .loading import resting_states

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
