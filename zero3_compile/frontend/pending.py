"""``param.grad`` while a sharded parameter's gradient is pending unreduced: ``PendingGrad``.

While gradient sync is off (``set_requires_gradient_sync(model, False)``) the micro-batches'
gradients accumulate unreduced outside ``param.grad`` (a sink or the kept parameter's ``.grad``,
``accumulation.py``) and are reduced into it when sync is turned back on. Code that scales
gradients in place in between would miss them and leave the result ``k`` times too large:
``torch.distributed.pipelining``'s schedules call ``stage.scale_grads(n_microbatches)``
(``p.grad.div_(n)``) at the end of ``step()``, before a user's ``set_requires_gradient_sync(model,
True)`` after it. So for the window ``param.grad`` is a ``PendingGrad``: in-place scalings by a
number (``mul_``, ``div_``, their ``_foreach_`` forms) apply to the pending gradient when it is
reduced (and to the gradient ``param.grad`` held before, at once); ``zero_()`` clears what
``param.grad`` held (pending gradients stay pending, as FSDP2's do); any other use raises an
error that names the fix instead of computing with a partial gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor
from ..offload.deferred import wrapper_tensor
from ..offload.grads import with_local

aten = torch.ops.aten


class _Cell:
    """What the aliases of one pending gradient share."""

    def __init__(self, fqn: str, base: torch.Tensor | None):
        self.fqn = fqn
        self.base = base  # the local gradient param.grad held when the window opened
        self.scalings: list[tuple[bool, float]] = []  # (divide, number), in the order asked


class PendingGrad(torch.Tensor):
    """The local tensor of ``param.grad`` while the parameter's gradient is pending unreduced."""

    _cell: _Cell

    @staticmethod
    def __new__(cls, cell: _Cell, shape, dtype, device):
        self = wrapper_tensor(cls, shape, dtype, device)
        self._cell = cell
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"PendingGrad({self._cell.fqn!r}, shape={tuple(self.shape)})"

    def _alias(self) -> PendingGrad:
        return PendingGrad(self._cell, self.shape, self.dtype, self.device)

    def _scale(self, divide: bool, number) -> None:
        """Record ``div_(number)`` / ``mul_(number)``; apply it to what ``param.grad`` held."""
        cell = self._cell
        cell.scalings.append((divide, _number(number)))
        if cell.base is not None:
            apply_scalings(cell.base, cell.scalings[-1:])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = args[0] if args and isinstance(args[0], PendingGrad) else None
        if pending is not None:
            if func in (aten.detach.default, aten.alias.default):
                return pending._alias()
            if func in (aten.view.default, aten._unsafe_view.default) and tuple(args[1]) == tuple(
                pending.shape
            ):
                return pending._alias()  # DTensor.from_local's view_as
            if func in _SCALE and _is_number(args[1]) and not kwargs:
                pending._scale(func in _DIVIDE, args[1])
                return pending
            if func is aten.zero_.default:
                if pending._cell.base is not None:
                    pending._cell.base.zero_()
                return pending
        if func in _FOREACH_SCALE:
            tensors, other = args[0], args[1]
            factors = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
            if not kwargs and all(_is_number(f) for f in factors):
                for tensor, factor in zip(tensors, factors):
                    if isinstance(tensor, PendingGrad):
                        tensor._scale(func in _DIVIDE, factor)
                    else:
                        apply_scalings(tensor, [(func in _DIVIDE, _number(factor))])
                return None
        names = sorted({a._cell.fqn for a in _flat(args, kwargs) if isinstance(a, PendingGrad)})
        raise RuntimeError(
            f"zero3: {func} reads the gradient of {', '.join(map(repr, names))}, which is pending "
            "unreduced while gradient sync is off (set_requires_gradient_sync(model, False)): "
            "turn sync back on first (z3.set_requires_gradient_sync(model, True); with "
            "torch.distributed.pipelining, use keep_gathered=True or "
            "zero3_compile.parallel.PipelineStage, which syncs on each stage's last "
            "micro-batch). Only in-place scaling by a number "
            "(p.grad.div_(n), as pipeline schedules do) is applied to a pending gradient"
        )


_DIVIDE = {
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten._foreach_div_.Scalar,
    aten._foreach_div_.List,
    aten._foreach_div_.ScalarList,
    aten._foreach_div_.Tensor,
}
_SCALE = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar}
_FOREACH_SCALE = {
    aten._foreach_mul_.Scalar,
    aten._foreach_mul_.List,
    aten._foreach_mul_.ScalarList,
    aten._foreach_mul_.Tensor,
    aten._foreach_div_.Scalar,
    aten._foreach_div_.List,
    aten._foreach_div_.ScalarList,
    aten._foreach_div_.Tensor,
}


def _is_number(value) -> bool:
    if isinstance(value, PendingGrad):
        return False
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float))


def _number(value):
    return value.item() if isinstance(value, torch.Tensor) else value


def _flat(args, kwargs):
    out = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            out.extend(value)
        else:
            out.append(value)
    return out


def open_window(state) -> None:
    """Make ``param.grad`` a ``PendingGrad`` (gradient sync turned off, or a gradient pending for
    a parameter frozen when it was turned off)."""
    param = state.param
    if _pending_of(param) is not None:
        return
    grad = param.grad
    base = None if grad is None else (local_tensor(grad) if isinstance(grad, DTensor) else grad)
    local = state.local()
    cell = _Cell(state.fqn, base)
    pending = PendingGrad(cell, local.shape, local.dtype, local.device)
    param.grad = with_local(param, pending)


def close_window(state) -> list[tuple[bool, float]]:
    """Put back the gradient ``param.grad`` held (scaled as it was asked to be); return the
    scalings the pending gradient is to get when reduced (none asked, or ``param.grad`` was
    replaced or cleared meanwhile: [])."""
    param = state.param
    pending = _pending_of(param)
    if pending is None:
        return []
    cell = pending._cell
    param.grad = None if cell.base is None else with_local(param, cell.base)
    return cell.scalings


def apply_scalings(tensor: torch.Tensor, scalings: list[tuple[bool, float]]) -> None:
    """The recorded in-place scalings on ``tensor``, the same operations in the same order."""
    for divide, number in scalings:
        tensor.div_(number) if divide else tensor.mul_(number)


def _pending_of(param) -> PendingGrad | None:
    grad = param.grad
    local = local_tensor(grad) if isinstance(grad, DTensor) else grad
    return local if isinstance(local, PendingGrad) else None
