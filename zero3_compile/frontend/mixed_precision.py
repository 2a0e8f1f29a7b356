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


def install_hooks(root: nn.Module, policy: MixedPrecision) -> None:
    """Cast the root module's floating inputs / outputs as the policy says (forward hooks)."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        cast_in = _cast_floating(policy.param_dtype)

        def cast_inputs(module, args, kwargs):
            return tree_map(cast_in, args), tree_map(cast_in, kwargs)

        root.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        cast_out = _cast_floating(policy.output_dtype)

        def cast_outputs(module, args, output):
            return tree_map(cast_out, output)

        root.register_forward_hook(cast_outputs)
