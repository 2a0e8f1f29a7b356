"""Full (unsharded) state dicts: keys and tensors exactly as the unsharded model has them."""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..offload.params import loaded
from ..sharding.state import is_sharded, state_of


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """Gather every sharded parameter; return plain full tensors under the original keys.

    Every rank must call it (it all-gathers). With ``rank0_only=True`` the other ranks get ``{}``;
    ``cpu_offload=True`` moves the tensors to CPU. Tied parameters are gathered once.

    Example:
        ```python
        state = z3.full_state_dict(model, rank0_only=True)  # every rank calls it
        if dist.get_rank() == 0:
            torch.save(state, "model.pt")
        ```
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    keep = not rank0_only or dist.get_rank() == 0
    gathered: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        param = params.get(key)
        if param is not None and is_sharded(param):
            full = gathered.get(id(param))
            if full is None:
                # an offloaded shard: state_dict() gave a loaded copy (shard.py)
                source = value if state_of(param).offload is not None else param
                full = source.detach().full_tensor()
                gathered[id(param)] = full
        elif isinstance(value, DTensor):
            full = value.full_tensor()
        else:
            full = value
        if keep:
            result[key] = full.cpu() if cpu_offload and isinstance(full, torch.Tensor) else full
    return result


def save_full_state_dict(path: str | os.PathLike, model: nn.Module) -> None:
    """Write the full state dict to one file (rank 0 writes; every rank must call it).

    The file is written next to ``path`` and renamed over it, so an interrupted save leaves the
    previous file intact. Load it with ``load_full_state_dict`` or, unsharded,
    ``model.load_state_dict(torch.load(path, weights_only=True))``.

    Example:
        ```python
        z3.save_full_state_dict("model.pt", model)  # every rank calls it; rank 0 writes
        ```
    """
    state = full_state_dict(model, rank0_only=True, cpu_offload=True)
    if dist.get_rank() == 0:
        path = os.fspath(path)
        staging = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            torch.save(state, staging)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.remove(staging)
    dist.barrier()


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor] | str | os.PathLike | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a full (unsharded) state dict, or a file of one, into a sharded model.

    Each rank keeps its own chunk. A path is read with ``torch.load(weights_only=True)``: tensors
    and plain containers only, never arbitrary objects. With ``broadcast_from_rank0=True`` only
    rank 0 needs the state dict (others pass None) and tensors are sent one at a time, so no rank
    holds more than one full tensor beyond its shards.

    Example:
        ```python
        z3.load_full_state_dict(model, "model.pt")  # each rank keeps its rows
        ```
    """
    rank0 = dist.get_rank() == 0
    if isinstance(state_dict, (str, os.PathLike)) and (rank0 or not broadcast_from_rank0):
        state_dict = torch.load(state_dict, map_location="cpu", weights_only=True)
    own = model.state_dict(keep_vars=True)
    if broadcast_from_rank0:
        header = [_header(state_dict, own, strict) if rank0 else None]
        dist.broadcast_object_list(header, src=0)
        error, keys, metas = header[0]
    else:
        error, keys, metas = _header(state_dict, own, strict)
    if error:
        raise KeyError(error)
    params = dict(model.named_parameters(remove_duplicate=False))
    for key in keys:
        source = state_dict[key] if (rank0 or not broadcast_from_rank0) else None
        if broadcast_from_rank0:
            shape, dtype = metas[key]
            device = _collective_device(own[key])
            buffer = source.to(device) if rank0 else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buffer, src=0)
            source = buffer
        _load_one(key, source, own[key], params.get(key))


def _header(state_dict, own, strict: bool):
    """(error or None, keys to load, {key: (shape, dtype)}) for a full state dict."""
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    error = None
    if strict and (missing or unexpected):
        error = (
            f"zero3: state dict does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass strict=False to load the keys that match"
        )
    keys = [k for k in own if k in state_dict]
    metas = {k: (tuple(state_dict[k].shape), state_dict[k].dtype) for k in keys}
    return error, keys, metas


def _collective_device(target: torch.Tensor) -> torch.device:
    local = target.to_local() if isinstance(target, DTensor) else target
    return local.device


def _load_one(key: str, source: torch.Tensor, target: torch.Tensor, param) -> None:
    if param is not None and is_sharded(param):
        if tuple(source.shape) != tuple(param.shape):
            raise ValueError(
                f"zero3: {key!r} has shape {tuple(source.shape)} in the state dict, "
                f"{tuple(param.shape)} in the model"
            )
        state = state_of(param)
        offloaded = [state] if state.offload is not None else []
        with loaded(offloaded, write_back=True):
            param.to_local().copy_(state.spec.local_view(source, state.rank))
    elif isinstance(target, torch.Tensor):
        target.copy_(source)
