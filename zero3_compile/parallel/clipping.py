"""``clip_grad_norm_`` over a pipelined model: the norm of every stage's gradients, not one's.

torch's ``clip_grad_norm_`` reduces over the mesh the gradients live on (zero3's data-parallel
and tensor-parallel dimensions); each pipeline rank holds other parameters, so its norm is its
stages' alone and each rank would clip by another factor. Here each rank's norm is combined over
the pipeline group (sum of ``norm ** p``, or max for ``inf``) before the gradients are scaled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_group: dist.ProcessGroup | None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the parameters of this rank's pipeline stages,
    clipping by the norm of the whole model's gradients (all stages): pass ``pp_group`` (e.g.
    ``mesh["pp"].get_group()``; None for no pipeline). Every rank of the group must call it.
    Returns the whole model's norm (a plain tensor, the same on every rank).

    Example:
        ```python
        from zero3_compile.parallel import clip_grad_norm_

        schedule.step(tokens)
        norm = clip_grad_norm_(stage_module.parameters(), 1.0, pp_group=mesh["pp"].get_group())
        optimizer.step()
        ```
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    norm_type = float(norm_type)
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
        if hasattr(norm, "full_tensor"):  # a DTensor: reduced over the gradients' mesh
            norm = norm.full_tensor()
        norm = norm.detach().to(torch.float32)
    else:  # a stage without gradients still takes part in the reduction
        norm = torch.zeros((), dtype=torch.float32)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=pp_group)
            norm = norm.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"zero3: the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    if grads:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach)
    return norm
