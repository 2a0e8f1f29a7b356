"""``MixedPrecision``: the dtypes a sharded model gathers, computes and reduces in.

A policy is part of what a sharded parameter is (its ``ShardSpec`` records ``param_dtype`` and
``reduce_dtype``), so it lives with the mesh and the spec: ``DataParallelMesh.spec`` and the
model's runtime (``runtime/root.py``) take it typed. The frontend applies the rest of it (the
casts of the root module's inputs and outputs, ``frontend/mixed_precision.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
