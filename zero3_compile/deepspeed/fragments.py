"""DeepSpeed's ``deepspeed.utils`` accessors of one parameter's values, gradient and optimizer
state (``safe_get_full_fp32_param`` and the rest), on a sharded model's parameters.

As in DeepSpeed's ZeRO-3 (``deepspeed/utils/tensor_fragment.py``, 0.19):

- ``safe_get_full_*`` are collective: every rank of the parameter's mesh calls them (in the same
  order) and every rank gets the whole tensor;
- ``safe_set_full_*`` are not: every rank passes the same whole value and keeps its own rows;
- ``safe_get_local_*`` / ``safe_set_local_*`` read or write this rank's rows only (DeepSpeed's
  local partition is a flat slice; here it is the shard's rows: a value of any shape with the
  shard's number of elements is accepted).

Where DeepSpeed differs: a frozen parameter's values are returned (DeepSpeed returns None: it
keeps no fp32 copy of them); a ``safe_set_*`` on something that is no sharded parameter raises
(DeepSpeed does nothing); gradients come back in the dtype they are kept in (DeepSpeed casts to
fp32); "fp32" values are the shards' values, upcast where the shards are fp16/bf16 (zero3 keeps no
separate master copy). The parameter may be the sharded parameter (``model.parameters()``) or
the module attribute (``layer.weight``: a read that gathers it once more). Offloaded
parameters (``shard(offload=...)``) are loaded for the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..offload.params import loaded
from ..runtime.optimizers import optimizer_state
from ..runtime.write_through import whole_parameter
from ..sharding.state import ShardedParam, ShardState, state_of


def _state(param, what: str, strict: bool = True) -> ShardedParam | None:
    sharded = whole_parameter(param)
    state = state_of(sharded if sharded is not None else param)
    if state is None and strict:
        raise ValueError(
            f"zero3: {what} takes a parameter of a model sharded with zero3_compile.shard "
            f"(model.parameters() or layer.weight), got {type(param).__name__}"
        )
    return state


def _loaded(state: ShardedParam, write_back: bool = False):
    return loaded([state] if state.offload is not None else [], write_back=write_back)


def _fp32(value: torch.Tensor) -> torch.Tensor:
    if value.is_floating_point() and value.element_size() < 4:
        return value.float()
    return value


def _rows(state: ShardedParam, value: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's rows of a whole ``value`` of the parameter."""
    if state.layout is not None:
        raise ValueError(
            f"zero3: {what} of the tensor-parallel parameter {state.fqn!r} is not supported; "
            "write its DTensor's local tensor (param.to_local()) instead"
        )
    spec = state.spec
    if value.numel() != spec.full_numel:
        raise ValueError(
            f"zero3: {what}: {state.fqn!r} has {spec.full_numel} elements {spec.shape}, the "
            f"value {value.numel()} {tuple(value.shape)}"
        )
    return spec.local_view(value.detach().reshape(spec.shape), state.rank)


def _as_local(state: ShardedParam, local: torch.Tensor, value: torch.Tensor, what: str):
    if value.numel() != local.numel():
        raise ValueError(
            f"zero3: {what}: this rank holds {local.numel()} elements {tuple(local.shape)} of "
            f"{state.fqn!r}, the value has {value.numel()} {tuple(value.shape)}"
        )
    return value.detach().reshape(local.shape)


# ------------------------------------------------------------------ parameters


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole parameter, in fp32 (collective); None for a tensor that is no sharded
    parameter.

    Example:
        ```python
        full = safe_get_full_fp32_param(model.lm_head.weight)  # every rank calls it
        ```
    """
    state = _state(param, "safe_get_full_fp32_param", strict=False)
    if state is None:
        return None
    with torch.no_grad(), _loaded(state):
        return _fp32(state.param.full_tensor())


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter to the whole ``value`` (each rank keeps its rows; not collective: every
    rank passes the same value).

    Example:
        ```python
        safe_set_full_fp32_param(param, torch.zeros(param.shape))  # same value on every rank
        ```
    """
    state = _state(param, "safe_set_full_fp32_param")
    rows = _rows(state, value, "safe_set_full_fp32_param")
    with torch.no_grad(), _loaded(state, write_back=True):
        local = state.local()
        local.copy_(rows.to(local.dtype))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the parameter, in fp32 (a copy).

    Example:
        ```python
        rows = safe_get_local_fp32_param(param)  # this rank's rows
        ```
    """
    state = _state(param, "safe_get_local_fp32_param")
    with torch.no_grad(), _loaded(state):
        return _fp32(state.local()).clone()


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's rows of the parameter.

    Example:
        ```python
        safe_set_local_fp32_param(param, torch.zeros_like(param.to_local()))
        ```
    """
    state = _state(param, "safe_set_local_fp32_param")
    with torch.no_grad(), _loaded(state, write_back=True):
        local = state.local()
        local.copy_(_as_local(state, local, value, "safe_set_local_fp32_param").to(local.dtype))


# ------------------------------------------------------------------ gradients


