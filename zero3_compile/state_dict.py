"""Full (unsharded) state dicts: keys and tensors exactly as the unsharded model has them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .shard import is_sharded


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """Gather every sharded parameter; return plain full tensors under the original keys.

    Every rank must call it (it all-gathers). With ``rank0_only=True`` the other ranks get ``{}``;
    ``cpu_offload=True`` moves the tensors to CPU. Tied parameters are gathered once.
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
                full = param.detach().full_tensor()
                gathered[id(param)] = full
        elif isinstance(value, DTensor):
            full = value.full_tensor()
        else:
            full = value
        if keep:
            result[key] = full.cpu() if cpu_offload and isinstance(full, torch.Tensor) else full
    return result


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a full (unsharded) state dict into a sharded model: each rank keeps its own chunk."""
    params = dict(model.named_parameters(remove_duplicate=False))
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"zero3: state dict does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass strict=False to load the keys that match"
        )
    for key, target in own.items():
        if key not in state_dict:
            continue
        source = state_dict[key]
        param = params.get(key)
        if param is not None and is_sharded(param):
            if tuple(source.shape) != tuple(param.shape):
                raise ValueError(
                    f"zero3: {key!r} has shape {tuple(source.shape)} in the state dict, "
                    f"{tuple(param.shape)} in the model"
                )
            local = param.to_local()
            world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
            chunks = torch.chunk(source, world, dim=0)
            if rank < len(chunks):
                local.copy_(chunks[rank])
        elif isinstance(target, torch.Tensor):
            target.copy_(source)
