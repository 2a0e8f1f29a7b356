"""Loaders that work on the shards: ``loading(model)`` and ``adopt``.

A checkpoint loader (Hugging Face's, through ``integrations/hf``) reads each parameter's rows on
the rank that holds them and assigns the result to the module. Inside ``loading(model)`` every
parameter is in ``ShardState.LOADING``: reading ``module.weight`` gives the sharded parameter
itself (a ``DTensor`` with the full shape, this rank's rows in its local tensor: what DTensor-aware
loaders expect), and assigning a parameter whose local tensor holds this rank's rows
(``DTensor`` of the same placement, or a plain tensor of the local shape) adopts its values into
the existing sharded parameter: the ``nn.Parameter`` object, its state and the optimizers'
references stay. A shard still on the ``meta`` device gets real storage then; with offload, the
adopted shard goes to the offload store at once, so no rank holds more than its shards in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..offload.model import register_loaded
from ..offload.params import loaded
from ..sharding.state import ShardedParam, ShardState, module_state


def sharded_states(model: nn.Module) -> list[ShardedParam]:
    found: dict[int, ShardedParam] = {}
    for module in model.modules():
        state = module_state(module)
        if state is not None:
            for param_state in state.params.values():
                found.setdefault(id(param_state), param_state)
    return list(found.values())


def resting_states(model: nn.Module, doing: str, hint: str = "") -> list[ShardedParam]:
    """``sharded_states(model)``, all of them ``SHARDED``; else a RuntimeError naming the first
    that is not (``doing``: what needs them at rest; ``hint``: how to get there)."""
    states = sharded_states(model)
    busy = [s for s in states if s.state is not ShardState.SHARDED]
    if busy:
        raise RuntimeError(
            f"zero3: {doing} needs every parameter sharded; {busy[0].fqn!r} is "
            f"{busy[0].state.name}{f' ({hint})' if hint else ''}"
        )
    return states


@contextlib.contextmanager
def loading(model: nn.Module) -> Iterator[list[ShardedParam]]:
    """Every sharded parameter of ``model`` in ``LOADING`` for the ``with`` block."""
    states = sharded_states(model)
    busy = [s for s in states if s.state is not ShardState.SHARDED]
    if busy:
        raise RuntimeError(
            f"zero3: cannot load into {busy[0].fqn!r} while it is {busy[0].state.name}; turn "
            "gradient sync back on and leave z3.gathered() first"
        )
    for state in states:
        state.transition(ShardState.LOADING)
    try:
        yield states
    finally:
        for state in states:
            if state.state is ShardState.LOADING:
                state.transition(ShardState.SHARDED)


@torch.no_grad()
def adopt(state: ShardedParam, value: torch.Tensor) -> None:
    """Make ``value`` (this rank's rows of ``state``'s parameter) the shard's values."""
    spec = state.spec
    flagged = getattr(value, "_is_hf_initialized", False)
    local = value.to_local() if isinstance(value, DTensor) else value
    if isinstance(local, nn.Parameter):
        local = local.detach()
    expected = spec.local_shape(state.rank)
    if isinstance(value, DTensor) and tuple(value.shape) != spec.shape:
        raise ValueError(
            f"zero3: {spec.fqn!r} has shape {spec.shape}; the loader assigned one of shape "
            f"{tuple(value.shape)}"
        )
    if tuple(local.shape) != expected:
        raise ValueError(
            f"zero3: rank {state.rank} holds rows of {spec.fqn!r} of shape {expected}; the loader "
            f"assigned {tuple(local.shape)}"
        )
    param = state.param
    current = param.to_local()
    dtype = current.dtype
    if current.device.type == "meta":
        fresh = local.to(dtype=dtype).contiguous()
        if fresh is local and not fresh.untyped_storage().resizable():
            fresh = fresh.clone()  # memory of a file reader's: a shard must own its storage
        real = nn.Parameter(
            state.root.dp.wrap(fresh, spec, state.layout), requires_grad=param.requires_grad
        )
        torch.utils.swap_tensors(param, real)  # also swaps the attributes: attach the state again
        state.attach(param)
    elif state.offload is not None:  # into the store, as a new version
        with loaded([state], write_back=True):
            param.to_local().copy_(local)
    else:
        current.copy_(local)
    # what Hugging Face's loader marks as loaded stays marked (a placeholder for a missing key
    # does not)
    param._is_hf_initialized = bool(flagged)
    register_loaded(state)