def _grad(state: ShardedParam, what: str):
    if state.state in (ShardState.ACCUMULATING, ShardState.KEPT_GATHERED):
        raise RuntimeError(
            f"zero3: {what}: {state.fqn!r} is accumulating gradients with gradient sync off "
            "(not reduced yet); call it after z3.set_requires_gradient_sync(model, True) and "
            "the backward that reduces them"
        )
    return state.param.grad


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole (reduced) gradient (collective); None where it has none (before a backward,
    after ``zero_grad()``, a frozen parameter) or for a tensor that is no sharded parameter.

    Example:
        ```python
        loss.backward()
        grad = safe_get_full_grad(param)  # every rank calls it
        ```
    """
    state = _state(param, "safe_get_full_grad", strict=False)
    if state is None:
        return None
    grad = _grad(state, "safe_get_full_grad")
    if grad is None:
        return None
    with torch.no_grad():
        return grad.full_tensor()


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the gradient to the whole ``value`` (each rank keeps its rows; not collective).

    Example:
        ```python
        safe_set_full_grad(param, torch.zeros(param.shape))
        ```
    """
    state = _state(param, "safe_set_full_grad")
    rows = _rows(state, value, "safe_set_full_grad")
    _set_local_grad(state, rows, "safe_set_full_grad")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of the gradient (a copy); None where it has none.

    Example:
        ```python
        rows = safe_get_local_grad(param)
        ```
    """
    state = _state(param, "safe_get_local_grad")
    grad = _grad(state, "safe_get_local_grad")
    if grad is None:
        return None
    with torch.no_grad():
        return grad.to_local().clone()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's rows of the gradient (created if the parameter has none).

    Example:
        ```python
        safe_set_local_grad(param, torch.zeros_like(param.to_local()))
        ```
    """
    state = _state(param, "safe_set_local_grad")
    _set_local_grad(state, value, "safe_set_local_grad")


def _set_local_grad(state: ShardedParam, value: torch.Tensor, what: str) -> None:
    grad = _grad(state, what)
    with torch.no_grad():
        if grad is not None:
            local = grad.to_local()
            local.copy_(_as_local(state, local, value, what).to(local.dtype))
            return
        shard = state.param.to_local()
        if value.numel() != shard.numel():
            raise ValueError(
                f"zero3: {what}: this rank holds {shard.numel()} elements of {state.fqn!r}, the "
                f"value has {value.numel()}"
            )
        local = value.detach().reshape(shard.shape).to(shard.dtype).clone()
        state.param.grad = state.root.dp.wrap(local, state.spec, state.layout)


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor],
    update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """For each parameter with a gradient: gradient = ``update_func(full gradient, param)``
    (collective: one gather per parameter).

    Example:
        ```python
        safe_update_full_grad_vectorized(model.parameters(), lambda grad, p: grad.clamp(-1, 1))
        ```
    """
    for param in param_list:
        if not param.requires_grad:
            continue
        full = safe_get_full_grad(param)
        if full is not None:
            safe_set_full_grad(param, update_func(full, param))


# ------------------------------------------------------------------ optimizer state


def _optimizer_value(state: ShardedParam, key: str, what: str, strict: bool):
    held = optimizer_state(state.param) if state.param.requires_grad else None
    if not held:  # none, or an empty entry
        if strict:
            raise RuntimeError(
                f"zero3: {what}: no optimizer holds state for {state.fqn!r} yet (state is "
                "created by the first optimizer.step(), or loaded with z3.load_checkpoint)"
            )
        return None
    if key not in held:
        raise KeyError(
            f"zero3: {what}: the optimizer state of {state.fqn!r} has no {key!r}; it has "
            f"{sorted(held)}"
        )
    return held[key]


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"``,
    ``"momentum_buffer"``...) of the parameter (collective); None where no optimizer holds
    state for it yet (or for a tensor that is no sharded parameter). A 0-dim state (``"step"``)
    is returned as it is.

    Example:
        ```python
        m = safe_get_full_optimizer_state(model.lm_head.weight, "exp_avg")
        ```
    """
    state = _state(param, "safe_get_full_optimizer_state", strict=False)
    if state is None:
        return None
    value = _optimizer_value(state, optim_state_key, "safe_get_full_optimizer_state", False)
    if value is None or value.dim() == 0 or not hasattr(value, "full_tensor"):
        return value
    with torch.no_grad():
        return value.full_tensor()


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the optimizer state ``optim_state_key`` of the parameter to the whole ``value`` (each
    rank keeps its rows; not collective).

    Example:
        ```python
        safe_set_full_optimizer_state(param, torch.zeros(param.shape), "exp_avg")
        ```
    """
    what = "safe_set_full_optimizer_state"
    state = _state(param, what)
    held = _optimizer_value(state, optim_state_key, what, True)
    rows = _rows(state, value, what)
    with torch.no_grad():
        local = held.to_local()
        local.copy_(rows.to(local.dtype))


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """This rank's rows of the optimizer state ``optim_state_key`` of the parameter (a copy).

    Example:
        ```python
        rows = safe_get_local_optimizer_state(param, "exp_avg_sq")
        ```
    """
    what = "safe_get_local_optimizer_state"
    state = _state(param, what)
    held = _optimizer_value(state, optim_state_key, what, True)
    with torch.no_grad():
        return (held.to_local() if hasattr(held, "to_local") else held).clone()


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's rows of the optimizer state ``optim_state_key`` of the parameter.

    Example:
        ```python
        safe_set_local_optimizer_state(param, torch.zeros_like(param.to_local()), "exp_avg")
        ```
    """
    what = "safe_set_local_optimizer_state"
    state = _state(param, what)
    held = _optimizer_value(state, optim_state_key, what, True)
    with torch.no_grad():
        local = held.to_local()
        local.copy_(_as_local(state, local, value, what).to(local.dtype))
